"""``pdserve bench chaos``: a supervised cluster under mixed traffic while its workers fail,
one fault at a time: wrong tokens, failed requests, and what the faults left held.

The cluster is ``pdserve up``'s: ``--num-prefill`` prefill and ``--num-decode`` decode workers,
the router and Redis, under up's supervisor (router/supervisor.py), which starts a crashed
worker again. The router sends every prompt to a prefill worker (``--max-local-prefill-length
0``), so faults on either role land on requests in flight. Every ``--fault-every`` seconds,
once the router sees every worker again, one live worker drawn at random gets a fault of
``--faults``, each once a round in a random order:

- ``kill``: SIGKILL, a crash; the supervisor starts the worker again.
- ``hang``: SIGSTOP for ``--hang-s``, then SIGCONT; the router's health checks find it and its
  requests move on.
- ``stop``: SIGTERM, a rolling restart; the worker drains and exits 0, and a new worker of its
  role is added, as an orchestrator would.

With ``--num-routers`` 2 or more, the routers are in the draw too, for kills and hangs: the
client (the SDK, given every router) moves a stream whose router failed to another, where it
goes on from the tokens it has; the supervisor starts a killed router again on its port.

The traffic is soak's (bench/soak.py): prompts sharing prefixes, outputs of random lengths,
a share of them cancelled, every finished greedy output compared with the in-process engine's.
Once the traffic has ended and every fault is undone, the cluster must hold nothing: every
worker's KV blocks free, no lease, no request in flight, and none in flight on the router.
Waited for up to ``--settle-s``: a lease that a decode worker was reading when it died waits
out its expiry (``--kv-lease-timeout-s``), as the router cannot tell a dead reader from one cut
off from it that may still read, and a decode worker holds out the blocks of a failed pull
(``--kv-quarantine-s``); the report shows what was held when the wait began.

Exit status 1 on a wrong token, a failed request, anything left held, or a supervisor that
gave up.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field

import grpc

from bench.soak import (SoakReport, Traffic, add_traffic_args, check_traffic_args,
                        make_pool)
from client import AsyncClient
from engine.cli_serve import tokenizer_flags
from protos import common_pb2, router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec, Proc
from router.supervisor import Supervisor
from router.worker_handle import worker_stub

FAULTS = ("kill", "hang", "stop")
# The driver's tick: the supervisor's checks, hangs ended, faults started.
TICK_S = 0.1


def add_args(p: argparse.ArgumentParser) -> None:
    add_traffic_args(p)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=8, help="client loops")
    p.add_argument("--num-prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--num-decode", type=int, default=2, help="decode workers")
    p.add_argument("--num-routers", type=int, default=1,
                   help="routers, each given to the client (2 or more: routers are killed and "
                        "hung too)")
    p.add_argument("--faults", default="kill,hang,stop",
                   help="the faults drawn from, comma-separated: " + ", ".join(FAULTS))
    p.add_argument("--fault-every", type=float, default=15.0,
                   help="seconds from one fault to the next (once the cluster is whole again)")
    p.add_argument("--hang-s", type=float, default=10.0,
                   help="how long a hung worker (or router) stays stopped")
    p.add_argument("--kv-lease-timeout-s", type=float, default=60.0,
                   help="the workers' --kv-lease-timeout-s: a lease whose decode worker died "
                        "reading it is held until then")
    p.add_argument("--kv-quarantine-s", type=float, default=60.0,
                   help="the workers' --kv-quarantine-s: blocks a failed pull may still write "
                        "into are held out that long")
    p.add_argument("--settle-s", type=float, default=90.0,
                   help="the longest wait, after the traffic, for the cluster to hold nothing "
                        "(more than --kv-lease-timeout-s and --kv-quarantine-s)")


def check_args(args: argparse.Namespace) -> list[str]:
    """The faults asked for; ValueError for any argument out of range."""
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or not set(faults) <= set(FAULTS):
        raise ValueError(f"--faults must name some of {', '.join(FAULTS)}, got {args.faults!r}")
    # One fault at a time leaves a worker of each role serving: a role of one would lose all.
    if args.num_prefill < 2 or args.num_decode < 2:
        raise ValueError("--num-prefill and --num-decode must be >= 2")
    if args.num_routers < 1:
        raise ValueError("--num-routers must be >= 1")
    for name in ("duration", "fault_every", "hang_s", "settle_s", "kv_lease_timeout_s",
                 "kv_quarantine_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
    if not args.settle_s > max(args.kv_lease_timeout_s, args.kv_quarantine_s):
        raise ValueError("--settle-s must be more than --kv-lease-timeout-s and "
                         "--kv-quarantine-s: what a fault leaves held until then is not a leak")
    check_traffic_args(args)
    return faults


@dataclass
class Fault:
    at_s: float  # since the traffic began
    kind: str
    worker: str


@dataclass
class ChaosReport:
    traffic: SoakReport
    faults: list[Fault] = field(default_factory=list)
    supervisor: list[str] = field(default_factory=list)  # what the supervisor said
    gave_up: int | None = None  # the supervisor's exit code, if it stopped the cluster
    migrated: int = 0
    rerouted: int = 0
    worker_hangs: int = 0
    # After the traffic: what was still held when the wait ended (empty: nothing), and how
    # long the cluster took to hold nothing.
    held: list[str] = field(default_factory=list)
    settle_s: float = 0.0
    # What was held when the cluster was first whole after the traffic (a slow settle's why).
    held_at_first: list[str] = field(default_factory=list)
    # What stopped the faults' driver, if anything did (a worker not started again in time).
    error: str = ""

    @property
    def ok(self) -> bool:
        t = self.traffic
        return not (t.wrong or t.failed or self.held or self.gave_up is not None or self.error)


def what_is_held(cluster: Cluster) -> list[str]:
    """What the live workers and the router still hold, one line each (empty: nothing)."""
    held = []
    for proc in _workers(cluster):
        try:
            with grpc.insecure_channel(proc.address) as ch:
                info = worker_stub(ch, proc.role).GetWorkerInfo(
                    common_pb2.WorkerInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            held.append(f"{proc.name}: no answer ({e.code().name})")
            continue
        used = info.num_total_blocks - info.num_free_blocks
        if used or info.num_leased or info.num_inflight or info.num_running:
            # Quarantined: blocks a failed pull may still write into, held out until the
            # lease it read expires (--kv-quarantine-s).
            held.append(f"{proc.name}: {used} blocks in use, {info.num_leased} leased, "
                        f"{info.num_quarantined} quarantined, {info.num_inflight} requests "
                        f"in flight, {info.num_running} running")
    for proc in _routers(cluster):
        try:
            stats = router_stats(proc.address)
        except grpc.RpcError as e:
            held.append(f"router {proc.address}: no answer ({e.code().name})")
            continue
        if stats.requests_in_flight:
            held.append(f"router {proc.address}: {stats.requests_in_flight} requests in flight")
    return held


def router_stats(address: str, timeout_s: float = 10.0) -> router_pb2.ClusterStats:
    with grpc.insecure_channel(address) as ch:
        return router_pb2_grpc.RouterAdminStub(ch).GetClusterStats(
            router_pb2.ClusterStatsRequest(), timeout=timeout_s)


def _routers(cluster: Cluster) -> list[Proc]:
    return [p for p in list(cluster.procs) if p.role == "router" and p.popen.poll() is None]


def _workers(cluster: Cluster, role: str | None = None) -> list[Proc]:
    return [p for p in list(cluster.procs) if p.role in ("prefill", "decode")
            and (role is None or p.role == role) and p.popen.poll() is None]


class _Chaos:
    """The faults, driven from a thread of their own: the supervisor's checks and the
    cluster's changes block (a worker started again is waited for until it is healthy)."""

    def __init__(self, cluster: Cluster, faults: list[str], args: argparse.Namespace,
                 report: ChaosReport, t0: float) -> None:
        self.cluster, self.faults, self.args, self.report, self.t0 = (
            cluster, faults, args, report, t0)
        self.supervisor = Supervisor(cluster, say=report.supervisor.append)
        self.rng = random.Random(args.seed + 2)
        self.hung: dict[int, float] = {}  # pid -> when it gets its SIGCONT
        self.stopping: set[int] = set()  # pids told to stop (draining, then gone)
        self.targets = {"prefill": args.num_prefill, "decode": args.num_decode}
        self.order: list[str] = []  # the faults left of this round

    def run(self, end: float) -> None:
        self._guarded(self._run, end)

    def settle(self) -> None:
        """Every hang ended, then waits until the cluster is whole and holds nothing."""
        if not self.report.error:
            self._guarded(self._settle)

    def _guarded(self, step, *args) -> None:
        """A failure of the driver's own (a worker not healthy within --start-timeout, an
        admin call refused) is the verdict's, not a traceback that loses the report."""
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - reported, and the run judged failed
            self.report.error = f"{type(e).__name__}: {e}"
            for pid in list(self.hung):
                self._wake(pid)

    def _run(self, end: float) -> None:
        next_at = self.t0 + self.args.fault_every
        while time.monotonic() < end and self.report.gave_up is None:
            self._tick()
            now = time.monotonic()
            if next_at <= now < end and self._whole():
                self._inject()
                next_at = time.monotonic() + self.args.fault_every
            time.sleep(TICK_S)

    def _settle(self) -> None:
        for pid in list(self.hung):
            self._wake(pid)
        start = time.monotonic()
        held = ["the cluster was not whole again"]
        while self.report.gave_up is None:
            self._tick()
            if self._whole():
                held = what_is_held(self.cluster)
                if not self.report.held_at_first:
                    self.report.held_at_first = held or ["nothing"]
                if not held:
                    break
            if time.monotonic() - start > self.args.settle_s:
                self.report.held = held
                break
            time.sleep(0.5)
        self.report.settle_s = round(time.monotonic() - start, 1)

    def _tick(self) -> None:
        code = self.supervisor.check()
        if code is not None:
            self.report.gave_up = code
            return
        now = time.monotonic()
        for pid, until in list(self.hung.items()):
            if now >= until:
                self._wake(pid)

    def _wake(self, pid: int) -> None:
        del self.hung[pid]
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _serving(self, role: str | None = None) -> list[Proc]:
        """The live workers not told to stop."""
        return [p for p in _workers(self.cluster, role) if p.popen.pid not in self.stopping]

    def _whole(self) -> bool:
        """No hang under way, and every role back at its number, in every router's view too."""
        if self.hung or any(len(self._serving(role)) != n for role, n in self.targets.items()):
            return False
        routers = _routers(self.cluster)
        if len(routers) != self.args.num_routers:
            return False
        want = (self.targets["prefill"], self.targets["decode"])
        try:
            return all((s.num_prefill_workers, s.num_decode_workers) == want
                       for s in (router_stats(p.address, timeout_s=2.0) for p in routers))
        except grpc.RpcError:  # one not serving yet (started again a moment ago)
            return False

    def _inject(self) -> None:
        if not self.order:  # each kind once a round, in an order of its own
            self.order = self.rng.sample(self.faults, len(self.faults))
        kind = self.order.pop()
        victims = self._serving()
        # A router that exits 0 stops `pdserve up` (the supervisor's rule): not stopped here.
        if kind != "stop" and self.args.num_routers > 1:
            victims += _routers(self.cluster)
        proc = self.rng.choice(victims)
        pid = proc.popen.pid
        # Routers are all named "router": told apart by address (kept across a restart).
        name = f"router {proc.address}" if proc.role == "router" else proc.name
        self.report.faults.append(Fault(round(time.monotonic() - self.t0, 1), kind, name))
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)  # the supervisor's next check starts it again
        elif kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            self.hung[pid] = time.monotonic() + self.args.hang_s
        else:
            os.kill(pid, signal.SIGTERM)
            self.stopping.add(pid)
            self.cluster.add_worker(proc.role)  # its successor, while it drains


async def _run(cluster: Cluster, args: argparse.Namespace, faults: list[str], pool,
               report: ChaosReport) -> None:
    t0 = time.monotonic()
    end = t0 + args.duration
    driver = _Chaos(cluster, faults, args, report, t0)
    traffic = Traffic(args, pool, report.traffic)
    async with AsyncClient([p.address for p in _routers(cluster)], timeout=600) as client:
        chaos = asyncio.ensure_future(asyncio.to_thread(driver.run, end))
        try:
            await asyncio.gather(*(traffic.loop(client, end) for _ in range(args.concurrency)))
        finally:
            await chaos
    await asyncio.to_thread(driver.settle)


def main(args: argparse.Namespace) -> int:
    faults = check_args(args)
    pool = make_pool(args.model, random.Random(args.seed), args.pool_candidates, args.max_tokens,
                     args.tokenizer)
    if not pool:
        raise ValueError(f"none of {args.pool_candidates} prompts is decisive over "
                         f"{args.max_tokens} tokens: ask for fewer --max-tokens")
    report = ChaosReport(SoakReport(args.duration, len(pool)))
    tok = tokenizer_flags(args.tokenizer)
    spec = ClusterSpec(model=args.model, num_prefill=args.num_prefill,
                       num_decode=args.num_decode,
                       worker_args=["--kv-lease-timeout-s", str(args.kv_lease_timeout_s),
                                    "--kv-quarantine-s", str(args.kv_quarantine_s), *tok],
                       router_args=["--max-local-prefill-length", "0", *tok])
    with Cluster(spec) as cluster:
        for _ in range(args.num_routers - 1):
            cluster.start_router()
        asyncio.run(_run(cluster, args, faults, pool, report))
        # The live routers' counts (a killed router's went with it).
        for stats in (router_stats(p.address) for p in _routers(cluster)):
            report.migrated += stats.requests_migrated
            report.rerouted += stats.requests_rerouted
            report.worker_hangs += stats.worker_hangs
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def format_report(r: ChaosReport) -> str:
    t = r.traffic
    kinds = {k: sum(f.kind == k for f in r.faults) for k in FAULTS}
    lines = [f"chaos: {t.duration_s:g} s, a pool of {t.pool_size} decisive prompts",
             f"requests: {t.finished} finished ({t.wrong} with a wrong token), {t.cancelled} "
             f"cancelled, {t.failed} failed"]
    lines += [f"  wrong: {m}" for m in t.mismatches] + [f"  failed: {e}" for e in t.errors]
    lines.append(f"faults: {len(r.faults)} ("
                 + ", ".join(f"{k} {n}" for k, n in kinds.items() if n) + ")")
    lines += [f"  {f.at_s:7.1f} s  {f.kind:<4}  {f.worker}" for f in r.faults]
    lines.append(f"routers: {r.migrated} requests migrated, {r.rerouted} re-routed, "
                 f"{r.worker_hangs} hung workers found")
    lines += [f"supervisor: {m}" for m in r.supervisor]
    if r.gave_up is not None:
        lines.append(f"the supervisor gave up (exit {r.gave_up})")
    if r.error:
        lines.append(f"the faults' driver failed: {r.error}")
    if r.held:
        lines += [f"still held after {r.settle_s:g} s: {h}" for h in r.held]
    else:
        lines.append(f"held nothing {r.settle_s:g} s after the traffic")
    if r.held_at_first != ["nothing"]:
        lines += [f"  held when first whole again: {h}" for h in r.held_at_first]
    lines.append("OK" if r.ok else "FAILED")
    return "\n".join(lines)
