"""``pdserve bench streams``: what the token streams cost, router settings side by side.

``--decode-stream multiplexed`` (the default) sends every request to a decode worker over one
``DecodeMany`` stream, one message per engine step; ``per-request`` opens a ``Decode`` call per
request, one message per token. With ``--stream-interval N`` a third setting also sends its
clients one chunk per N tokens. One cluster (``pdserve up``'s processes) has a router of each
setting in front of the same workers; each serves the same decode-heavy closed loop (short
prompts, long outputs, so most messages are decode tokens) in turn, round by round on fresh
prompts, with the workers' prefix caches reset before each run so that every setting computes
the same prompts cold. Reported per run: output tokens/s and the CPU each process (its router,
the prefill and the decode worker) spent per output token (``/proc`` user+system time over the
loop), then each setting / per-request for each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from bench.cpu_usage import process_cpu_s, tree_cpu_s
from bench.serve import _no_nan, _range, _ratio
from bench.serve_load import LoadRequests, closed_loop
from bench.serve_runs import quiet_cluster, services_print_to_stderr
from client import AsyncClient
from protos import router_pb2, router_pb2_grpc

BASELINE = "per-request"


@dataclass
class StreamRun:
    mode: str  # the setting: multiplexed, per-request, or with a stream interval
    round: int
    tok_s: float
    failed: int
    # process role (router, prefill, decode) -> CPU ms per output token
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamsReport:
    concurrency: int
    num_prompts: int
    runs: list[StreamRun]
    # setting -> setting / per-request, over the pooled rounds
    tok_s_ratio: dict[str, float]
    cpu_ratio: dict[str, dict[str, float]]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=96, help="requests per run")
    p.add_argument("--prompt-len", default="32-64", help="LO-HI prompt tokens (uniform)")
    p.add_argument("--output-len", default="96-160", help="LO-HI output tokens (uniform)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="above 1: a third cluster, multiplexed and with this --stream-interval")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def variants(stream_interval: int) -> dict[str, list[str]]:
    """Setting name -> its router flags (each names every flag a setting changes: they follow
    the spec's router flags)."""
    out = {"multiplexed": ["--decode-stream", "multiplexed", "--stream-interval", "1"],
           BASELINE: ["--decode-stream", "per-request", "--stream-interval", "1"]}
    if stream_interval > 1:
        out[f"multiplexed, interval {stream_interval}"] = [
            "--decode-stream", "multiplexed", "--stream-interval", str(stream_interval)]
    return out


def main(args: argparse.Namespace) -> int:
    for name in ("concurrency", "num_prompts", "rounds", "stream_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    prompt_len = _range(args.prompt_len, "prompt-len")
    output_len = _range(args.output_len, "output-len")
    from router.launcher import ClusterSpec

    settings = variants(args.stream_interval)
    runs = []
    spec = ClusterSpec(model=args.model, worker_args=["--num-gpu-blocks", "2048"])
    with quiet_cluster(spec) as cluster:
        with services_print_to_stderr():
            routers = {name: cluster.start_router(extra=flags)
                       for name, flags in settings.items()}
        # Prompts of their own: warming up with measured ones would leave those cached.
        warm = _requests(args.seed - 1, 4, prompt_len, (8, 8))
        for r in range(args.rounds):
            reqs = _requests(args.seed + r, args.num_prompts, prompt_len, output_len)
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in order:
                runs.append(_run(cluster, routers[name], name, r, reqs, warm,
                                 args.concurrency))
                print(f"[bench streams] round {r + 1}/{args.rounds} {name}: "
                      f"{runs[-1].tok_s:.1f} out tok/s", file=sys.stderr, flush=True)
    report = _report(args, runs)
    print(json.dumps(_no_nan(asdict(report)), indent=2) if args.json else _format(report))
    return 1 if any(run.failed for run in runs) else 0


def _requests(seed: int, n: int, prompt_len: tuple[int, int],
              output_len: tuple[int, int]) -> LoadRequests:
    rng = random.Random(seed)
    return LoadRequests([[rng.randrange(10, 8000) for _ in range(rng.randint(*prompt_len))]
                         for _ in range(n)], [rng.randint(*output_len) for _ in range(n)])


def _reset_prefix_caches(address: str, timeout_s: float = 30.0) -> None:
    """Every worker's prefix cache forgotten; retried while the last run's leases and
    streams still hold blocks."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        admin = router_pb2_grpc.RouterAdminStub(ch)
        while True:
            resp = admin.ResetPrefixCache(router_pb2.ResetPrefixCacheRequest(), timeout=60)
            if resp.workers and all(w.reset for w in resp.workers):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers' prefix caches did not reset: {resp.workers}")
            time.sleep(0.2)


def role_cpu_s(role: str, pid: int) -> float:
    """CPU seconds of a service: a worker's with its children (its engine process and TP ranks:
    on a GPU host each worker steps its engine in a process of its own, whose CPU a worker's
    own count left out), the router's alone."""
    return process_cpu_s(pid) if role == "router" else tree_cpu_s(pid)


def _run(cluster, router, name: str, rnd: int, reqs: LoadRequests, warm: LoadRequests,
         concurrency: int) -> StreamRun:
    async def load(address: str, todo: LoadRequests, c: int):
        async with AsyncClient(address) as client:
            return await closed_loop(client, todo, c)

    _reset_prefix_caches(router.address)
    asyncio.run(load(router.address, warm, 4))
    pids = {"router": router.popen.pid,
            **{p.role: p.popen.pid for p in cluster.procs if p.role in ("prefill", "decode")}}
    before = {role: role_cpu_s(role, pid) for role, pid in pids.items()}
    run = asyncio.run(load(router.address, reqs, concurrency))
    after = {role: role_cpu_s(role, pid) for role, pid in pids.items()}
    tokens = sum(n for rec in run.records if rec.ok for _, n in rec.chunks)
    return StreamRun(name, rnd, tokens / run.duration_s,
                     sum(not rec.ok for rec in run.records),
                     {role: per_token_ms(after[role] - before[role], tokens)
                      for role in sorted(pids)})


def per_token_ms(cpu_s: float, tokens: int) -> float:
    """CPU ms per output token; NaN without tokens (every request failed), not the run's whole
    CPU as if one token had cost it."""
    return 1e3 * cpu_s / tokens if tokens else math.nan


def _report(args, runs: list[StreamRun]) -> StreamsReport:
    def mean(mode: str, get) -> float:
        vals = [get(r) for r in runs if r.mode == mode]
        return sum(vals) / len(vals)

    roles = sorted(runs[0].cpu_ms_per_token)
    others = [m for m in dict.fromkeys(r.mode for r in runs) if m != BASELINE]
    base_tok = mean(BASELINE, lambda r: r.tok_s)
    return StreamsReport(
        args.concurrency, args.num_prompts, runs,
        {m: _ratio(mean(m, lambda r: r.tok_s), base_tok) for m in others},
        {m: {role: _ratio(mean(m, lambda r: r.cpu_ms_per_token[role]),
                          mean(BASELINE, lambda r: r.cpu_ms_per_token[role])) for role in roles}
         for m in others})


def _format(r: StreamsReport) -> str:
    roles = sorted(r.runs[0].cpu_ms_per_token)
    lines = [f"### pdserve bench streams: concurrency {r.concurrency}, {r.num_prompts} requests "
             "per run", "",
             "| round | setting | out tok/s | failed | "
             + " | ".join(f"{role} CPU ms/token" for role in roles) + " |",
             "|---|---|---|---|" + "---|" * len(roles)]
    for run in r.runs:
        lines.append(f"| {run.round + 1} | {run.mode} | {run.tok_s:.1f} | {run.failed} | "
                     + " | ".join(f"{run.cpu_ms_per_token[role]:.3f}" for role in roles) + " |")
    lines.append("")
    for m, ratio in r.tok_s_ratio.items():
        lines.append(f"{m} / {BASELINE}: throughput **{ratio:.3f}**; CPU per token "
                     + ", ".join(f"{role} **{r.cpu_ratio[m][role]:.3f}**" for role in roles))
    return "\n".join(lines)
