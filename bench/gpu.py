"""``pdserve bench gpu``: the GPU benchmark suite, every part printing its peer or limit beside it.

decode  engine vs HF transformers ``generate`` (static batch, left padding) on the same model,
        dtype and device, at each --decode-batches size: --prompt-len random-token prompts,
        exactly --output-len tokens (ignore_eos, greedy). Decode tok/s excludes prefill: the
        clock starts when every sequence holds its first token and counts only tokens sampled
        after that (bench/gpu_decode.py); both sides warm up on other prompts first.
w1      nano-vllm's bench.py workload (256 seqs, input and output lengths U[100, 1024], seed 0,
        random ids, ignore_eos, temperature 0.6): output tokens / wall time, as a fraction of
        28.6k tok/s, a published H100 figure used as a reference constant, not measured here.
graphs  decode tok/s with CUDA graphs (enforce_eager=False) vs eager, same method as decode.
        Off CUDA only the eager side runs.
kernel  the Triton paged decode kernel's K/V read bandwidth vs a device-to-device copy
        (bench/gpu_kernel.py). CUDA only.

Progress goes to stderr; stdout holds the markdown tables, or with --json one object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

PARTS = ("decode", "w1", "graphs", "kernel")


@dataclass(frozen=True)
class GpuBenchOptions:
    parts: tuple[str, ...]
    model: str
    device: str
    dtype: str
    decode_batches: tuple[int, ...]
    graph_batches: tuple[int, ...]
    prompt_len: int
    output_len: int
    num_seqs_w1: int
    w1_len_range: tuple[int, int]
    kernel_shapes: tuple[tuple[int, int], ...]
    kernel_reps: int
    kernel_block_size: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    seed: int

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass
class BenchEnv:
    device: str
    device_name: str
    torch_version: str
    triton_version: str | None
    transformers_version: str
    python_version: str
    model: str
    dtype: str


@dataclass
class GpuBenchResult:
    env: BenchEnv
    decode: list | None = None
    w1: object | None = None
    graphs: list | None = None
    kernel: list | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # part -> exception


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--model", default="qwen3-0.6b-shape", help="HF folder or preset name")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--decode-batches", default="1,64")
    p.add_argument("--graph-batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128, help="decode and graphs parts")
    p.add_argument("--output-len", type=int, default=256, help="decode and graphs parts")
    p.add_argument("--num-seqs-w1", type=int, default=256)
    p.add_argument("--w1-min-len", type=int, default=100)
    p.add_argument("--w1-max-len", type=int, default=1024)
    p.add_argument("--kernel-shapes", default="64x1024,8x8192,1x32768",
                   help="comma list of BATCHxCONTEXT")
    p.add_argument("--kernel-reps", type=int, default=20)
    p.add_argument("--kernel-block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="engine prefill chunk budget (nano-vllm's default)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the w1 engine's KV budget (the decode engines size theirs exactly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--json-out", default=None, help="also write the JSON object to this file")


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} needs positive integers, got {text!r}")
    return values


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        b, sep, c = item.lower().partition("x")
        if not sep or not (b.isdigit() and c.isdigit()) or int(b) < 1 or int(c) < 1:
            raise ValueError(f"--kernel-shapes entries must be BATCHxCONTEXT, got {item!r}")
        shapes.append((int(b), int(c)))
    if not shapes:
        raise ValueError("--kernel-shapes is empty")
    return tuple(shapes)


def _positive(**values) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def parse_options(args: argparse.Namespace) -> GpuBenchOptions:
    parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"--only takes a comma list of {', '.join(PARTS)}, got {args.only!r}")
    device = args.device
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    _positive(prompt_len=args.prompt_len, num_seqs_w1=args.num_seqs_w1,
              w1_min_len=args.w1_min_len, kernel_reps=args.kernel_reps,
              max_num_batched_tokens=args.max_num_batched_tokens)
    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (decode needs a token after the first), "
                         f"got {args.output_len}")
    if args.w1_max_len < args.w1_min_len:
        raise ValueError(f"--w1-max-len ({args.w1_max_len}) < --w1-min-len ({args.w1_min_len})")
    bs = args.kernel_block_size
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"--kernel-block-size must be a power of two, got {bs}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                         f"{args.gpu_memory_utilization}")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    return GpuBenchOptions(
        parts, args.model, device, dtype, _int_list("decode-batches", args.decode_batches),
        _int_list("graph-batches", args.graph_batches), args.prompt_len, args.output_len,
        args.num_seqs_w1, (args.w1_min_len, args.w1_max_len), _shapes(args.kernel_shapes),
        args.kernel_reps, bs, args.max_num_batched_tokens, args.gpu_memory_utilization, args.seed)


def bench_env(opts: GpuBenchOptions) -> BenchEnv:
    import torch
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if opts.on_cuda:
        name = torch.cuda.get_device_name(torch.device(opts.device))
    else:
        name = platform.processor() or platform.machine()
    return BenchEnv(opts.device, name, torch.__version__, triton_version,
                    transformers.__version__, platform.python_version(), opts.model, opts.dtype)


def run_parts(opts: GpuBenchOptions, log,
              after_part: Callable[[GpuBenchResult], None] | None = None) -> GpuBenchResult:
    """Every part asked for; ``after_part(result so far)`` after each one (a run cut short,
    by a lease's time limit, keeps what it measured)."""
    res = GpuBenchResult(bench_env(opts))
    log(f"device {res.env.device_name}, torch {res.env.torch_version}, "
        f"triton {res.env.triton_version}")
    if "kernel" in opts.parts and not opts.on_cuda:
        res.skipped["kernel"] = "the Triton paged decode kernel needs CUDA; --device cpu"
    # Kernel first (no model needed); w1 last: its engine takes most of the device memory.
    for part in ("kernel", "decode", "graphs", "w1"):
        if part in opts.parts and part not in res.skipped:
            _run_part(part, opts, res, log)
            if after_part is not None:
                after_part(res)
    return res


def _run_part(part: str, opts: GpuBenchOptions, res: GpuBenchResult, log) -> None:
    """One part; a failure is recorded and the run goes on, so an unattended run still
    reports every part that worked."""
    from bench import gpu_parts
    from engine.setup import free_device_memory

    try:
        if part == "kernel":
            from bench.gpu_kernel import run_kernel
            res.kernel = run_kernel(opts, log)
        elif part == "decode":
            path, vocab = _resolve(opts.model, log)
            res.decode = gpu_parts.run_decode(opts, path, vocab, log)
        elif part == "graphs":
            res.graphs = gpu_parts.run_graphs(opts, _resolve(opts.model, log)[1], log)
        else:
            res.w1 = gpu_parts.run_w1(opts, _resolve(opts.model, log)[1], log)
    except Exception as e:  # noqa: BLE001  (reported below and in the result)
        traceback.print_exc(file=sys.stderr)
        res.errors[part] = f"{type(e).__name__}: {e}"
        log(f"{part}: FAILED ({res.errors[part]}); going on")
    free_device_memory()


def _resolve(model: str, log) -> tuple[object, int]:
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    log(f"resolving {model} (presets are generated on first use) ...")
    path = resolve_model(model)
    return path, ModelConfig.from_pretrained(path).vocab_size


def main(args: argparse.Namespace) -> int:
    opts = parse_options(args)
    if opts.on_cuda:
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"--device {opts.device} but CUDA is not available here "
                             f"(use --device cpu for a CPU smoke run)")

    def log(msg: str) -> None:
        print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)

    def write(res: GpuBenchResult) -> None:
        tmp = f"{args.json_out}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(res), f, indent=2)
        os.replace(tmp, args.json_out)  # whole or not at all, if the run is killed meanwhile

    res = run_parts(opts, log, write if args.json_out else None)
    if args.json_out:
        write(res)
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        from bench.gpu_report import render
        print(render(res))
    return 1 if res.errors else 0
