"""Markdown rendering of ``pdserve bench gpu`` results (the --json form is the dataclasses)."""
from __future__ import annotations


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _num(x, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render_env(env) -> str:
    return (f"device: {env.device_name} ({env.device})\n"
            f"torch {env.torch_version}, triton {env.triton_version or 'not installed'}, "
            f"transformers {env.transformers_version}, python {env.python_version}\n"
            f"model {env.model} ({env.dtype})")


def render_decode(rows) -> str:
    head = ["batch", "prompt", "output", "engine decode tok/s", "HF decode tok/s", "engine/HF",
            "engine prefill s", "HF prefill s"]
    body = [[str(r.batch), str(r.prompt_len), str(r.output_len), _num(r.engine_decode_tok_s),
             _num(r.hf_decode_tok_s), _num(r.ratio_vs_hf, ".2f"), _num(r.engine_prefill_s, ".3f"),
             _num(r.hf_prefill_s, ".3f")] for r in rows]
    return ("## Decode throughput: engine vs HF transformers generate\n"
            "(tokens sampled after every sequence had its first token / time since then)\n\n"
            + _table(head, body))


def render_w1(r) -> str:
    head = ["seqs", "lengths", "prompt tokens", "output tokens", "time s", "engine tok/s",
            "reference tok/s", "engine/reference"]
    body = [[str(r.num_seqs), f"U[{r.len_range[0]}, {r.len_range[1]}]", str(r.prompt_tokens),
             str(r.output_tokens), _num(r.elapsed_s, ".2f"), _num(r.output_tok_s),
             _num(r.reference_tok_s), _num(r.fraction_of_reference, ".3f")]]
    return ("## W1 (nano-vllm bench.py workload): output tokens / wall time\n\n"
            + _table(head, body) + f"\n\nreference: {r.reference_note}")


def render_graphs(rows, on_cuda: bool) -> str:
    head = ["batch", "eager decode tok/s", "CUDA graphs decode tok/s", "graphs/eager",
            "graph replays"]
    body = [[str(r.batch), _num(r.eager_decode_tok_s), _num(r.graph_decode_tok_s),
             _num(r.ratio, ".2f"), _num(r.graph_replays, "d")] for r in rows]
    note = "" if on_cuda else "\n\nCUDA graphs are CUDA-only: this run measured eager only."
    return "## CUDA graphs on vs off (decode)\n\n" + _table(head, body) + note


def render_kernel(rows) -> str:
    head = ["batch x context", "K+V MiB", "kernel us", "kernel GB/s", "copy us",
            "copy GB/s (r+w)", "kernel/copy"]
    body = [[f"{r.batch} x {r.context}", _num(r.kv_mib), _num(r.kernel_us), _num(r.kernel_gbps),
             _num(r.copy_us), _num(r.copy_gbps), _num(r.ratio, ".2f")] for r in rows]
    return ("## Paged decode attention kernel: K/V bytes read per call / time vs "
            "device-to-device copy\n\n" + _table(head, body))


def render(result) -> str:
    parts = [render_env(result.env)]
    if result.decode is not None:
        parts.append(render_decode(result.decode))
    if result.w1 is not None:
        parts.append(render_w1(result.w1))
    if result.graphs is not None:
        parts.append(render_graphs(result.graphs, result.env.device.startswith("cuda")))
    if result.kernel is not None:
        parts.append(render_kernel(result.kernel))
    parts += [f"{name}: skipped ({why})" for name, why in result.skipped.items()]
    parts += [f"{name}: FAILED ({why})" for name, why in result.errors.items()]
    return "\n\n".join(parts)
