"""``pdserve bench serve``: online serving through the router vs two baselines.

A real cluster (redis, router, prefill and decode workers as separate processes, started by
``router.launcher.Cluster``) serves closed loops at each concurrency and Poisson arrivals at each
rate. The same closed loops on the same requests also run on two baselines: an aggregated
cluster (the same router and client, one decode worker that prefills every prompt itself: what
disaggregation costs, serving stack aside) and an in-process ``LLMEngine`` stepped directly (no
gRPC, no router, no client); the systems take turns, round by round (``bench.serve_runs``).
Also a shared-prefix phase: TTFT when the prompt's prefix is already cached on the prefill
worker vs a fresh prefix.

Metric definitions follow vLLM's ``benchmark_serving`` (see ``bench.serve_metrics``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import asdict, dataclass, field

from bench.serve_load import LoadRequests
from bench.serve_metrics import PointResult, Stats


@dataclass
class ServeConfig:
    model: str = "tiny-llama"
    # The tokenizer folder of every service and the in-process engine (--tokenizer); None:
    # the model's own.
    tokenizer: str | None = None
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
    # Closed loops run this many times per system on fresh prompts, the systems alternating
    # (disagg, agg, in-process, then in reverse): this VM's speed drifts by 10-30% within
    # minutes, which one pass after another would count as a difference between the systems.
    rounds: int = 2
    # Conditional disaggregation (router/local_prefill.py); None keeps the router's defaults.
    max_local_prefill_length: int | None = None
    # Workers borrow idle workers' cores (router.launcher.ClusterSpec.share_cores).
    share_cores: bool = True
    # The routers' --decode-stream (router/config.py), in both clusters.
    decode_stream: str = "multiplexed"
    # The routers' --stream-interval, in both clusters (protos/stream_interval.py): tokens per
    # chunk to the client, and from the decode worker to the router.
    stream_interval: int = 1
    # Partial-block prefix hits (engine/kv_cache_manager.py) in every engine of the run.
    partial_block_hits: bool = True
    # Every worker of both clusters runs its engine in a process of its own (--engine-process);
    # None: the launcher's default (on GPUs, yes), which the run resolves and reports.
    engine_process: bool | None = None


@dataclass
class ThroughputRatio:
    concurrency: int
    disagg_tok_s: float
    # None where that baseline did not run
    inprocess_tok_s: float | None
    ratio: float | None  # disagg / in-process
    agg_tok_s: float | None
    ratio_vs_agg: float | None  # disagg / aggregated
    # The same ratios round by round (each round's systems ran minutes apart at most).
    ratio_rounds: list[float] = field(default_factory=list)
    ratio_vs_agg_rounds: list[float] = field(default_factory=list)


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
    # --max-num-batched-tokens of the prefill workers, the in-process engine and the
    # aggregated cluster's worker
    prefill_step_tokens: int
    inprocess_step_tokens: int
    aggregated_step_tokens: int
    cpu_count: int
    # GRPC_EXPERIMENTS as every process of the run had it (engine/grpc_experiments.py);
    # "" for gRPC's own defaults
    grpc_experiments: str
    points: list[PointResult]
    ratios: list[ThroughputRatio]
    shared_prefix: PrefixResult | None


# --- arguments ----------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--model", default=d.model, help="HF folder or preset name")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="a tokenizer folder other than the model's, for the router, the "
                        "workers and the in-process engine (pdserve up --tokenizer)")
    p.add_argument("--prefill", type=int, default=d.num_prefill, help="prefill workers")
    p.add_argument("--decode", type=int, default=d.num_decode, help="decode workers")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests per load point (closed loops send at least 2x concurrency)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="closed-loop passes per system, alternating the systems (figures "
                        "pool the rounds)")
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
    p.add_argument("--decode-stream", default=d.decode_stream,
                   choices=("multiplexed", "per-request"),
                   help="the routers' --decode-stream: how requests reach decode workers")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="the routers' --stream-interval: output tokens per chunk, to the "
                        "client and from the decode workers")
    p.add_argument("--no-enable-partial-block-hits", dest="partial_block_hits",
                   action="store_false",
                   help="every engine of the run reuses cached prefixes in whole blocks only")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="every worker of both clusters steps its engine in a process of its "
                        "own (the workers' --engine-process); default: on a GPU")
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


def _abspath(path: str | None) -> str | None:
    """A folder the cluster's services find whatever their working directory."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    for name in ("prefill", "decode", "num_prompts", "num_gpu_blocks", "prefix_output_len",
                 "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefix_requests < 0 or args.prefix_len < 1 or args.unique_len < 1:
        raise ValueError("--prefix-len and --unique-len must be >= 1, --prefix-requests >= 0")
    cfg = ServeConfig(
        model=args.model, tokenizer=_abspath(args.tokenizer), num_prefill=args.prefill,
        num_decode=args.decode, num_prompts=args.num_prompts,
        concurrency=_int_list(args.concurrency, "concurrency"),
        request_rates=_rate_list(args.request_rates),
        prompt_len=_range(args.prompt_len, "prompt-len"),
        output_len=_range(args.output_len, "output-len"), seed=args.seed,
        num_gpu_blocks=args.num_gpu_blocks, prefix_len=args.prefix_len,
        unique_len=args.unique_len, prefix_requests=args.prefix_requests,
        prefix_output_len=args.prefix_output_len, inprocess=args.inprocess,
        aggregated=args.aggregated, rounds=args.rounds,
        max_local_prefill_length=args.max_local_prefill_length,
        share_cores=args.share_cores, decode_stream=args.decode_stream,
        stream_interval=args.stream_interval, partial_block_hits=args.partial_block_hits,
        engine_process=args.engine_process)
    if not 1 <= cfg.stream_interval <= 1024:
        raise ValueError(f"--stream-interval must be in [1, 1024], got {cfg.stream_interval}")
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


def plan_points(cfg: ServeConfig, vocab: int, round_index: int = 0) -> list[Point]:
    """Each point of each round gets its own prompts (seeded by both), so no point finds an
    earlier one's prompts in a prefix cache; every system runs the same points."""
    loads = [("concurrency", float(c)) for c in cfg.concurrency]
    loads += [("poisson", r) for r in cfg.request_rates]
    points = []
    for k, (mode, load) in enumerate(loads):
        n = max(cfg.num_prompts, 2 * int(load)) if mode == "concurrency" else cfg.num_prompts
        base = cfg.seed * 1000 + 10 * k + 100_000 * round_index
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


# --- ratios -------------------------------------------------------------------------------
def throughput_ratios(points: list[PointResult],
                      rounds: dict[tuple[str, float], list[float]] | None = None,
                      ) -> list[ThroughputRatio]:
    """Per closed-loop concurrency: disaggregated throughput against each baseline that ran
    (``points``: pooled over the rounds), and round by round (``rounds``: out tok/s per round,
    by (system, concurrency))."""
    def tok_s(system: str) -> dict[float, float]:
        return {p.load: p.output_tok_s for p in points
                if p.system == system and p.mode == "concurrency"}

    def per_round(load: float, base: str) -> list[float]:
        xs, bs = (rounds or {}).get(("disagg", load), []), (rounds or {}).get((base, load), [])
        return [_ratio(x, b) for x, b in zip(xs, bs)]

    inproc, agg = tok_s("inprocess"), tok_s("agg")
    out = []
    for load, x in tok_s("disagg").items():
        q, a = inproc.get(load), agg.get(load)
        if q is None and a is None:
            continue
        out.append(ThroughputRatio(int(load), x, q, _ratio(x, q), a, _ratio(x, a),
                                   per_round(load, "inprocess"), per_round(load, "agg")))
    return out


def _ratio(x: float, base: float | None) -> float | None:
    return None if base is None else (x / base if base > 0 else math.nan)


# --- main ---------------------------------------------------------------------------------
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
    from bench.serve_runs import run

    report = run(config_from_args(args))
    if args.json:
        print(json.dumps(_no_nan(asdict(report))))
    else:
        print(markdown(report))
    failed = sum(p.failed for p in report.points)
    return 1 if failed else 0
