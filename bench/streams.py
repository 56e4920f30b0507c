"""``pdserve bench streams``: what the token streams cost, router settings side by side.

``--decode-stream multiplexed`` (the default) sends every request to a decode worker over one
``DecodeMany`` stream, one message per engine step; ``per-request`` opens a ``Decode`` call per
request, one message per token. With ``--stream-interval N`` a third cluster also sends its
clients one chunk per N tokens. A cluster of each kind (``pdserve up``'s processes) serves the
same decode-heavy closed loop (short prompts, long outputs, so most messages are decode
tokens), taking turns round by round on fresh prompts. Reported per run: output tokens/s and
the CPU each process spent per output token (``/proc`` user+system time over the loop), then
each setting / per-request for each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field

from bench.serve import _range
from bench.serve_load import LoadRequests, closed_loop
from bench.serve_runs import quiet_cluster
from client import AsyncClient

BASELINE = "per-request"
_TICKS = os.sysconf("SC_CLK_TCK")


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
    """Setting name -> its router flags."""
    out = {"multiplexed": ["--decode-stream", "multiplexed"],
           BASELINE: ["--decode-stream", "per-request"]}
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
    settings = variants(args.stream_interval)
    runs = []
    for r in range(args.rounds):
        reqs = _requests(args.seed + r, args.num_prompts, prompt_len, output_len)
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        for name in order:
            runs.append(_run(args.model, name, settings[name], r, reqs, args.concurrency))
            print(f"[bench streams] round {r + 1}/{args.rounds} {name}: "
                  f"{runs[-1].tok_s:.1f} out tok/s", file=sys.stderr, flush=True)
    report = _report(args, runs)
    print(json.dumps(asdict(report), indent=2) if args.json else _format(report))
    return 0


def _requests(seed: int, n: int, prompt_len: tuple[int, int],
              output_len: tuple[int, int]) -> LoadRequests:
    rng = random.Random(seed)
    return LoadRequests([[rng.randrange(10, 8000) for _ in range(rng.randint(*prompt_len))]
                         for _ in range(n)], [rng.randint(*output_len) for _ in range(n)])


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _run(model: str, name: str, router_args: list[str], rnd: int, reqs: LoadRequests,
         concurrency: int) -> StreamRun:
    from router.launcher import ClusterSpec

    async def load(address: str, todo: LoadRequests, c: int):
        async with AsyncClient(address) as client:
            return await closed_loop(client, todo, c)

    spec = ClusterSpec(model=model, worker_args=["--num-gpu-blocks", "2048"],
                       router_args=router_args)
    with quiet_cluster(spec) as cluster:
        warm = LoadRequests(reqs.prompts[:4], [8] * min(4, len(reqs)))
        asyncio.run(load(cluster.router_address, warm, 4))
        pids = {p.role: p.popen.pid for p in cluster.procs if p.role != "redis"}
        before = {role: _cpu_s(pid) for role, pid in pids.items()}
        run = asyncio.run(load(cluster.router_address, reqs, concurrency))
        after = {role: _cpu_s(pid) for role, pid in pids.items()}
    tokens = sum(n for rec in run.records for _, n in rec.chunks)
    return StreamRun(name, rnd, tokens / run.duration_s,
                     sum(not rec.ok for rec in run.records),
                     {role: 1e3 * (after[role] - before[role]) / max(tokens, 1)
                      for role in sorted(pids)})


def _report(args, runs: list[StreamRun]) -> StreamsReport:
    def mean(mode: str, get) -> float:
        vals = [get(r) for r in runs if r.mode == mode]
        return sum(vals) / len(vals)

    roles = sorted(runs[0].cpu_ms_per_token)
    others = [m for m in dict.fromkeys(r.mode for r in runs) if m != BASELINE]
    base_tok = mean(BASELINE, lambda r: r.tok_s)
    return StreamsReport(
        args.concurrency, args.num_prompts, runs,
        {m: mean(m, lambda r: r.tok_s) / base_tok for m in others},
        {m: {role: mean(m, lambda r: r.cpu_ms_per_token[role])
             / mean(BASELINE, lambda r: r.cpu_ms_per_token[role]) for role in roles}
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
