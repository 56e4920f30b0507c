"""Where one decode step's time goes: the engine's step loop under ``cProfile`` (host side), then
under ``torch.profiler`` (kernels, on CUDA), for a few batch sizes.

    python3 -m bench.gpu_step_profile [--model qwen3-0.6b-shape] [--batches 1,32] [--enforce-eager]

The host profile answers whether a step waits on the device (time in the sampler's ``tolist``)
or on Python; the kernel table says which kernels fill the device's share. Both print as text:
this is a diagnosis tool, its figures go into docs/benchmarks.md by hand.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from dataclasses import dataclass

import torch

from bench.gpu_decode import build_engine, random_prompts, timed_engine_run


@dataclass
class StepProfileConfig:
    model: str = "qwen3-0.6b-shape"
    device: str = "cuda"
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (1, 32)
    prompt_len: int = 128
    output_len: int = 64
    enforce_eager: bool = False
    top: int = 20

    def __post_init__(self):
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive, got {self.batches}")
        if self.prompt_len < 1 or self.output_len < 2 or self.top < 1:
            raise ValueError("prompt_len >= 1, output_len >= 2 and top >= 1 are required")


@dataclass
class StepProfile:
    batch: int
    ms_per_step: float
    host_table: str  # cProfile, sorted by own time
    kernel_table: str  # torch.profiler, sorted by device time (CPU time on CPU)


def profile_batch(llm, cfg: StepProfileConfig, batch: int) -> StepProfile:
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(batch, cfg.prompt_len, vocab, seed=batch)
    lens = [cfg.output_len] * batch
    # Warm: graphs, allocator, kernels compiled. The runs below then find these prompts in the
    # prefix cache, so their prefill is a single token each and decode steps fill the profiles.
    timed_engine_run(llm, prompts, [2] * batch)
    host = cProfile.Profile()
    host.enable()
    timing = timed_engine_run(llm, prompts, lens)
    host.disable()
    out = io.StringIO()
    pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(cfg.top)
    on_cuda = cfg.device.startswith("cuda")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        timed_engine_run(llm, prompts, lens)
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    kernels = prof.key_averages().table(sort_by=sort, row_limit=cfg.top,
                                        max_name_column_width=70)
    steps = timing.decode_tokens / batch
    return StepProfile(batch, 1000 * timing.decode_s / steps, out.getvalue(), kernels)


def run(cfg: StepProfileConfig) -> list[StepProfile]:
    llm = build_engine(cfg.model, cfg.device, cfg.dtype, max(cfg.batches),
                       max(2048, max(cfg.batches) * cfg.prompt_len), cfg.enforce_eager,
                       num_gpu_blocks=max(cfg.batches) * (
                           (cfg.prompt_len + cfg.output_len) // 16 + 2))
    try:
        return [profile_batch(llm, cfg, b) for b in cfg.batches]
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_step_profile")
    p.add_argument("--model", default=StepProfileConfig.model)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    cfg = StepProfileConfig(a.model, a.device, dtype, tuple(int(b) for b in a.batches.split(",")),
                            a.prompt_len, a.output_len, a.enforce_eager, a.top)
    for r in run(cfg):
        print(f"== batch {r.batch}: {r.ms_per_step:.2f} ms a decode step "
              f"({'eager' if cfg.enforce_eager else 'graphs where the device has them'})")
        print(r.host_table)
        print(r.kernel_table)


if __name__ == "__main__":
    main()
