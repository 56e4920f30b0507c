"""ClusterSpec: validation, the CPU threads each worker rank is given and the engine flags
that depend on where the workers run."""
from __future__ import annotations

import os

import pytest

from engine import cpus
from engine.tp_worker import worker_threads
from router.launcher import ClusterSpec


def _usable_cpus(monkeypatch, n: int) -> None:
    """This process may run on ``n`` CPUs, with no cgroup CPU quota."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.setattr(cpus, "PROC_CGROUP", "/nonexistent/cgroup")


def test_worker_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _usable_cpus(monkeypatch, 16)
    # 2 prefill workers at TP=2 and 4 decode workers: 8 ranks on 16 cores.
    assert ClusterSpec(num_prefill=2, num_decode=4, prefill_tp=2).worker_env()[
        "OMP_NUM_THREADS"] == "2"
    assert ClusterSpec(num_prefill=8, num_decode=16).worker_env()["OMP_NUM_THREADS"] == "1"
    assert ClusterSpec(threads_per_rank=3).worker_env()["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's setting wins
    assert ClusterSpec().worker_env()["OMP_NUM_THREADS"] == "5"
    # A TP worker process splits the budget it was given among its ranks.
    assert worker_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert worker_threads(4) == 4  # falls back to the cores


def _budget(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--max-num-batched-tokens"]


def test_prefill_workers_on_shared_cpu_cores_take_smaller_steps(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = ["--device", "cpu"]
    shared = ClusterSpec(worker_args=cpu)
    assert _budget(shared.engine_args("prefill", [])) == ["512"]
    assert _budget(shared.engine_args("decode", [])) == []
    # A flag the user gave wins, from the spec's worker flags or a worker's own.
    assert _budget(ClusterSpec(worker_args=[*cpu, "--max-num-batched-tokens", "4096"])
                   .engine_args("prefill", [])) == ["4096"]
    assert _budget(shared.engine_args("prefill", ["--max-num-batched-tokens=1024"])) == []
    # Not where the cores are not shared, nor on a GPU, nor at TP > 1 (its own threads).
    assert _budget(ClusterSpec(worker_args=cpu, share_cores=False).engine_args("prefill", [])) \
        == []
    assert _budget(ClusterSpec(worker_args=["--device", "cuda"]).engine_args("prefill", [])) \
        == []
    assert _budget(ClusterSpec(worker_args=cpu, prefill_tp=2).engine_args("prefill", [])) == []
    assert _budget(shared.engine_args("prefill", ["--tensor-parallel-size", "2"])) == []
    # Without chunked prefill the budget would cap the prompt length: left alone.
    assert _budget(shared.engine_args("prefill", ["--no-enable-chunked-prefill"])) == []
    # The last of the two switches wins, as argparse reads them.
    assert _budget(shared.engine_args("prefill", ["--no-enable-chunked-prefill",
                                                  "--enable-chunked-prefill"])) == ["512"]
    assert _budget(shared.engine_args("prefill", ["--enable-chunked-prefill",
                                                  "--no-enable-chunked-prefill"])) == []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user placed the threads: not shared
    assert _budget(shared.engine_args("prefill", [])) == []
    assert shared.step_budget("decode") == 2048  # the engine's default
    assert ClusterSpec(worker_args=cpu).step_budget("prefill") == 2048
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert shared.step_budget("prefill") == 512


def test_an_aggregated_spec_lets_its_decode_workers_prefill_any_prompt(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _usable_cpus(monkeypatch, 2)
    agg = ClusterSpec(num_prefill=0, num_decode=1)
    assert agg.aggregated and agg.num_ranks == 1
    # The model's whole context (tiny-llama: 2048 positions), unless the user set a limit.
    assert agg.router_flags() == ["--max-local-prefill-length", "2048"]
    assert ClusterSpec(num_prefill=0, router_args=["--max-local-prefill-length", "300"]) \
        .router_flags() == ["--max-local-prefill-length", "300"]
    assert ClusterSpec(router_args=["--x"]).router_flags() == ["--x"]  # disaggregated: as given
    # A lone worker has both cores and no core share to borrow through.
    assert agg.worker_env()["OMP_NUM_THREADS"] == "2" and not agg.cores_shared
    assert ClusterSpec(num_prefill=0, num_decode=2).cores_shared


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="at least one decode worker"):
        ClusterSpec(num_decode=0)
    with pytest.raises(ValueError, match="0 or more prefill"):
        ClusterSpec(num_prefill=-1)
    # Aggregated with local prefill off: nothing could prefill a prompt.
    with pytest.raises(ValueError, match="nothing to serve"):
        ClusterSpec(num_prefill=0, router_args=["--max-local-prefill-length", "0"])
    with pytest.raises(ValueError, match="has none"):
        ClusterSpec(num_prefill=0, prefill_tp=2)
    with pytest.raises(ValueError, match="threads_per_rank"):
        ClusterSpec(threads_per_rank=0)


_STUCK = """
import asyncio, signal, sys
from engine.grpc_server import run

async def stuck_in_shutdown():
    print("ready", flush=True)
    await asyncio.sleep(60)

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a shutdown that never ends
run(stuck_in_shutdown)
"""


def test_a_process_stuck_past_its_grace_dumps_its_stacks_then_dies():
    import subprocess
    import sys

    from router.launcher import Cluster, Proc

    popen = subprocess.Popen([sys.executable, "-c", _STUCK], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert popen.stdout.readline().strip() == "ready"
        cluster = Cluster(ClusterSpec())
        proc = Proc("stuck", "127.0.0.1:0", popen)
        cluster.procs.append(proc)
        assert cluster.stop_proc(proc, grace_s=0.5) == -9
        assert proc not in cluster.procs
        stderr = popen.stderr.read()
        assert "thread 0x" in stderr and "grpc_server.py" in stderr  # faulthandler's dump
    finally:
        if popen.poll() is None:
            popen.kill()


def test_starting_a_started_cluster_is_refused_and_stops_nothing():
    import subprocess
    import sys

    from router.launcher import Cluster, Proc

    cluster = Cluster(ClusterSpec())
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster.procs.append(Proc("router", "127.0.0.1:1", running))
        with pytest.raises(RuntimeError, match="already started"):
            cluster.start()
        assert running.poll() is None and cluster.redis is None  # nothing stopped or started
    finally:
        running.kill()
        running.wait()


def test_a_service_starts_after_its_log_folder_was_removed():
    """A /tmp cleaner that removed the services' log folder must not fail every later start
    (the supervisor would lose each worker it restarts)."""
    import shutil

    from router import log_dirs
    from router.launcher import Cluster

    cluster = Cluster(ClusterSpec())
    try:
        first = cluster._spawn("decode-a", ["--help"])
        assert first.popen.wait(60) == 0
        gone = cluster.log_dir
        shutil.rmtree(gone)
        second = cluster._spawn("decode-b", ["--help"])
        assert second.popen.wait(60) == 0
        assert cluster.log_dir != gone and os.path.isdir(cluster.log_dir)
        assert second.tail.closed.wait(30)
        assert os.path.exists(second.tail.path)
    finally:
        for proc in list(cluster.procs):
            proc.tail.close()
            proc.ready.close()
        if cluster.log_dir is not None:
            log_dirs.remove(cluster.log_dir)
        for fd in cluster._lifeline or ():
            os.close(fd)
