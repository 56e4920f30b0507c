"""``pdserve bench failover``: what a worker crash or hang costs the streams running on it.

A cluster (``pdserve up``'s processes) serves two sets of concurrent greedy streams with the
same prompt and output lengths (fresh prompts each, so neither finds the other's prefixes
cached): one undisturbed (the baseline), one with a worker failing under it (a decode worker
once every stream is past its first tokens, or a prefill worker as soon as the router has
every prompt in flight; then prompts are 256-512 tokens, so it fails computing them). The
fault is a crash (SIGKILL: its connections close) or, with ``--fault hang``, a hang (SIGSTOP:
its connections stay open and silent, found by the router's health checks; resumed once the
streams are done), or, with ``--fault stop``, a rolling restart's stop (SIGTERM: the worker
drains what it holds, refuses what comes after, and exits). The router migrates the failed
requests (router/migration.py) and moves refused ones for free. Reported: how many streams
failed, moved or were re-routed, whether every stream's tokens equal the in-process engine's,
and the stall the affected streams saw (their longest gap between tokens, or their TTFT after a
prefill failure) beside the same slots' figure in the baseline, with the ratio. The affected
streams are the moved ones, or after a stop those the stopping worker served. Late streams
(``--late-streams``) start right after the fault, and at the same moment of the baseline: what a
request arriving then costs (its TTFT against the baseline's), and whether any reached the
failed worker. A figure with nothing to measure (no stream affected, no late stream that got a
token) is ``n/a`` in the table, ``null`` in the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import grpc

from client import AsyncClient
from client.errors import PdserveError
from client.keepalive import check_keepalive
from engine import LLM, SamplingParams
from engine.cli_serve import tokenizer_flags
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec


@dataclass
class Stream:
    start: float
    times: list[float] = field(default_factory=list)  # one per token
    token_ids: list[int] = field(default_factory=list)
    migrations: int = 0
    workers: tuple[str, str] = ("", "")  # the usage's prefill and decode worker ids
    error: str = ""  # the client's error, when the stream failed

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.start) * 1e3

    @property
    def max_gap_ms(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return max(gaps, default=0.0) * 1e3


@dataclass
class FailoverReport:
    kill: str
    fault: str  # "kill" (SIGKILL), "hang" (SIGSTOP) or "stop" (SIGTERM)
    health_check_interval_s: float
    streams: int
    max_tokens: int
    failed: int  # failover-run streams that ended in an error (their first one in ``errors``)
    migrated: int
    rerouted: int  # attempts the router moved for free: a worker refused them (draining)
    identical: int  # failover-run streams whose tokens equal the in-process engine's
    # Over the affected streams: the failover run's figure, the same streams' in the baseline
    # (None: no stream to measure; one that failed before its first token has no figure).
    affected: int
    stall_metric: str
    stall_ms_mean: float | None
    baseline_ms_mean: float | None
    stall_ms_max: float | None
    baseline_ms_max: float | None
    duration_s: float
    baseline_duration_s: float
    # How the stopped worker's process ended (0: it drained and exited); None for kill and hang.
    victim_exit: int | None = None
    # The router's keepalive pings: every keepalive_time_s, a silent peer cut after
    # keepalive_timeout_s more (the second line behind the health checks, the only one without).
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 20.0
    errors: list[str] = field(default_factory=list)
    # The streams started right after the fault (and at that moment of the baseline).
    late: int = 0
    late_failed: int = 0
    late_identical: int = 0
    late_on_victim: int = 0  # whose usage names the failed worker (their last attempt's)
    late_ttft_ms_mean: float | None = None  # None: no late stream got a token
    baseline_late_ttft_ms_mean: float | None = None

    @property
    def stall_ratio(self) -> float | None:
        return _ratio(self.stall_ms_mean, self.baseline_ms_mean)

    @property
    def late_ttft_ratio(self) -> float | None:
        return _ratio(self.late_ttft_ms_mean, self.baseline_late_ttft_ms_mean)


def _ratio(x: float | None, base: float | None) -> float | None:
    """``x / base``; None where either has nothing measured (or the base is 0)."""
    return None if x is None or not base else x / base


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="a tokenizer folder other than the model's (the engine's and the "
                        "cluster's)")
    p.add_argument("--kill", choices=["decode", "prefill"], default="decode",
                   help="the role of the worker that fails under the streams")
    p.add_argument("--fault", choices=["kill", "hang", "stop"], default="kill",
                   help="kill: SIGKILL (a crash); hang: SIGSTOP (a process that stops "
                        "answering with its connections open), SIGCONT after the streams; "
                        "stop: SIGTERM (a rolling restart: the worker drains and exits)")
    p.add_argument("--health-check-interval-s", type=float, default=2.0,
                   help="the router's --health-check-interval-s (0: keepalive pings only)")
    p.add_argument("--keepalive-time-s", type=float, default=10.0,
                   help="the router's --keepalive-time-s")
    p.add_argument("--keepalive-timeout-s", type=float, default=20.0,
                   help="the router's --keepalive-timeout-s")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--late-streams", type=int, default=4,
                   help="streams started right after the fault (0: none)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def main(args: argparse.Namespace) -> int:
    if args.streams < 1 or args.max_tokens < 8 or args.late_streams < 0:
        raise ValueError("--streams must be >= 1, --late-streams >= 0 and --max-tokens >= 8")
    if not (args.health_check_interval_s == 0 or args.health_check_interval_s >= 0.05):
        raise ValueError("--health-check-interval-s must be 0 or >= 0.05")
    check_keepalive("--keepalive-time-s", args.keepalive_time_s)
    check_keepalive("--keepalive-timeout-s", args.keepalive_timeout_s)
    rng = random.Random(args.seed)
    # Prompts long enough that a prefill worker is still computing them when it dies.
    lo, hi = (256, 512) if args.kill == "prefill" else (32, 128)
    lens = [rng.randint(lo, hi) for _ in range(args.streams + args.late_streams)]
    # Fresh prompts for each run and each group: no stream finds another's prefix cached.
    base_prompts, prompts, base_late, late = (
        [[rng.randrange(10, 8000) for _ in range(n)] for n in part]
        for part in (lens[:args.streams], lens[:args.streams], lens[args.streams:],
                     lens[args.streams:]))
    with LLM(args.model, tokenizer=args.tokenizer) as llm:
        want = [o.token_ids for o in llm.generate(prompts + late, SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))]
    two = args.kill  # the role that gets two workers, one of which dies
    tok = tokenizer_flags(args.tokenizer)
    spec = ClusterSpec(model=args.model, num_prefill=2 if two == "prefill" else 1,
                       num_decode=2 if two == "decode" else 1, worker_args=tok,
                       router_args=["--max-local-prefill-length", "0", "--health-check-interval-s",
                                    str(args.health_check_interval_s),
                                    "--keepalive-time-s", str(args.keepalive_time_s),
                                    "--keepalive-timeout-s", str(args.keepalive_timeout_s),
                                    *tok])
    with Cluster(spec) as cluster:
        warm = [[t + 1 for t in p] for p in prompts[:2]]
        asyncio.run(_run(cluster, warm, [], args.max_tokens, two, None))
        base = asyncio.run(_run(cluster, base_prompts, base_late, args.max_tokens, two, None))
        rerouted = _router_stats(cluster).requests_rerouted
        hit = asyncio.run(_run(cluster, prompts, late, args.max_tokens, two, args.fault))
        hit.rerouted = _router_stats(cluster).requests_rerouted - rerouted
    report = _report(args, base, hit, want)
    if args.json:
        print(_json(report))
    else:
        print(_format(report))
    return 0


@dataclass
class Run:
    streams: list[Stream]
    duration_s: float  # from the first stream's start to the last one's end
    victim: str = ""  # the failed worker's id
    victim_exit: int | None = None  # its exit status, after a stop
    rerouted: int = 0
    late: list[Stream] = field(default_factory=list)  # started right after the fault


async def _run(cluster: Cluster, prompts: list[list[int]], late: list[list[int]],
               max_tokens: int, role: str, fault: str | None) -> Run:
    """The streams, all at once; once they reach ``role``'s workers (the fault's moment), a
    worker of that role fails under them (``fault``; None: none, the baseline) and the
    ``late`` streams start."""
    streams = [Stream(time.perf_counter()) for _ in prompts]
    late_streams: list[Stream] = []

    async def one(client: AsyncClient, prompt: list[int], s: Stream) -> None:
        try:
            async for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True):
                now = time.perf_counter()
                s.times.extend([now] * len(chunk.token_ids))
                s.token_ids.extend(chunk.token_ids)
                if chunk.usage is not None:
                    s.migrations = chunk.usage.migrations
                    s.workers = (chunk.usage.prefill_worker_id, chunk.usage.decode_worker_id)
        except PdserveError as e:  # reported, as a failed stream, not raised
            s.error = f"{type(e).__name__}: {e}"

    victim = None
    async with AsyncClient(cluster.router_address, timeout=600) as client:
        tasks = [asyncio.ensure_future(one(client, p, s)) for p, s in zip(prompts, streams)]
        try:
            if role == "decode":  # every stream decoding
                while not all(len(s.token_ids) >= 4 for s in streams):
                    await asyncio.sleep(0.002)
                victim = await asyncio.to_thread(_busiest_decode, cluster)
            else:  # every prompt with the prefill workers: half on the victim
                while await asyncio.to_thread(_in_flight, cluster) < len(prompts):
                    await asyncio.sleep(0.002)
                victim = next(p for p in cluster.procs if p.role == "prefill")
            if fault is None:
                victim = None
            else:
                _fail(victim, fault)
            late_streams = [Stream(time.perf_counter()) for _ in late]
            tasks += [asyncio.ensure_future(one(client, p, s))
                      for p, s in zip(late, late_streams)]
            await asyncio.gather(*tasks)
        finally:
            if victim is not None and fault == "hang":
                os.kill(victim.popen.pid, signal.SIGCONT)  # it stops with the cluster
    run = Run(streams, time.perf_counter() - streams[0].start,
              victim.name if victim is not None else "", late=late_streams)
    if victim is not None and fault == "stop":  # its drain is done once its streams are
        run.victim_exit = await asyncio.to_thread(victim.popen.wait, 60)
    return run


def _router_stats(cluster: Cluster) -> router_pb2.ClusterStats:
    """The router's own counters (no worker is asked)."""
    with grpc.insecure_channel(cluster.router_address) as ch:
        return router_pb2_grpc.RouterAdminStub(ch).GetClusterStats(
            router_pb2.ClusterStatsRequest(), timeout=10)


def _in_flight(cluster: Cluster) -> int:
    return _router_stats(cluster).requests_in_flight


def _busiest_decode(cluster: Cluster):
    def load(p) -> int:
        with grpc.insecure_channel(p.address) as ch:
            info = worker_pb2_grpc.DecodeWorkerStub(ch).GetWorkerInfo(
                common_pb2.WorkerInfoRequest(), timeout=10)
        return info.num_running + info.num_waiting

    return max((p for p in cluster.procs if p.role == "decode"), key=load)


def _fail(proc, fault: str) -> None:
    if fault == "kill":
        proc.popen.kill()
        proc.popen.wait()
    elif fault == "hang":
        os.kill(proc.popen.pid, signal.SIGSTOP)
    else:  # a clean exit: the launcher counts it scaled down and starts no other
        proc.popen.send_signal(signal.SIGTERM)


def _report(args, undisturbed: Run, run: Run, want: list[list[int]]) -> FailoverReport:
    """``want``: the in-process engine's tokens for ``run``'s streams, then its late ones."""
    base, hit = undisturbed.streams, run.streams
    want, want_late = want[:len(hit)], want[len(hit):]
    moved = [i for i, s in enumerate(hit) if s.migrations]
    if args.fault == "stop":  # nothing moves: the streams the stopping worker served
        role = 0 if args.kill == "prefill" else 1
        affected = [i for i, s in enumerate(hit) if s.workers[role] == run.victim]
    else:
        affected = moved
    metric = "ttft" if args.kill == "prefill" else "max_gap"

    def figs(streams: list[Stream]) -> list[float]:
        # A stream that failed before its first token has nothing to measure.
        return [s.ttft_ms if metric == "ttft" else s.max_gap_ms for s in streams if s.times]

    stall, calm = figs([hit[i] for i in affected]), figs([base[i] for i in affected])
    errors = [s.error for s in hit if s.error]
    return FailoverReport(
        kill=args.kill, fault=args.fault, health_check_interval_s=args.health_check_interval_s,
        streams=len(hit), max_tokens=args.max_tokens, failed=len(errors), migrated=len(moved),
        rerouted=run.rerouted, identical=sum(h.token_ids == w for h, w in zip(hit, want)),
        affected=len(affected), stall_metric=metric, stall_ms_mean=_mean(stall),
        baseline_ms_mean=_mean(calm), stall_ms_max=max(stall, default=None),
        baseline_ms_max=max(calm, default=None), duration_s=run.duration_s,
        baseline_duration_s=undisturbed.duration_s,
        victim_exit=run.victim_exit, keepalive_time_s=args.keepalive_time_s,
        keepalive_timeout_s=args.keepalive_timeout_s, errors=errors[:3],
        **_late(undisturbed, run, want_late))


def _late(undisturbed: Run, run: Run, want: list[list[int]]) -> dict:
    """The late streams' fields of the report."""
    def ttft(streams: list[Stream]) -> float | None:
        return _mean([s.ttft_ms for s in streams if s.times])

    late = run.late
    return dict(late=len(late), late_failed=sum(bool(s.error) for s in late),
                late_identical=sum(s.token_ids == w for s, w in zip(late, want)),
                late_on_victim=sum(run.victim in s.workers for s in late),
                late_ttft_ms_mean=ttft(late), baseline_late_ttft_ms_mean=ttft(undisturbed.late))


def _json(r: FailoverReport) -> str:
    return json.dumps({**asdict(r), "stall_ratio": r.stall_ratio,
                       "late_ttft_ratio": r.late_ttft_ratio}, indent=2)


def _format(r: FailoverReport) -> str:
    what = "TTFT" if r.stall_metric == "ttft" else "longest gap between tokens"
    if r.fault == "kill":
        how = "SIGKILLed"
    elif r.fault == "stop":
        how = f"stopped (SIGTERM; it exited with {r.victim_exit})"
    else:
        how = (f"SIGSTOPped (router health checks every {r.health_check_interval_s:g} s)"
               if r.health_check_interval_s else
               f"SIGSTOPped (no health checks: keepalive pings every {r.keepalive_time_s:g} s, "
               f"cut after {r.keepalive_timeout_s:g} s more)")
    whose = "served by the stopping worker" if r.fault == "stop" else "migrated"
    return "\n".join([
        f"Failover: a {r.kill} worker {how} under {r.streams} greedy streams of "
        f"{r.max_tokens} tokens",
        "",
        f"streams failed: {r.failed}, migrated: {r.migrated}, re-routed (refused, moved for "
        f"free): {r.rerouted}"
        + (f", {whose}: {r.affected}" if r.fault == "stop" else "")  # else the migrated ones
        + f", of {r.streams}; tokens identical to the in-process engine's: {r.identical} of "
        f"{r.streams}",
        *([f"first errors: {'; '.join(r.errors)}"] if r.errors else []),
        "",
        f"| {whose} streams' {what} | failover run | undisturbed run | ratio |",
        "|---|---|---|---|",
        f"| mean ms | {_num(r.stall_ms_mean)} | {_num(r.baseline_ms_mean)} | "
        f"{_num(r.stall_ratio, 2)} |",
        f"| max ms | {_num(r.stall_ms_max)} | {_num(r.baseline_ms_max)} | "
        f"{_num(_ratio(r.stall_ms_max, r.baseline_ms_max), 2)} |",
        f"| all streams done, s | {r.duration_s:.2f} | {r.baseline_duration_s:.2f} | "
        f"{r.duration_s / r.baseline_duration_s:.2f} |",
        *([f"| late streams' TTFT, mean ms | {_num(r.late_ttft_ms_mean)} | "
           f"{_num(r.baseline_late_ttft_ms_mean)} | {_num(r.late_ttft_ratio, 2)} |",
           "",
           f"late streams (started right after the fault): {r.late}; failed: {r.late_failed}; "
           f"served by the failed worker: {r.late_on_victim}; tokens identical: "
           f"{r.late_identical} of {r.late}"] if r.late else []),
    ])


def _num(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
