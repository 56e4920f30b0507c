"""kvtransfer between real OS processes, over NIXL and over torch.distributed: exact bytes,
heterogeneous TP head slices, concurrency, release notifications, layout mismatches, bad
handles, and owners that die or stall."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import (KVAgentHandle, LayoutMismatchError, TransferError, TransferTimeout,
                        make_agent, plan_heads)
from kvtransfer import plan as plan_mod
from tests.kv_owner_proc import Standby, pull_concurrently, seeded_cache
from tests.proc_signals import reap, stop_process, wait_until

BACKENDS = ["nixl", "torch"]
BASE = KVCacheLayout(num_layers=3, num_blocks=24, block_size=4, num_kv_heads=4, kv_head_start=0,
                     total_num_kv_heads=4, head_size=8, dtype="float32", tp_rank=0, tp_size=1)
# 32 KiB blocks: a pull of 200 of them takes long enough to be caught mid-way.
BIG = replace(BASE, num_layers=4, num_blocks=256, head_size=64)


def rank_layout(tp_rank: int, tp_size: int, base: KVCacheLayout = BASE) -> KVCacheLayout:
    per = base.total_num_kv_heads // tp_size
    return replace(base, num_kv_heads=per, kv_head_start=tp_rank * per, tp_rank=tp_rank,
                   tp_size=tp_size)


class Owner:
    def __init__(self, layout: KVCacheLayout, seed: int, backend: str,
                 device: str = "cpu", wait: bool = True, standby: Standby | None = None) -> None:
        """``wait=False``: started, its handle read by ``wait_ready`` (several owners then
        start side by side). ``standby``: a process of that pool, its imports done."""
        self.layout, self.seed = layout, seed
        argv = [layout.to_json(), str(seed), backend, device]
        if standby is not None:
            self.proc = standby.start(argv)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.kv_owner_proc", *argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.cache = seeded_cache(layout, seed)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        # NIXL logs to stdout too: the handle is the line we tagged.
        line = ""
        while not line.startswith("HANDLE "):
            line = self.proc.stdout.readline()
            assert line, "the owner process exited before printing its handle"
        self.handle = KVAgentHandle.from_bytes(bytes.fromhex(line.split()[1]))

    def next_notification(self) -> str:
        """Blocks until the owner reports a notification (the test's timeout bounds it)."""
        while True:
            line = self.proc.stdout.readline()
            assert line, "the owner process exited"
            if line.startswith("NOTIFY "):
                return json.loads(line[len("NOTIFY "):])["notification"]

    def kill(self) -> None:
        reap(self.proc)


@pytest.fixture(scope="module")
def standby():
    """Owner processes kept ready: two, for the tests that start two owners at once."""
    pool = Standby(size=2)
    yield pool
    pool.close()


@pytest.fixture
def owners(standby):
    made: list[Owner] = []

    def make(layout: KVCacheLayout, seed: int, backend: str, device: str = "cpu",
             wait: bool = True) -> Owner:
        made.append(Owner(layout, seed, backend, device, wait, standby))
        return made[-1]

    yield make
    for o in made:
        if o.proc.poll() is None:
            o.proc.send_signal(signal.SIGCONT)
        o.kill()


def _reader(layout: KVCacheLayout, backend: str):
    cache = torch.zeros(layout.shape, dtype=torch.float32)
    return make_agent(backend, cache, layout), cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_block_subsets_arrive_exactly(owners, backend):
    owner = owners(BASE, 1, backend)
    agent, cache = _reader(BASE, backend)
    rng = random.Random(0)
    moved = 0
    try:
        for _ in range(5):
            n = rng.randint(1, 10)
            src = [rng.randrange(BASE.num_blocks) for _ in range(n)]  # repeats are fine remotely
            dst = rng.sample(range(BASE.num_blocks), n)
            stats = agent.pull([owner.handle], src, dst, timeout_s=20.0)
            assert torch.equal(cache[dst], owner.cache[src])
            assert (stats.num_blocks, stats.num_bytes) == (n, n * BASE.bytes_per_block)
            moved += stats.num_bytes
        agent.pull([owner.handle], [3], [5], timeout_s=20.0, notify=b"release:req-7")
        counters = agent.counters()
    finally:
        agent.close()
    assert owner.next_notification() == "release:req-7"
    assert (counters.transfers, counters.failures, counters.notifications_sent) == (6, 0, 1)
    assert counters.bytes == moved + BASE.bytes_per_block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vram_blocks_move_between_processes_over_nixl(owners):
    """The serving path's transfer on a GPU: both caches registered as VRAM, two processes."""
    pytest.importorskip("nixl")
    owner = owners(BIG, 11, "nixl", "cuda")
    cache = torch.zeros(BIG.shape, dtype=torch.float32, device="cuda")
    agent = make_agent("nixl", cache, BIG)
    try:
        assert agent.handle().mem_type == "VRAM"
        src, dst = list(range(40, 240)), list(range(200, 0, -1))
        stats = agent.pull([owner.handle], src, dst, timeout_s=30.0, notify=b"release:gpu")
    finally:
        agent.close()
    assert torch.equal(cache[dst].cpu(), owner.cache[src])
    assert stats.num_bytes == len(src) * BIG.bytes_per_block
    assert owner.next_notification() == "release:gpu"


def test_neighbouring_blocks_move_as_runs(owners):
    """Runs that step by one on both sides travel as one descriptor (every layer, K and V:
    the cache is block-major)."""
    owner = owners(BASE, 3, "nixl")
    agent, cache = _reader(BASE, "nixl")
    # Runs [4..7]->[10..13], then [20]->[2] (a break on both sides), then [21..22]->[14..15]
    # (a break on the local side only).
    src, dst = [4, 5, 6, 7, 20, 21, 22], [10, 11, 12, 13, 2, 14, 15]
    try:
        stats = agent.pull([owner.handle], src, dst, timeout_s=20.0)
    finally:
        agent.close()
    assert torch.equal(cache[dst], owner.cache[src])
    untouched = [b for b in range(BASE.num_blocks) if b not in dst]
    assert not cache[untouched].any()
    assert stats.num_descriptors == 3


def test_block_runs():
    r, l, n = plan_mod.block_runs(np.array([4, 5, 6, 9, 10, 3]), np.array([0, 1, 2, 3, 4, 9]))
    assert (r.tolist(), l.tolist(), n.tolist()) == ([4, 9, 3], [0, 3, 9], [3, 2, 1])
    r, l, n = plan_mod.block_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert n.size == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_concurrent_pulls_for_different_requests(owners, backend):
    owner = owners(BIG, 2, backend)
    agent, cache = _reader(BIG, backend)
    rng = random.Random(1)
    local = rng.sample(range(BIG.num_blocks), 16 * 12)
    jobs = [(rng.sample(range(BIG.num_blocks), 12), local[i * 12:(i + 1) * 12])
            for i in range(16)]
    errors = pull_concurrently(agent, [owner.handle], jobs, "c", timeout_s=60.0)
    assert errors == []
    for src, dst in jobs:
        assert torch.equal(cache[dst], owner.cache[src])
    assert sorted(owner.next_notification() for _ in jobs) == sorted(
        f"release:c{i}" for i in range(16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_owner_into_tp1_reader_fills_each_head_slice(owners, backend):
    ranks = [owners(rank_layout(r, 2), 10 + r, backend, wait=False) for r in range(2)]
    for o in ranks:
        o.wait_ready()
    agent, cache = _reader(BASE, backend)
    try:
        agent.pull([o.handle for o in ranks], [0, 7, 9], [4, 5, 6], timeout_s=20.0,
                   notify=b"release:tp2")
        # Out of rank order the release went to rank 1, which nobody polls: the lease held
        # its blocks until it expired. Refused, as is a rank given twice or alone.
        for wrong in ([ranks[1].handle, ranks[0].handle], [ranks[0].handle] * 2,
                      [ranks[0].handle]):
            with pytest.raises(ValueError, match="rank order|repeat"):
                agent.pull(wrong, [1], [8], timeout_s=20.0, notify=b"release:wrong")
    finally:
        agent.close()
    for r, o in enumerate(ranks):
        heads = slice(2 * r, 2 * r + 2)
        assert torch.equal(cache[[4, 5, 6]][..., heads, :], o.cache[[0, 7, 9]])
    assert not cache[[0, 1, 2, 3, 7, 8]].any()
    assert ranks[0].next_notification() == "release:tp2"  # to the owner's rank 0 only


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp1_owner_into_tp2_reader_takes_its_heads(owners, backend):
    owner = owners(BASE, 3, backend)
    local = rank_layout(1, 2)
    agent, cache = _reader(local, backend)
    try:
        agent.pull([owner.handle], [2, 3], [0, 1], timeout_s=20.0)
    finally:
        agent.close()
    assert torch.equal(cache[[0, 1]], owner.cache[[2, 3]][..., 2:4, :])


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_is_refused_before_any_transfer(owners, backend):
    owner = owners(BASE, 4, backend)
    for field, value, needle in [("head_size", 16, "head_size.*16.*8"),
                                 ("num_layers", 2, "num_layers.*2.*3"),
                                 ("block_size", 8, "block_size.*8.*4"),
                                 ("dtype", "bfloat16", "dtype.*bfloat16.*float32"),
                                 ("order", "layer,kv,block", "order.*layer,kv,block.*block,")]:
        other = replace(BASE, **{field: value})
        dtype = torch.bfloat16 if other.dtype == "bfloat16" else torch.float32
        cache = torch.zeros(other.shape, dtype=dtype)
        agent = make_agent(backend, cache, other)
        try:
            with pytest.raises(LayoutMismatchError, match=needle):
                agent.pull([owner.handle], [0], [0], timeout_s=5.0)
            assert agent.counters().transfers == 0
        finally:
            agent.close()
        assert not cache.any()
    with pytest.raises(LayoutMismatchError, match="total_num_kv_heads"):
        plan_heads(BASE, [replace(BASE, total_num_kv_heads=8, num_kv_heads=8)])
    with pytest.raises(LayoutMismatchError, match="cannot cover local heads"):
        plan_heads(BASE, [rank_layout(0, 2)])  # half the heads are missing


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_block_ids_are_refused(owners, backend):
    owner = owners(BASE, 6, backend)
    agent, cache = _reader(BASE, backend)
    try:
        with pytest.raises(ValueError, match="remote block ids"):
            agent.pull([owner.handle], [BASE.num_blocks + 3], [0], timeout_s=5.0)
        with pytest.raises(ValueError, match="local block ids"):
            agent.pull([owner.handle], [0], [BASE.num_blocks], timeout_s=5.0)
        with pytest.raises(ValueError, match="2 remote blocks but 1 local"):
            agent.pull([owner.handle], [0, 1], [0], timeout_s=5.0)
        with pytest.raises(ValueError, match="repeat"):
            agent.pull([owner.handle], [0, 1], [2, 2], timeout_s=5.0)
        with pytest.raises(ValueError, match="integers"):
            agent.pull([owner.handle], [0.5], [2], timeout_s=5.0)
        with pytest.raises(ValueError, match="timeout_s"):
            agent.pull([owner.handle], [0], [2], timeout_s=0)
        with pytest.raises(ValueError, match="no remote ranks"):
            agent.pull([], [0], [2], timeout_s=5.0)
    finally:
        agent.close()
    assert not cache.any()


def test_bad_handle_bytes_raise_value_error():
    cache = torch.zeros(BASE.shape)
    with make_agent("torch", cache, BASE) as agent:
        good = agent.handle()
        assert KVAgentHandle.from_bytes(good.to_bytes()) == good
        d = json.loads(good.to_bytes())
        with make_agent("nixl", torch.zeros(BASE.shape), BASE) as nixl_agent:
            with pytest.raises(ValueError, match="uses backend 'torch'"):
                nixl_agent.pull([good], [0], [0], timeout_s=5.0)
    bad = [b"{nope", b"", b"[]", b"\xff\xfe", json.dumps({**d, "version": 99}).encode(),
           json.dumps({k: v for k, v in d.items() if k != "layout"}).encode(),
           json.dumps({**d, "num_bytes": d["num_bytes"] + 4}).encode(),
           json.dumps({**d, "backend": "carrier-pigeon"}).encode(),
           json.dumps({**d, "address": "nowhere"}).encode(),
           json.dumps({**d, "address": "127.0.0.1:99999999999999999999"}).encode(),
           json.dumps({**d, "address": "127.0.0.1:0"}).encode(),
           json.dumps({**d, "address": ":5000"}).encode(),
           json.dumps({**d, "address": "127.0.0.1:٥٠"}).encode(),  # Arabic-Indic digits
           json.dumps({**d, "metadata": "***"}).encode(),
           # Integers NIXL takes as unsigned 64-bit (or device ids) must not overflow there.
           json.dumps({**d, "device_id": -2**63}).encode(),
           json.dumps({**d, "device_id": 2**40}).encode(),
           json.dumps({**d, "base_addr": -4096}).encode(),
           json.dumps({**d, "base_addr": 2**64 - 8}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "kv_head_start": "0"}}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "tp_rank": None}}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "num_blocks": True}}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "dtype": 4}}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "num_blocks": -1}}).encode(),
           json.dumps({**d, "layout": {**d["layout"], "kv_head_start": 3}}).encode(),
           # A peer from before the block-major cache: its bytes are in another order.
           json.dumps({**d, "version": 1}).encode(),
           json.dumps({**d, "layout": {k: v for k, v in d["layout"].items()
                                       if k != "order"}}).encode(),
           good.to_bytes()[:-7],
           b"[" * 200_000]  # nested past the parser's recursion limit
    for raw in bad:
        with pytest.raises(ValueError,
                           match="KV agent handle|KV cache layout|handle of|unknown|invalid"):
            KVAgentHandle.from_bytes(raw)
    with pytest.raises(ValueError, match="is bytes"):
        KVAgentHandle.from_bytes("a string")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_owner_fails_within_the_timeout(owners, backend):
    owner = owners(BASE, 5, backend)
    handle = owner.handle
    owner.kill()
    agent, _ = _reader(BASE, backend)
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferError):
            agent.pull([handle], list(range(8)), list(range(8)), timeout_s=3.0)
        assert agent.counters().failures == 1
    finally:
        agent.close()
    assert time.monotonic() - t0 < 30  # bounded by the timeout plus UCX's own error path


@pytest.mark.parametrize("backend", BACKENDS)
def test_owner_killed_mid_transfer_fails_within_the_timeout(owners, backend):
    owner = owners(BIG, 7, backend)
    agent, cache = _reader(BIG, backend)
    outcome: dict = {"ok": 0}
    first_done = threading.Event()

    def loop() -> None:
        try:
            while True:
                agent.pull([owner.handle], list(range(200)), list(range(200)), timeout_s=5.0)
                outcome["ok"] += 1
                first_done.set()
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome["error"] = e
            outcome["at"] = time.monotonic()
            first_done.set()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        assert first_done.wait(60)
        killed_at = time.monotonic()
        os.kill(owner.proc.pid, signal.SIGKILL)  # pulls keep running back to back
        t.join(30)
        assert not t.is_alive(), "the pull hung on a dead owner"
    finally:
        agent.close()
    assert outcome["ok"] >= 1
    assert isinstance(outcome["error"], TransferError)
    assert outcome["at"] - killed_at < 5.0 + 10.0  # the timeout plus the backend's error path


def _stalled_torch_owner(owners):
    """A torch owner stopped (SIGSTOP) once a reader's pair with it is up: (owner, reader)."""
    owner = owners(BASE, 8, "torch")
    agent, _ = _reader(BASE, "torch")
    agent.pull([owner.handle], [1], [1], timeout_s=20.0)  # the pair is up
    stop_process(owner.proc)
    return owner, agent


def test_stalled_owner_times_out_over_torch(owners):
    owner, agent = _stalled_torch_owner(owners)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            agent.pull([owner.handle], [2], [2], timeout_s=1.5)
        assert time.monotonic() - t0 < 10
        assert agent.counters().timeouts == 1
    finally:
        agent.close()


def test_a_pull_waiting_behind_a_stuck_one_keeps_its_own_timeout_over_torch(owners):
    import threading

    owner, agent = _stalled_torch_owner(owners)
    try:
        stuck_done = threading.Event()

        def stuck():  # holds the pair's connection until its own, long, timeout
            try:
                agent.pull([owner.handle], [2], [2], timeout_s=30.0)
            except TransferError:
                pass
            finally:
                stuck_done.set()

        pair = agent._pairs[owner.handle.agent_name]
        tag = pair.next_tag
        thread = threading.Thread(target=stuck)
        thread.start()
        # The stuck pull holds the connection: it took the pair's lock and sent its request.
        assert wait_until(lambda: pair.lock.locked() and pair.next_tag > tag, 10)
        with pytest.raises(TransferTimeout):
            agent.pull([owner.handle], [3], [3], timeout_s=1.0)
        assert not stuck_done.is_set()  # it ended on its own timeout, not the stuck one's
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
        agent.close()
    thread.join(60)


def test_owner_progress_slows_down_only_after_a_quiet_spell():
    from kvtransfer.nixl_agent import (_OWNER_IDLE_AFTER_S, _OWNER_IDLE_PROGRESS_S,
                                       _OWNER_PROGRESS_S, _READER_PROGRESS_S, progress_interval)

    assert progress_interval(True, 0.0) == _OWNER_PROGRESS_S
    assert progress_interval(True, _OWNER_IDLE_AFTER_S + 0.1) == _OWNER_IDLE_PROGRESS_S
    assert _OWNER_PROGRESS_S < _OWNER_IDLE_PROGRESS_S <= _READER_PROGRESS_S
    assert progress_interval(False, 0.0) == _READER_PROGRESS_S


def test_an_idle_owner_still_serves_a_new_reader_and_hears_its_release(owners):
    from kvtransfer.nixl_agent import _OWNER_IDLE_AFTER_S

    owner = owners(BASE, 4, "nixl")
    for round_ in range(2):  # a first reader connects to the idle owner; then a second one
        time.sleep(_OWNER_IDLE_AFTER_S + 0.5)  # the owner is on its slow progress loop now
        agent, cache = _reader(BASE, "nixl")
        try:
            agent.pull([owner.handle], [1, 7], [2, 3], timeout_s=20.0,
                       notify=f"release:idle-{round_}".encode())
            assert torch.equal(cache[[2, 3]], owner.cache[[1, 7]])
        finally:
            agent.close()
        assert owner.next_notification() == f"release:idle-{round_}"


def test_an_owner_told_reads_are_due_serves_them_without_waiting_out_its_idle_poll(
        monkeypatch):
    # A read completes only as its owner progresses. An engine that leases blocks says so
    # (reads_due_soon); until then its owner may be asleep, here for an hour from the start.
    import kvtransfer.nixl_agent as nixl_agent

    monkeypatch.setattr(nixl_agent, "_OWNER_PROGRESS_S", 3600.0)
    monkeypatch.setattr(nixl_agent, "_OWNER_IDLE_PROGRESS_S", 3600.0)
    leased = threading.Event()
    owner = make_agent("nixl", seeded_cache(BASE, 6), BASE)
    owner.expect_reads(leased.is_set)
    reader, cache = _reader(BASE, "nixl")
    try:
        reader.preconnect(owner.handle())
        leased.set()  # a lease nobody announced: the owner sleeps on through the read
        with pytest.raises(TransferTimeout):
            reader.pull([owner.handle()], [1, 2], [3, 4], timeout_s=1.0)
        monkeypatch.setattr(nixl_agent, "_OWNER_PROGRESS_S", 0.001)  # once it looks again
        owner.reads_due_soon()
        reader.pull([owner.handle()], [5, 6], [7, 8], timeout_s=20.0, notify=b"release:r")
        assert torch.equal(cache[[7, 8]], owner.cache[[5, 6]])
        deadline = time.monotonic() + 20.0
        got: list[bytes] = []
        while not got and time.monotonic() < deadline:  # polled fast while the lease lasts
            got = owner.poll_notifications()
            time.sleep(0.01)
        assert got == [b"release:r"]
    finally:
        reader.close()
        owner.close()


def test_layout_json_needs_every_field():
    assert KVCacheLayout.from_json(BASE.to_json()) == BASE
    fields = json.loads(BASE.to_json())
    with pytest.raises(ValueError, match=r"missing \['order'\]"):
        KVCacheLayout.from_json(json.dumps({k: v for k, v in fields.items() if k != "order"}))
    for raw in ("[1]", "{nope", json.dumps({**fields, "colour": "red"}), "[" * 100_000):
        with pytest.raises(ValueError, match="not a KV cache layout"):
            KVCacheLayout.from_json(raw)


def test_a_block_is_one_run_of_every_layer():
    """Block-major: block b's bytes (all layers, K and V) start at b * bytes_per_block."""
    cache = torch.arange(BASE.num_blocks * BASE.bytes_per_block // 4,
                         dtype=torch.float32).view(BASE.shape)
    desc = plan_mod.descriptors(BASE, cache.data_ptr(), np.array([5, 2]), 0, 4, 0, False)
    el = cache.element_size()
    for (addr, length, _), block in zip(desc.tolist(), (5, 2)):
        assert length == BASE.bytes_per_block
        first = (addr - cache.data_ptr()) // el
        assert torch.equal(cache.view(-1)[first:first + length // el], cache[block].flatten())
