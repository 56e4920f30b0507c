"""``pdserve bench serve``: online serving through the router vs two baselines.

A real cluster (redis, router, prefill and decode workers as separate processes, started by
``router.launcher.Cluster``) serves closed loops at each concurrency and Poisson arrivals at each
rate. Then, each with the machine to itself, the same closed loops on the same requests run on
an aggregated cluster (the same router and client, one decode worker that prefills every prompt
itself: what disaggregation costs, serving stack aside) and on an in-process ``LLMEngine``
stepped directly (no gRPC, no router, no client). Also a shared-prefix phase: TTFT when the
prompt's prefix is already cached on the prefill worker vs a fresh prefix.

Metric definitions follow vLLM's ``benchmark_serving`` (see ``bench.serve_metrics``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass

from bench.serve_load import (LoadRequests, closed_loop, inprocess_closed_loop, one_request,
                              poisson, sequential)
from bench.serve_metrics import PointResult, Stats, summarize


@dataclass
class ServeConfig:
    model: str = "tiny-llama"
    num_prefill: int = 1
    num_decode: int = 1
    num_prompts: int = 32
    concurrency: tuple[int, ...] = (1, 8, 32)
    request_rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (32, 128)
    seed: int = 0
    num_gpu_blocks: int = 2048
    prefix_len: int = 460
    unique_len: int = 50
    prefix_requests: int = 8
    prefix_output_len: int = 8
    inprocess: bool = True
    aggregated: bool = True
    # Conditional disaggregation (router/local_prefill.py); None keeps the router's defaults.
    max_local_prefill_length: int | None = None
    # Workers borrow idle workers' cores (router.launcher.ClusterSpec.share_cores).
    share_cores: bool = True


@dataclass
class ThroughputRatio:
    concurrency: int
    disagg_tok_s: float
    # None where that baseline did not run
    inprocess_tok_s: float | None
    ratio: float | None  # disagg / in-process
    agg_tok_s: float | None
    ratio_vs_agg: float | None  # disagg / aggregated


@dataclass
class PrefixResult:
    prefix_len: int
    unique_len: int
    output_len: int
    num_requests: int
    cold_ttft: Stats
    warm_ttft: Stats
    cold_cached_tokens: float
    warm_cached_tokens: float
    ratio: float  # mean warm TTFT / mean cold TTFT
    # Mean ms per request from the router's usage timings (bench.serve_metrics.BREAKDOWN_FIELDS).
    cold_breakdown_ms: dict[str, float]
    warm_breakdown_ms: dict[str, float]


@dataclass
class ServeReport:
    config: ServeConfig
    torch_threads: int  # the in-process engine's
    worker_threads: int  # each worker rank's (OMP_NUM_THREADS the cluster gave it)
    aggregated_worker_threads: int  # the aggregated cluster's one worker's
    # --max-num-batched-tokens of the prefill workers and of the in-process engine
    prefill_step_tokens: int
    inprocess_step_tokens: int
    cpu_count: int
    points: list[PointResult]
    ratios: list[ThroughputRatio]
    shared_prefix: PrefixResult | None


# --- arguments ----------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--model", default=d.model, help="HF folder or preset name")
    p.add_argument("--prefill", type=int, default=d.num_prefill, help="prefill workers")
    p.add_argument("--decode", type=int, default=d.num_decode, help="decode workers")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests per load point (closed loops send at least 2x concurrency)")
    p.add_argument("--concurrency", default=",".join(map(str, d.concurrency)),
                   help="closed-loop concurrencies, comma-separated ('' for none)")
    p.add_argument("--request-rates", default=",".join(f"{r:g}" for r in d.request_rates),
                   help="Poisson arrival rates in requests/s, comma-separated ('' for none)")
    p.add_argument("--prompt-len", default=f"{d.prompt_len[0]}-{d.prompt_len[1]}",
                   help="prompt tokens, uniform in LO-HI (or one number)")
    p.add_argument("--output-len", default=f"{d.output_len[0]}-{d.output_len[1]}",
                   help="output tokens, uniform in LO-HI (or one number)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks,
                   help="KV blocks per worker and for the in-process engine")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len)
    p.add_argument("--unique-len", type=int, default=d.unique_len)
    p.add_argument("--prefix-requests", type=int, default=d.prefix_requests,
                   help="warm and cold requests each in the shared-prefix phase (0 skips it)")
    p.add_argument("--prefix-output-len", type=int, default=d.prefix_output_len)
    p.add_argument("--max-local-prefill-length", type=int, default=None,
                   help="the router's conditional-disaggregation flag (0: off, every prompt "
                        "prefilled on a prefill worker); default: the router's own default")
    p.add_argument("--no-core-share", dest="share_cores", action="store_false",
                   help="fixed threads per worker: no borrowing of idle workers' cores")
    p.add_argument("--no-inprocess", dest="inprocess", action="store_false",
                   help="skip the in-process engine comparison")
    p.add_argument("--no-aggregated", dest="aggregated", action="store_false",
                   help="skip the aggregated cluster comparison (one decode worker that "
                        "prefills every prompt, behind the same router)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _int_list(s: str, name: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {s!r}") from None
    if any(v < 1 for v in vals):
        raise ValueError(f"--{name} values must be >= 1, got {s!r}")
    return vals


def _rate_list(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--request-rates must be comma-separated numbers, got {s!r}") from None
    if any(not (v > 0 and math.isfinite(v)) for v in vals):
        raise ValueError(f"--request-rates must be finite and > 0, got {s!r}")
    return vals


def _range(s: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = s.partition("-")
        rng = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--{name} must be LO-HI or N, got {s!r}") from None
    if not 1 <= rng[0] <= rng[1]:
        raise ValueError(f"--{name} needs 1 <= LO <= HI, got {s!r}")
    return rng


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    for name in ("prefill", "decode", "num_prompts", "num_gpu_blocks", "prefix_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefix_requests < 0 or args.prefix_len < 1 or args.unique_len < 1:
        raise ValueError("--prefix-len and --unique-len must be >= 1, --prefix-requests >= 0")
    cfg = ServeConfig(
        model=args.model, num_prefill=args.prefill, num_decode=args.decode,
        num_prompts=args.num_prompts, concurrency=_int_list(args.concurrency, "concurrency"),
        request_rates=_rate_list(args.request_rates),
        prompt_len=_range(args.prompt_len, "prompt-len"),
        output_len=_range(args.output_len, "output-len"), seed=args.seed,
        num_gpu_blocks=args.num_gpu_blocks, prefix_len=args.prefix_len,
        unique_len=args.unique_len, prefix_requests=args.prefix_requests,
        prefix_output_len=args.prefix_output_len, inprocess=args.inprocess,
        aggregated=args.aggregated,
        max_local_prefill_length=args.max_local_prefill_length,
        share_cores=args.share_cores)
    if cfg.max_local_prefill_length is not None and cfg.max_local_prefill_length < 0:
        raise ValueError("--max-local-prefill-length must be >= 0")
    if not cfg.concurrency and not cfg.request_rates and not cfg.prefix_requests:
        raise ValueError("nothing to run: no concurrency, request rate or prefix requests")
    return cfg


# --- workloads ----------------------------------------------------------------------------
@dataclass
class Point:
    mode: str  # "concurrency" or "poisson"
    load: float
    reqs: LoadRequests
    warmup: LoadRequests


def _requests(cfg: ServeConfig, vocab: int, n: int, seed: int) -> LoadRequests:
    from bench.workloads import OfflineWorkload, make_requests

    w = OfflineWorkload("serve", cfg.model, n, cfg.prompt_len, cfg.output_len, seed=seed)
    r = make_requests(w, vocab, n)
    return LoadRequests(r.prompts, r.output_lens)


def plan_points(cfg: ServeConfig, vocab: int) -> list[Point]:
    """Each point gets its own prompts (seeded by its index), so no point finds the previous
    one's prompts in a prefix cache; the in-process run reuses the same points."""
    loads = [("concurrency", float(c)) for c in cfg.concurrency]
    loads += [("poisson", r) for r in cfg.request_rates]
    points = []
    for k, (mode, load) in enumerate(loads):
        n = max(cfg.num_prompts, 2 * int(load)) if mode == "concurrency" else cfg.num_prompts
        base = cfg.seed * 1000 + 10 * k
        points.append(Point(mode, load, _requests(cfg, vocab, n, base),
                            _requests(cfg, vocab, 1, base + 1)))
    return points


def prefix_requests(cfg: ServeConfig,
                    vocab: int) -> tuple[LoadRequests, LoadRequests, LoadRequests]:
    """(warm-up, cold, warm): warm prompts share one prefix, which the warm-up caches; every
    cold prompt has a fresh prefix."""
    from bench.workloads import random_tokens

    rng = random.Random(cfg.seed * 1000 + 999)

    def toks(n: int) -> list[int]:
        return random_tokens(rng, n, vocab)

    shared = toks(cfg.prefix_len)
    n, out = cfg.prefix_requests, cfg.prefix_output_len
    cold = [toks(cfg.prefix_len) + toks(cfg.unique_len) for _ in range(n)]
    warm = [shared + toks(cfg.unique_len) for _ in range(n)]
    return (LoadRequests([shared + toks(cfg.unique_len)], [out]),
            LoadRequests(cold, [out] * n), LoadRequests(warm, [out] * n))


# --- runs ---------------------------------------------------------------------------------
def _log(*a) -> None:
    print("[bench serve]", *a, file=sys.stderr, flush=True)


async def run_cluster(address: str, cfg: ServeConfig, points: list[Point], vocab: int,
                      system: str, prefix: bool) -> tuple[list[PointResult], PrefixResult | None]:
    from client import AsyncClient

    results = []
    async with AsyncClient(address, timeout=600.0) as client:
        await client.wait_ready()
        for k, pt in enumerate(points):
            # The first KV transfer to a peer pays connection set-up; keep it out of the point.
            await sequential(client, pt.warmup)
            if pt.mode == "concurrency":
                run = await closed_loop(client, pt.reqs, int(pt.load))
            else:
                run = await poisson(client, pt.reqs, pt.load, cfg.seed * 1000 + k)
            res = summarize(system, pt.mode, pt.load, run.records, run.duration_s)
            _log(f"{system} {pt.mode} {pt.load:g}: {res.output_tok_s:.1f} out tok/s, "
                 f"TTFT mean {res.ttft.mean:.1f} ms, {res.failed} failed"
                 + (f" ({'; '.join(res.errors)})" if res.errors else ""))
            results.append(res)
        prefix_res = await run_prefix(client, cfg, vocab) if prefix else None
    return results, prefix_res


async def run_prefix(client, cfg: ServeConfig, vocab: int) -> PrefixResult:
    warmup, cold, warm = prefix_requests(cfg, vocab)
    await sequential(client, warmup)
    cold_recs, warm_recs = [], []
    # Alternate, so drift in machine load hits both sides alike.
    for i in range(len(cold)):
        cold_recs.append(await one_request(client, cold.prompts[i], cold.output_lens[i]))
        warm_recs.append(await one_request(client, warm.prompts[i], warm.output_lens[i]))
    c = summarize("disagg", "prefix-cold", 1, cold_recs, 1.0)
    w = summarize("disagg", "prefix-warm", 1, warm_recs, 1.0)
    if c.failed or w.failed:
        raise RuntimeError(f"shared-prefix phase: {c.failed} cold and {w.failed} warm requests "
                           f"failed: {'; '.join(c.errors + w.errors)}")
    res = PrefixResult(cfg.prefix_len, cfg.unique_len, cfg.prefix_output_len, len(cold),
                       c.ttft, w.ttft, c.mean_cached_tokens, w.mean_cached_tokens,
                       w.ttft.mean / c.ttft.mean, c.breakdown_ms, w.breakdown_ms)
    _log(f"shared prefix: TTFT cold {c.ttft.mean:.1f} ms, warm {w.ttft.mean:.1f} ms")
    return res


def run_inprocess(cfg: ServeConfig, points: list[Point]) -> list[PointResult]:
    from engine import LLM

    results = []
    with LLM(cfg.model, num_gpu_blocks=cfg.num_gpu_blocks) as llm:
        for pt in points:
            if pt.mode != "concurrency":
                continue
            inprocess_closed_loop(llm.engine, pt.warmup, 1)
            run = inprocess_closed_loop(llm.engine, pt.reqs, int(pt.load))
            res = summarize("inprocess", pt.mode, pt.load, run.records, run.duration_s)
            _log(f"inprocess concurrency {pt.load:g}: {res.output_tok_s:.1f} out tok/s")
            results.append(res)
    return results


def throughput_ratios(points: list[PointResult]) -> list[ThroughputRatio]:
    """Per closed-loop concurrency: disaggregated throughput against each baseline that ran."""
    def tok_s(system: str) -> dict[float, float]:
        return {p.load: p.output_tok_s for p in points
                if p.system == system and p.mode == "concurrency"}

    inproc, agg = tok_s("inprocess"), tok_s("agg")
    out = []
    for load, x in tok_s("disagg").items():
        q, a = inproc.get(load), agg.get(load)
        if q is None and a is None:
            continue
        out.append(ThroughputRatio(int(load), x, q, _ratio(x, q), a, _ratio(x, a)))
    return out


def _ratio(x: float, base: float | None) -> float | None:
    return None if base is None else (x / base if base > 0 else math.nan)


# --- main ---------------------------------------------------------------------------------
def run(cfg: ServeConfig) -> ServeReport:
    import torch

    from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model
    from router.launcher import ClusterSpec

    vocab = ModelConfig.from_pretrained(resolve_model(cfg.model)).vocab_size
    points = plan_points(cfg, vocab)
    router_args = ([] if cfg.max_local_prefill_length is None
                   else ["--max-local-prefill-length", str(cfg.max_local_prefill_length)])
    blocks = ["--num-gpu-blocks", str(cfg.num_gpu_blocks)]
    spec = ClusterSpec(model=cfg.model, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode,
                       worker_args=blocks, router_args=router_args, share_cores=cfg.share_cores)
    _log(f"starting a cluster: {cfg.num_prefill} prefill + {cfg.num_decode} decode, {cfg.model}")
    results, prefix = _serve_on(spec, cfg, points, vocab, "disagg", bool(cfg.prefix_requests))
    # Each baseline runs once the cluster before it is down, with the machine to itself.
    agg_spec = ClusterSpec(model=cfg.model, num_prefill=0, num_decode=1, worker_args=blocks,
                           share_cores=cfg.share_cores)
    closed = [pt for pt in points if pt.mode == "concurrency"]
    if cfg.aggregated and closed:
        _log(f"starting an aggregated cluster: 1 decode worker prefilling itself, {cfg.model}")
        results += _serve_on(agg_spec, cfg, closed, vocab, "agg", False)[0]
    if cfg.inprocess and closed:
        results += run_inprocess(cfg, closed)
    return ServeReport(cfg, torch.get_num_threads(),
                       int(spec.worker_env()["OMP_NUM_THREADS"]),
                       int(agg_spec.worker_env()["OMP_NUM_THREADS"]), spec.step_budget("prefill"),
                       DEFAULT_MAX_NUM_BATCHED_TOKENS,
                       os.cpu_count() or 0, results, throughput_ratios(results), prefix)


def _serve_on(spec, cfg: ServeConfig, points: list[Point], vocab: int, system: str,
              prefix: bool) -> tuple[list[PointResult], PrefixResult | None]:
    from router.launcher import Cluster

    cluster = Cluster(spec)
    with _children_stdout_to_stderr():
        cluster.start()
    try:
        return asyncio.run(run_cluster(cluster.router_address, cfg, points, vocab, system,
                                       prefix))
    finally:
        cluster.stop()


@contextlib.contextmanager
def _children_stdout_to_stderr():
    """The services print to the stdout they inherit; the bench's stdout is for the report
    alone (``--json`` promises one object)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _no_nan(x):
    """JSON has no NaN: undefined statistics (e.g. TPOT of one-token outputs) become null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def main(args: argparse.Namespace) -> int:
    from bench.serve_report import markdown

    report = run(config_from_args(args))
    if args.json:
        print(json.dumps(_no_nan(asdict(report))))
    else:
        print(markdown(report))
    failed = sum(p.failed for p in report.points)
    return 1 if failed else 0
