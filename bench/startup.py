"""``pdserve bench startup``: how long a cluster takes to come up and to scale out, with a
model's tokenizer snapshot cached and without.

A cluster as ``pdserve up`` starts it (Redis, router, 1 prefill + 1 decode worker, each a
process) is started until the router routes to both workers; then a second decode worker is
added (scale-out) and waited for the same way; then everything is stopped. The peer ("cold")
is the same sequence with an empty tokenizer snapshot cache (engine/tokenizer_snapshot.py),
which is what the first start of a model on a machine pays: transformers loads the tokenizer
in every service. "warm" is every later start. The two alternate round by round (the order
flips each round). CPU is every process the cluster ran, from their resource usage once
reaped. Reported per run and as medians, with warm / cold ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from bench.serve_runs import services_print_to_stderr

SETTINGS = ("cold", "warm")
FIELDS = ("start_s", "scale_out_s", "stop_s", "cpu_s")  # StartupRun's measured fields
_CACHE_ENV = "PDSERVE_TOKENIZER_CACHE"


@dataclass
class StartupRun:
    setting: str
    round: int
    start_s: float  # nothing running -> the router routes to 1 prefill + 1 decode worker
    scale_out_s: float  # a second decode worker started -> the router routes to it
    stop_s: float  # SIGTERM to every service -> all exited
    cpu_s: float  # user + system of every process of the run (Redis included)


@dataclass
class StartupReport:
    model: str
    runs: list[StartupRun]
    median: dict[str, dict[str, float]]  # setting -> field -> median over rounds
    ratio: dict[str, float]  # field -> warm / cold of the medians


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run(model: str, setting: str, rnd: int, warm_cache: str) -> StartupRun:
    from router.launcher import Cluster, ClusterSpec

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tok-") as empty:
        os.environ[_CACHE_ENV] = warm_cache if setting == "warm" else empty
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        cluster = Cluster(ClusterSpec(model=model))
        with services_print_to_stderr():
            cluster.start()
        try:
            t1 = time.perf_counter()
            if setting == "cold":  # the new worker finds no snapshot either
                os.environ[_CACHE_ENV] = tempfile.mkdtemp(dir=empty)
            with services_print_to_stderr():
                cluster.add_worker("decode")
                cluster.wait_routable(1, 2)
            t2 = time.perf_counter()
        finally:
            t3 = time.perf_counter()
            cluster.stop()
        t4 = time.perf_counter()
    return StartupRun(setting, rnd, t1 - t0, t2 - t1, t4 - t3, _children_cpu() - cpu0)


def main(args: argparse.Namespace) -> int:
    from engine.presets import resolve_model

    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    resolve_model(args.model)  # a preset is generated before anything is timed
    saved = os.environ.get(_CACHE_ENV)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-bench-tok-warm-") as warm:
            # Fills the warm cache (a cold start, not reported).
            print("[bench startup] filling the snapshot cache", file=sys.stderr, flush=True)
            _run(args.model, "warm", -1, warm)
            for rnd in range(args.rounds):
                order = SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    print(f"[bench startup] round {rnd}: {setting}", file=sys.stderr, flush=True)
                    runs.append(_run(args.model, setting, rnd, warm))
    finally:
        if saved is None:
            os.environ.pop(_CACHE_ENV, None)
        else:
            os.environ[_CACHE_ENV] = saved
    report = _report(args.model, runs)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        _print(report)
    return 0


def _report(model: str, runs: list[StartupRun]) -> StartupReport:
    median = {s: {f: statistics.median(getattr(r, f) for r in runs if r.setting == s)
                  for f in FIELDS} for s in SETTINGS}
    ratio = {f: median["warm"][f] / median["cold"][f] for f in FIELDS}
    return StartupReport(model, runs, median, ratio)


def _print(r: StartupReport) -> None:
    print(f"## Cluster start-up ({r.model}: Redis, router, 1 prefill + 1 decode; then a 2nd "
          "decode worker)")
    print("| snapshot cache | round | start s | scale-out s | stop s | CPU s |")
    print("|---|---|---|---|---|---|")
    for run in r.runs:
        print(f"| {run.setting} | {run.round} | {run.start_s:.2f} | {run.scale_out_s:.2f} | "
              f"{run.stop_s:.2f} | {run.cpu_s:.1f} |")
    print("\n| median | start s | scale-out s | stop s | CPU s |")
    print("|---|---|---|---|---|")
    for s in (*SETTINGS, "warm / cold"):
        row = r.ratio if s == "warm / cold" else r.median[s]
        print(f"| {s} | " + " | ".join(f"{row[f]:.2f}" for f in FIELDS) + " |")
