"""``pdserve bench offline``: the engine vs HF ``generate`` (static batches) vs a matmul roofline.

All three run in the same process on the same weights and the same requests:
(a) the engine with continuous batching and chunked prefill;
(b) Hugging Face ``generate`` in static batches with left padding (every request in a batch
    decodes until the longest is done; only requested tokens count);
(c) the roofline: the model's linear layers alone (no attention, no Python), replayed at the
    exact per-step token counts the engine ran, through the engine's own GEMM (oneDNN on packed
    weights on the CPU); beside it the same replay through ``F.linear`` (MKL's sgemm on the
    CPU), the GEMM the engine used before packing and HF uses, for comparison.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace

import torch

from bench.workloads import WORKLOADS, OfflineRequests, make_requests


@dataclass
class OfflineResult:
    workload: str
    model: str
    num_requests: int
    num_output_tokens: int
    engine_s: float
    hf_s: float
    roofline_s: float
    engine_tok_s: float
    hf_tok_s: float
    roofline_tok_s: float
    ratio_vs_hf: float
    ratio_vs_roofline: float
    # The same replay through F.linear on same-shaped weights.
    f_linear_roofline_tok_s: float
    ratio_vs_f_linear_roofline: float
    num_threads: int
    tensor_parallel_size: int = 1
    # TP > 1 only: rank 0's time inside all-reduce/all-gather over the engine's time, and the
    # same requests on a TP=1 engine timed in the same run.
    comm_share: float | None = None
    tp1_tok_s: float | None = None
    ratio_vs_tp1: float | None = None
    # The GEMM the linear layers ran on ("onednn", "mkl" or "torch": --linear-backend auto
    # picks per host, so figures from two machines may compare two libraries).
    linear_kernel: str = "torch"
    # Whether the engine's steps ran through the CPU model graph (engine/cpu_graph.py) rather
    # than the Python model, and how many steps did.
    cpu_graph_steps: int = 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--output-len", default=None,
                   help="LO-HI output tokens per request (uniform) instead of the workload's")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="run the engine at this TP size, and at TP=1 beside it when > 1")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_engine(model: str, reqs: OfflineRequests, dtype: str, args,
               tp: int = 1) -> tuple[float, object]:
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, detokenize=False, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=tp)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in reqs.output_lens]
    llm.generate(reqs.prompts[:2], params[:2])  # warm-up
    # Its prompts must not be cached for the timed run (HF computes every prompt).
    llm.engine.reset_prefix_cache()
    llm.engine.step_num_tokens.clear()
    llm.engine.step_num_sampled.clear()
    llm.engine.executor.group.comm_seconds = 0.0
    t0 = time.perf_counter()
    outs = llm.generate(reqs.prompts, params)
    elapsed = time.perf_counter() - t0
    got = sum(len(o.token_ids) for o in outs)
    if got != reqs.num_output_tokens:
        raise RuntimeError(f"engine produced {got} tokens, expected {reqs.num_output_tokens}")
    return elapsed, llm


@torch.inference_mode()
def run_hf(path, reqs: OfflineRequests, dtype: torch.dtype, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    pad = 0
    # Untimed, as the engine's warm-up is: one-time costs stay out of the timed batches.
    model.generate(input_ids=torch.tensor([reqs.prompts[0][:8]]), max_new_tokens=2,
                   do_sample=False, eos_token_id=None, pad_token_id=pad)
    total = 0.0
    for start in range(0, len(reqs.prompts), batch_size):
        prompts = reqs.prompts[start:start + batch_size]
        max_new = max(reqs.output_lens[start:start + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                       min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                       pad_token_id=pad)
        total += time.perf_counter() - t0
    return total


@torch.inference_mode()
def run_roofline(llm, reqs: OfflineRequests, f_linear: bool = False) -> float:
    """Times every linear layer's GEMM at the engine's recorded step sizes: through the layer's
    own matmul, or (``f_linear``) through F.linear on random weights of the same shapes."""
    from engine.layers import LinearBase, ParallelLMHead

    model = llm.engine.executor.runner.model
    device = llm.engine.device
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    dtype = head.weight.dtype
    gemms = [(m.input_size, m.matmul) for m in layers]
    lm_head = (head.weight.shape[1], head.matmul)
    if f_linear:
        gemms = [(m.input_size, _f_linear(m.output_size, m.input_size, dtype, device))
                 for m in layers]
        lm_head = (lm_head[0], _f_linear(head.weight.shape[0], lm_head[0], dtype, device))
    counts: dict[tuple[int, int], int] = {}
    for s in zip(llm.engine.step_num_tokens, llm.engine.step_num_sampled):
        counts[s] = counts.get(s, 0) + 1
    total = 0.0
    for (n_tok, n_samp), count in counts.items():
        # One input per distinct input width (hidden, attention output, MLP intermediate).
        xs = {w: torch.randn(n_tok, w, dtype=dtype, device=device) for w, _ in gemms}
        xs_head = torch.randn(n_samp, lm_head[0], dtype=dtype, device=device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for width, gemm in gemms:
                gemm(xs[width])
            if n_samp:
                lm_head[1](xs_head)
            best = min(best, time.perf_counter() - t0)
        total += best * count
    return total


def _linear_kernel(llm) -> str:
    from engine.layers import LinearBase

    model = llm.engine.executor.runner.model
    layer = next(m for m in model.modules() if isinstance(m, LinearBase))
    return "torch" if layer.packed_weight is None else layer.packed_weight.kernel


def _cpu_graph_steps(llm) -> int:
    from engine.cpu_graph import CPUModelGraph

    graphs = getattr(llm.engine.executor.runner, "graphs", None)
    return graphs.num_replays if isinstance(graphs, CPUModelGraph) else 0


def _f_linear(out_features: int, in_features: int, dtype: torch.dtype, device):
    # A weight of its own per layer, as the model has: one shared weight would stay in cache.
    w = torch.randn(out_features, in_features, dtype=dtype, device=device)
    return lambda x: torch.nn.functional.linear(x, w)


def main(args: argparse.Namespace) -> int:
    from engine.presets import resolve_model

    w = WORKLOADS[args.workload]
    if args.output_len is not None:
        from bench.serve import _range

        w = replace(w, output_len=_range(args.output_len, "output-len"))
    path = resolve_model(w.model)
    from engine.model_config import ModelConfig
    vocab = ModelConfig.from_pretrained(path).vocab_size
    reqs = make_requests(w, vocab, args.num_requests)
    log = (lambda *a: None) if args.json else print
    log(f"workload {w.name}: {len(reqs.prompts)} requests on {w.model} ({w.dtype}), "
        f"{reqs.num_output_tokens} output tokens, torch threads {torch.get_num_threads()}")
    tp = args.tensor_parallel_size
    engine_s, llm = run_engine(w.model, reqs, w.dtype, args, tp)
    comm_share = llm.engine.executor.comm_seconds / engine_s if tp > 1 else None
    log(f"engine:   {engine_s:8.2f} s (TP={tp})")
    # At TP > 1 this replays rank 0's weight shards: the per-rank matmul time.
    linear_kernel = _linear_kernel(llm)
    graph_steps = _cpu_graph_steps(llm)
    log(f"linear layers: {linear_kernel}; steps through the CPU model graph: {graph_steps}")
    roof_s = run_roofline(llm, reqs)
    log(f"roofline: {roof_s:8.2f} s (the engine's GEMM)")
    roof_f_s = run_roofline(llm, reqs, f_linear=True)
    log(f"roofline: {roof_f_s:8.2f} s (F.linear)")
    llm.shutdown()
    del llm
    tp1_s = None
    if tp > 1:
        tp1_s, tp1 = run_engine(w.model, reqs, w.dtype, args, 1)
        del tp1
        log(f"engine:   {tp1_s:8.2f} s (TP=1)")
    hf_s = run_hf(path, reqs, getattr(torch, w.dtype), args.hf_batch_size)
    log(f"hf:       {hf_s:8.2f} s")
    n = reqs.num_output_tokens
    res = OfflineResult(w.name, w.model, len(reqs.prompts), n, engine_s, hf_s, roof_s,
                        n / engine_s, n / hf_s, n / roof_s, hf_s / engine_s, roof_s / engine_s,
                        n / roof_f_s, roof_f_s / engine_s,
                        torch.get_num_threads(), tp, comm_share,
                        None if tp1_s is None else n / tp1_s,
                        None if tp1_s is None else tp1_s / engine_s, linear_kernel, graph_steps)
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        print(f"engine {res.engine_tok_s:.1f} tok/s | hf {res.hf_tok_s:.1f} tok/s | "
              f"roofline {res.roofline_tok_s:.1f} tok/s")
        print(f"engine/hf = {res.ratio_vs_hf:.2f}   engine/roofline = {res.ratio_vs_roofline:.2f}"
              f"   engine/F.linear roofline = {res.ratio_vs_f_linear_roofline:.2f}")
        if tp > 1:
            print(f"TP={tp} {res.engine_tok_s:.1f} tok/s vs TP=1 {res.tp1_tok_s:.1f} tok/s: "
                  f"TP{tp}/TP1 = {res.ratio_vs_tp1:.2f}; communication "
                  f"{100 * comm_share:.1f}% of TP={tp} engine time")
    return 0
