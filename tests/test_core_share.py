"""Core sharing between co-located workers (engine/core_share.py): real processes holding
slots in one shared file, the engine thread sizing its steps from it, and the launcher that
sets it up."""
from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine import core_share
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


def test_slots_run_out_with_a_clear_error(share_path):
    # Every slot held: each share opens the file anew, so each holds its own slot's lock.
    held = [CoreShare(CoreShareConfig(share_path, 2, 1)) for _ in range(MAX_SLOTS)]
    try:
        assert sorted(s._index for s in held) == list(range(MAX_SLOTS))
        with pytest.raises(RuntimeError, match=f"no free slot .{MAX_SLOTS} live"):
            CoreShare(CoreShareConfig(share_path, 2, 1))
        held.pop().close()  # a slot given back is free again
        held.append(CoreShare(CoreShareConfig(share_path, 2, 1)))
    finally:
        for s in held:
            s.close()


def test_without_slot_locks_a_slot_s_pid_tells_whether_it_is_in_use(share_path, monkeypatch):
    monkeypatch.setattr(core_share, "_slot_locks_work", lambda fd: False)
    me = CoreShare(CoreShareConfig(share_path, 2, 1))
    try:
        # Every other slot held by a live process (ours, the parent of this test).
        me._slots[:, 0] = os.getppid()
        me._slots[me._index, 0] = os.getpid()
        me._slots[:, 1] = 1
        me._slots[me._index, 1] = 0
        assert me.others_busy_threads() == MAX_SLOTS - 1
        monkeypatch.setattr(os, "getpid", lambda: 1)  # a newcomer: pid 1 is alive, never ours
        with pytest.raises(RuntimeError, match=f"no free slot .{MAX_SLOTS} live"):
            CoreShare(CoreShareConfig(share_path, 2, 1))
        monkeypatch.undo()
        monkeypatch.setattr(core_share, "_slot_locks_work", lambda fd: False)
        # Pids no process has count as free, without asking the kernel about them (kill(-1,
        # 0) asks about every process; a pid over 2**31 is an OverflowError).
        me._slots[:, 0] = [-1, 1 << 40] * (MAX_SLOTS // 2)
        me._slots[me._index, 0] = os.getpid()
        assert me.others_busy_threads() == 0
        assert me.threads_for_step() == 2
    finally:
        me._slots[:, :] = 0
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


def test_a_step_grows_into_cores_lent_mid_step(share_path):
    at_once = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    me = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1, lend_delay_s=0.01))
    peer = Peer(share_path, 2, 1)
    try:
        # A group that lends at once grows no step: the lender's team still spins then.
        assert peer.say("busy") == 2 and at_once.threads_for_step() == 1
        assert peer.say("idle") == 0
        assert at_once.recheck() is None and at_once.threads == 1
        at_once.idle()
        # Lent late, the cores are taken at the next layer.
        assert peer.say("busy") == 2  # I am idle: it borrows my core
        assert me.threads_for_step() == 1  # my own share while it holds both
        assert me.recheck() is None  # nobody woke up or went idle
        assert peer.say("idle") == 0  # it lends: my next layer takes its core
        assert me.recheck() == 2 and me.others_busy_threads() == 0
        assert me.recheck() is None
        assert peer.say("busy") == 1  # back: its own share, and mine goes back to me alone
        assert me.recheck() == 1
        me.idle()
        assert me.recheck() is None  # idle: no step to resize, whoever lent what
        assert peer.say("idle") == 0
        assert me.recheck() is None
    finally:
        peer.kill()
        me.close()
        at_once.close()


def test_an_engine_may_lend_its_cores_only_a_while_after_its_last_step(share_path):
    """Its OpenMP team spins that long after a step; lent at once, a borrower's team shared a
    core with the spinning threads (docs/benchmarks.md, session 47)."""
    before = torch.get_num_threads()
    engine = _CountingEngine()
    peer = Peer(share_path, 2, 1)

    async def steps_then_slot(delay: float) -> int:
        share = CoreShare(CoreShareConfig(share_path, 2, 1, lend_delay_s=delay))
        ae = AsyncEngine(engine, core_share=share)
        try:
            with engine.lock:
                engine.work, engine.threads = 1, []
            ae._wake.set()
            while engine.has_unfinished_requests() or len(engine.threads) < 3:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # well past a step's end, well before a long delay's
            return peer.say("busy")  # what the peer may take now
        finally:
            ae._stop.set()
            ae._wake.set()
            ae._thread.join(5)
            share.close()
            peer.say("idle")

    try:
        assert asyncio.run(steps_then_slot(1.0)) == 1  # still held: the peer's own share
        assert asyncio.run(steps_then_slot(0.0)) == 2  # lent at once (the default)
    finally:
        peer.kill()
        torch.set_num_threads(before)


def test_the_lend_delay_comes_from_the_environment(monkeypatch):
    from engine.core_share import LEND_DELAY_ENV, lend_delay_from_env

    monkeypatch.delenv(LEND_DELAY_ENV, raising=False)
    assert lend_delay_from_env() == 0.0
    monkeypatch.setenv(LEND_DELAY_ENV, "10")
    assert lend_delay_from_env() == 0.01
    engine = EngineConfig("tiny-llama", role="decode", kv_transfer_backend="nixl")
    cfg = WorkerConfig(engine=engine, core_share_path="/tmp/x", core_share_cores=2)
    assert cfg.core_share_config(1).lend_delay_s == 0.01
    for bad in ("ten", "-1", "nan", "5000"):
        monkeypatch.setenv(LEND_DELAY_ENV, bad)
        with pytest.raises(ValueError, match=LEND_DELAY_ENV):
            lend_delay_from_env()
    with pytest.raises(ValueError, match="lend_delay_s"):
        CoreShareConfig("/tmp/x", 2, 1, lend_delay_s=2.0)


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


def test_a_dead_worker_s_slot_is_free_before_it_is_reaped(share_path):
    me = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    peer = Peer(share_path, 2, 1)
    try:
        assert peer.say("busy") == 2
        assert me.others_busy_threads() == 2
        peer.proc.kill()  # SIGKILLed mid-step (the OOM killer); its parent has not reaped it
        os.waitid(os.P_PID, peer.proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        with open(f"/proc/{peer.proc.pid}/stat") as f:
            assert f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie: kill(pid, 0) works
        assert me.others_busy_threads() == 0  # its slot's lock went with its files
        assert me.threads_for_step() == 2
        newcomer = CoreShare(CoreShareConfig(share_path, 2, 1))
        assert newcomer._index == peer.slot  # the dead process's slot is free to take
        newcomer.close()
    finally:
        peer.kill()
        me.close()


def test_a_slot_naming_a_live_process_counts_only_while_its_owner_holds_it(share_path):
    me = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    other = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    try:
        # What a worker SIGKILLed while busy leaves, its pid now another live process's.
        free = next(i for i in range(MAX_SLOTS) if i not in (me._index, other._index))
        me._slots[free] = (os.getppid(), 1)
        assert me.others_busy_threads() == 0 and me.threads_for_step() == 2
        me.idle()
        assert other.threads_for_step() == 2
        assert me.others_busy_threads() == 2  # a live owner's threads count
        # More threads than this worker counts cores: a peer that counts more (another
        # --core-share-cores or affinity) holds all of this one's.
        other._slots[other._index, 1] = 1000
        assert me.others_busy_threads() == 2 and me.threads_for_step() == 1
        me.idle()
        # A pid no process can have, no worker wrote: free, even in a slot someone holds.
        other._slots[other._index] = (1 << 40, 1)
        assert me.others_busy_threads() == 0 and me.threads_for_step() == 2
    finally:
        me.close()
        other.close()


def test_a_peer_counting_more_cores_takes_this_ones_while_busy(share_path):
    """Workers of one group under other affinities count other cores; a busy peer on 4 must
    not look idle to a worker on 2 (both would run, 6 threads on 4 cores)."""
    big = Peer(share_path, cores=4, base=2)
    small = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    try:
        assert big.say("busy") == 4
        assert small.others_busy_threads() == 2 and small.threads_for_step() == 1
        small.idle()
        assert big.say("idle") == 0
        assert small.threads_for_step() == 2
    finally:
        small.close()
        big.kill()


def test_a_share_file_that_cannot_get_its_blocks_is_a_clear_error(share_path, monkeypatch):
    """Sparse, the file's first store through the mapping on a full disk is SIGBUS: the
    blocks are taken at opening, where no space is an error naming the file."""
    def full(fd, offset, length):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(core_share.os, "posix_fallocate", full)
    with pytest.raises(ValueError, match="cannot allocate the core share file.*No space"):
        CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    # A file left sparse by a worker that died so: the next one allocates it too.
    with pytest.raises(ValueError, match="No space"):
        CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    monkeypatch.undo()
    share = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    try:
        assert os.stat(share_path).st_blocks > 0 and share.threads_for_step() == 2
    finally:
        share.close()


class _PausingRow:
    """A share's wake-up row that stops between reading the count and writing it back."""

    def __init__(self, row, pause) -> None:
        self.row, self.pause = row, pause

    def __getitem__(self, i):
        return self.row[i]

    def __setitem__(self, i, value) -> None:
        self.pause("bump")
        self.row[i] = value


class _Stepper:
    """``share.threads_for_step()`` in a thread of its own that stops at its pause points until
    ``go()``: once it read the others' slots ("allowed"), and with ``pause_bump`` between its
    read and write of the wake-up count ("bump"). The test decides the interleaving: no
    timing."""

    def __init__(self, share: CoreShare, pause_bump: bool = False) -> None:
        self.share, self.result = share, None
        self.at: queue.Queue[str] = queue.Queue()
        self._go = threading.Semaphore(0)
        allowed, row = share._allowed, share._wakeups

        def paused_allowed() -> int:
            v = allowed()
            self._pause("allowed")
            return v

        share._allowed = paused_allowed
        if pause_bump:
            share._wakeups = _PausingRow(row, self._pause)

        def run() -> None:
            try:
                self.result = share.threads_for_step()
            finally:
                del share._allowed  # the class's again
                share._wakeups = row
                self.at.put("done")

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.next() == "allowed"

    def _pause(self, point: str) -> None:
        self.at.put(point)
        self._go.acquire()

    def next(self) -> str:
        return self.at.get(timeout=30)  # a deadlock guard: every step here takes microseconds

    def go(self) -> str:
        self._go.release()
        return self.next()


def _late_wake(a: CoreShare, b: CoreShare) -> None:
    b_step = _Stepper(b)  # b read a's slot (idle): 2 cores, not written yet
    assert a.threads_for_step() == 2  # a wakes: b's slot still idle
    assert b_step.go() == "done"  # b writes its slot and bumps the count


def _stale_slot(a: CoreShare, b: CoreShare) -> None:
    b.threads_for_step()
    assert a.threads_for_step() == 1  # busy on its own share across steps
    b.idle()
    a_step = _Stepper(a)  # a's next step: b idle, 2 cores; its slot still says 1
    assert b.threads_for_step() == 1  # b wakes, sees a's stale 1 and bumps the count
    assert a_step.go() == "done"  # a writes 2


def _lost_increment(a: CoreShare, b: CoreShare) -> None:
    a_step = _Stepper(a, pause_bump=True)  # both read the other idle: 2 cores each
    b_step = _Stepper(b)
    assert a_step.go() == "bump"  # a wrote its slot and read the count X
    assert b_step.go() == "done"  # b: X + 1
    assert a_step.go() == "done"  # a writes X + 1 too: b's bump is lost


@pytest.mark.parametrize("interleave", [_late_wake, _stale_slot, _lost_increment])
def test_workers_waking_together_end_within_the_cores(share_path, interleave):
    """Whatever the order in which two workers size their steps, once each checked between
    layers (recheck) they hold no more threads together than the group has cores."""
    a = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    b = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))
    try:
        interleave(a, b)
        a.recheck()
        b.recheck()
        assert a.threads + b.threads <= 2
        assert a._slots[a._index, 1] == a.threads and b._slots[b._index, 1] == b.threads
    finally:
        a.close()
        b.close()


def test_a_share_file_this_user_does_not_control_is_refused(tmp_path, monkeypatch):
    def refused(path, needle: str) -> None:
        with pytest.raises(ValueError, match=needle):
            CoreShare(CoreShareConfig(str(path), 2, 1))

    # A link planted where the file goes: its target is never opened for writing.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    (tmp_path / "link").symlink_to(victim)
    refused(tmp_path / "link", "symbolic link")
    assert victim.read_bytes() == b"precious\n"
    os.mkfifo(tmp_path / "fifo", 0o600)
    refused(tmp_path / "fifo", "not a regular file")
    # Someone else's file, or one others may write: they would size this worker's threads.
    mine = tmp_path / "cores"
    CoreShare(CoreShareConfig(str(mine), 2, 1)).close()
    assert (mine.stat().st_mode & 0o777) == 0o600
    os.chmod(mine, 0o620)
    refused(mine, "may be written by others .mode 620")
    os.chmod(mine, 0o644)  # others may read it: fine
    CoreShare(CoreShareConfig(str(mine), 2, 1)).close()
    real_euid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_euid + 1)
    refused(mine, f"belongs to uid {real_euid}, not to this user")
    monkeypatch.undo()
    # A file of another size is no share file (or one cut short): mapping it would SIGBUS.
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 100)
    os.chmod(short, 0o600)
    refused(short, "has 100 bytes")


def test_a_share_file_cut_short_under_a_worker_leaves_the_share(share_path):
    # A page of the mapping past the file's end is SIGBUS: in a process of its own.
    code = f"""
import os
from engine.core_share import CoreShare, CoreShareConfig
s = CoreShare(CoreShareConfig({share_path!r}, 2, 1))
assert s.threads_for_step() == 2
os.truncate({share_path!r}, 0)
print(s.recheck(), s.threads, flush=True)   # mid-step: down to its own share
s.idle()
print(s.threads_for_step(), s.recheck(), s.others_busy_threads(), flush=True)
s.close()
print("survived", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["1 1", "1 None 0", "survived"]
    assert "cut to 0 bytes" in r.stderr


def test_a_request_arriving_after_the_idle_check_runs_on_the_worker_s_own_share(share_path):
    """The check that sizes a step comes before the step: a request that lands in between is
    stepped unsized. It must not run on the cores the last step borrowed (its slot says idle,
    so a peer waking meanwhile takes them too)."""

    class _ArrivingLate(_CountingEngine):
        arrive_in_step = False

        def step(self) -> list:
            with self.lock:  # added after has_unfinished_requests() said no
                if self.arrive_in_step:
                    self.arrive_in_step = False
                    self.work += 1
            return super().step()

    before = torch.get_num_threads()
    engine = _ArrivingLate()
    share = CoreShare(CoreShareConfig(share_path, num_cores=2, base_threads=1))

    async def body() -> list[int]:
        ae = AsyncEngine(engine, core_share=share)
        try:
            with engine.lock:
                engine.work = 1
            ae._wake.set()
            # Wait for the sized step (alone: both cores), then for the engine going idle.
            await _until(lambda: len(engine.threads) == 3 and share.threads == 0)
            assert engine.threads == [2, 2, 2]
            with engine.lock:
                engine.threads = []
                engine.arrive_in_step = True
            ae._wake.set()
            await _until(lambda: len(engine.threads) == 3)
            return list(engine.threads)
        finally:
            ae._stop.set()
            ae._wake.set()
            ae._thread.join(5)

    try:
        assert asyncio.run(body()) == [1, 1, 1]  # its own share, not the 2 it borrowed
    finally:
        share.close()
        torch.set_num_threads(before)


async def _until(condition) -> None:
    deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, "the engine thread never got there"
        await asyncio.sleep(0.01)
