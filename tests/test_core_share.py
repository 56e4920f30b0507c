"""Core sharing between co-located workers (engine/core_share.py): real processes holding
slots in one shared file, the engine thread sizing its steps from it, and the launcher that
sets it up."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core_share import MAX_SLOTS, CoreShare, CoreShareConfig
from engine.worker_runtime import WorkerConfig
from router.launcher import Cluster, ClusterSpec
from tests.proc_signals import reap

# A worker stand-in: holds a slot and obeys "busy" / "idle" lines, answering with its threads.
_PEER = """
import sys
from engine.core_share import CoreShare, CoreShareConfig
share = CoreShare(CoreShareConfig(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
print("slot", share._index, flush=True)
for line in sys.stdin:
    if line.strip() == "busy":
        print("threads", share.threads_for_step(), flush=True)
    else:
        share.idle()
        print("threads", 0, flush=True)
"""


class Peer:
    def __init__(self, path: str, cores: int, base: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, path, str(cores), str(base)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.slot = int(self.proc.stdout.readline().split()[1])

    def say(self, cmd: str) -> int:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1])

    def kill(self) -> None:
        reap(self.proc)


@pytest.fixture
def share_path(tmp_path):
    return str(tmp_path / "cores")


def test_config_is_validated(share_path):
    for kwargs, needle in [(dict(path=""), "file path"), (dict(num_cores=0), "num_cores"),
                           (dict(base_threads=True), "base_threads"),
                           (dict(base_threads=5), "exceeds")]:
        with pytest.raises(ValueError, match=needle):
            CoreShareConfig(**{"path": share_path, "num_cores": 4, "base_threads": 1, **kwargs})


def test_a_busy_worker_borrows_what_the_others_leave(share_path):
    me = CoreShare(CoreShareConfig(share_path, num_cores=4, base_threads=1))
    peers = []
    try:
        assert me.threads_for_step() == 4  # alone in the group
        me.idle()
        peers.append(Peer(share_path, 4, 1))
        assert peers[0].slot != me._index
        assert peers[0].say("busy") == 4  # I am idle: every core
        assert me.threads_for_step() == 1  # all taken: my own share, never less
        assert peers[0].say("busy") == 3  # it shrinks to what I leave at its next step
        assert me.threads_for_step() == 1
        peers.append(Peer(share_path, 4, 2))
        assert peers[1].say("busy") == 2  # its base share even on a full host
        assert peers[0].say("idle") == 0
        assert me.threads_for_step() == 2  # 4 cores - the 2 the second peer holds
        assert me.others_busy_threads() == 2
        dead_slot = peers[1].slot
        peers[1].kill()  # died while busy: its threads no longer count
        assert me.others_busy_threads() == 0
        assert me.threads_for_step() == 4
        peers.append(Peer(share_path, 4, 1))
        assert peers[2].slot == dead_slot  # the dead process's slot is taken over
    finally:
        for p in peers:
            if p.proc.poll() is None:
                p.kill()
        me.close()


def test_slots_run_out_with_a_clear_error(share_path, monkeypatch):
    me = CoreShare(CoreShareConfig(share_path, 2, 1))
    try:
        # Every other slot held by a live process (ours, the parent of this test).
        me._slots[:, 0] = os.getppid()
        me._slots[me._index, 0] = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda: 1)  # a newcomer: pid 1 is alive, never ours
        with pytest.raises(RuntimeError, match=f"no free slot .{MAX_SLOTS} live"):
            CoreShare(CoreShareConfig(share_path, 2, 1))
    finally:
        monkeypatch.undo()
        me._slots[:, 0] = 0
        me.close()


def test_borrowed_cores_go_back_mid_step_when_another_worker_wakes(share_path):
    me = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    peer = Peer(share_path, 2, 1)
    try:
        assert me.threads_for_step() == 2  # borrowing the idle peer's core
        assert me.recheck() is None  # nobody woke up
        assert peer.say("busy") == 1  # it wakes while my step runs: its own share
        assert me.recheck() == 1  # give the borrowed core back
        assert me.recheck() is None and me.others_busy_threads() == 1
        me.idle()
        assert peer.say("idle") == 0
        assert me.threads_for_step() == 2
        assert peer.say("busy") == 1
        me.idle()
        assert me.recheck() is None  # idle: nothing borrowed to give back
    finally:
        peer.kill()
        me.close()


class _Layer(torch.nn.Module):
    def __init__(self, engine: _CountingEngine, index: int) -> None:
        super().__init__()
        self.engine, self.index = engine, index

    def forward(self, x):
        self.engine.threads.append(torch.get_num_threads())
        if self.index == 0 and self.engine.after_first_layer is not None:
            self.engine.after_first_layer()
        return x


class _CountingEngine:
    """Steps ``work`` times through three layers, recording the torch threads each layer of a
    busy step ran with."""

    def __init__(self) -> None:
        self.work = 0
        self.threads: list[int] = []
        self.lock = threading.Lock()
        self.layers = [_Layer(self, i) for i in range(3)]
        self.after_first_layer = None

    def decoder_layers(self):
        return self.layers

    def get_stats(self):
        return None

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return self.work > 0

    def check_health(self) -> None:
        pass

    def step(self) -> list:
        with self.lock:
            if self.work > 0:
                self.work -= 1
                for layer in self.layers:
                    layer(torch.zeros(1))
        return []

    def shutdown(self) -> None:
        pass


def test_engine_steps_use_the_cores_the_group_leaves(share_path):
    before = torch.get_num_threads()
    peer = Peer(share_path, 2, 1)
    engine = _CountingEngine()
    share = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))

    async def run_steps(n: int) -> list[int]:
        ae = AsyncEngine(engine, core_share=share)
        try:
            with engine.lock:
                engine.work, engine.threads = n, []
            ae._wake.set()
            deadline = time.monotonic() + 10
            while (engine.has_unfinished_requests() or share.threads) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return list(engine.threads)
        finally:
            ae._stop.set()
            ae._wake.set()
            ae._thread.join(5)

    try:
        assert asyncio.run(run_steps(2)) == [2] * 6  # the peer is idle: both cores
        assert share.threads == 0  # idle again once the work is done
        assert peer.say("busy") == 2
        assert asyncio.run(run_steps(2)) == [1] * 6  # the peer holds both: own share
        assert peer.say("idle") == 0
        # The peer wakes during the first layer: the rest of the step runs on one core.
        engine.after_first_layer = lambda: peer.say("busy")
        assert asyncio.run(run_steps(1)) == [2, 1, 1]
    finally:
        peer.kill()
        share.close()
        torch.set_num_threads(before)


def test_worker_config_checks_core_sharing():
    engine = EngineConfig("tiny-llama", role="prefill", kv_transfer_backend="nixl")
    cfg = WorkerConfig(engine=engine, core_share_path="/tmp/x", core_share_cores=3)
    assert cfg.core_share_config(8) == CoreShareConfig("/tmp/x", 3, 3)
    assert WorkerConfig(engine=engine).core_share_config(1) is None
    # The engine's packed weights are laid out for every core it may borrow.
    assert cfg.engine_config().max_cpu_threads == 3
    assert WorkerConfig(engine=engine).engine_config().max_cpu_threads is None
    with pytest.raises(ValueError, match="max_cpu_threads"):
        EngineConfig("tiny-llama", max_cpu_threads=0)
    with pytest.raises(ValueError, match="needs core_share_path"):
        WorkerConfig(engine=engine, core_share_cores=2)
    with pytest.raises(ValueError, match="core_share_cores must be"):
        WorkerConfig(engine=engine, core_share_path="/tmp/x", core_share_cores=0)
    tp2 = EngineConfig("tiny-llama", role="prefill", kv_transfer_backend="nixl",
                       tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        WorkerConfig(engine=tp2, core_share_path="/tmp/x")


def test_launcher_shares_cores_only_where_it_shares_them_out(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spec = ClusterSpec()
    assert spec.cores_shared
    for off in (ClusterSpec(share_cores=False), ClusterSpec(prefill_tp=2),
                ClusterSpec(threads_per_rank=1)):
        assert not off.cores_shared
    # Idle OpenMP threads spin briefly wherever the launcher starts workers: the router and
    # the clients share the host's cores even where the workers do not share theirs.
    for any_spec in (spec, ClusterSpec(share_cores=False), ClusterSpec(num_prefill=0)):
        assert any_spec.worker_env()["GOMP_SPINCOUNT"] == "20000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert spec.worker_env()["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user chose the threads: leave them
    assert not ClusterSpec().cores_shared

    monkeypatch.delenv("OMP_NUM_THREADS")
    cluster = Cluster(ClusterSpec(redis_url="redis://127.0.0.1:1"))
    spawned: list[list[str]] = []
    monkeypatch.setattr(cluster, "_spawn", lambda name, args, env=None: spawned.append(args))
    cluster.add_worker("prefill", wait=False)
    cluster.add_worker("decode", wait=False)
    cluster.add_worker("prefill", wait=False, extra=["--tensor-parallel-size", "2"])
    assert "--core-share" not in spawned.pop()  # its TP ranks keep their own threads
    paths = [a[a.index("--core-share") + 1] for a in spawned]
    assert paths[0] == paths[1] and os.path.isdir(os.path.dirname(paths[0]))
    cluster.stop()
    assert not os.path.exists(os.path.dirname(paths[0]))  # removed with the cluster


def test_cli_flags_reach_the_configs():
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config

    p = build_parser()
    assert p.parse_args(["up"]).share_cores is True
    assert p.parse_args(["up", "--no-core-share"]).share_cores is False
    args = p.parse_args(["decode", "--core-share", "/tmp/x", "--core-share-cores", "2"])
    cfg = _worker_config(args, "decode")
    assert (cfg.core_share_path, cfg.core_share_cores) == ("/tmp/x", 2)


def test_an_unusable_share_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot open the core share file"):
        CoreShare(CoreShareConfig(str(tmp_path / "missing" / "cores"), 2, 1))


def test_a_dead_engine_lends_its_cores(share_path):
    class _Failing(_CountingEngine):
        def step(self) -> list:
            if self.has_unfinished_requests():
                raise RuntimeError("a step failed")
            return []

    before = torch.get_num_threads()
    share = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    engine = _Failing()

    async def body() -> None:
        ae = AsyncEngine(engine, core_share=share)
        with engine.lock:
            engine.work = 1
        ae._wake.set()
        ae._thread.join(5)
        assert ae.error is not None and not ae.alive

    try:
        asyncio.run(body())
        assert share.threads == 0  # it had claimed both cores for the step that failed
    finally:
        share.close()
        torch.set_num_threads(before)
