"""kvtransfer over NIXL between real OS processes: exact bytes, heterogeneous TP head slices,
release notifications, layout mismatches and a dead owner."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import (KVAgentHandle, LayoutMismatchError, TransferError, make_agent,
                        plan_heads)
from tests.kv_owner_proc import seeded_cache

BASE = KVCacheLayout(num_layers=3, num_blocks=24, block_size=4, num_kv_heads=4, kv_head_start=0,
                     total_num_kv_heads=4, head_size=8, dtype="float32", tp_rank=0, tp_size=1)


def rank_layout(tp_rank: int, tp_size: int, num_blocks: int = 24) -> KVCacheLayout:
    per = BASE.total_num_kv_heads // tp_size
    return replace(BASE, num_blocks=num_blocks, num_kv_heads=per, kv_head_start=tp_rank * per,
                   tp_rank=tp_rank, tp_size=tp_size)


class Owner:
    def __init__(self, layout: KVCacheLayout, seed: int) -> None:
        self.layout, self.seed = layout, seed
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_owner_proc", layout.to_json(), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # NIXL logs to stdout too: the handle is the line we tagged.
        line = ""
        while not line.startswith("HANDLE "):
            line = self.proc.stdout.readline()
            assert line, "the owner process exited before printing its handle"
        self.handle = KVAgentHandle.from_bytes(bytes.fromhex(line.split()[1]))
        self.cache = seeded_cache(layout, seed)

    def next_notification(self) -> str:
        """Blocks until the owner reports a notification (the test's timeout bounds it)."""
        while True:
            line = self.proc.stdout.readline()
            assert line, "the owner process exited"
            if line.startswith("NOTIFY "):
                return json.loads(line[len("NOTIFY "):])["notification"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def owners():
    made: list[Owner] = []

    def make(layout: KVCacheLayout, seed: int) -> Owner:
        made.append(Owner(layout, seed))
        return made[-1]

    yield make
    for o in made:
        if o.proc.poll() is None:
            o.kill()


def _reader(layout: KVCacheLayout):
    cache = torch.zeros(layout.shape, dtype=torch.float32)
    return make_agent("nixl", cache, layout), cache


def test_random_block_subsets_arrive_exactly(owners):
    owner = owners(BASE, seed=1)
    agent, cache = _reader(BASE)
    rng = random.Random(0)
    try:
        for _ in range(5):
            n = rng.randint(1, 10)
            src = rng.sample(range(BASE.num_blocks), n)
            dst = rng.sample(range(BASE.num_blocks), n)
            stats = agent.pull([owner.handle], src, dst, timeout_s=10.0)
            assert torch.equal(cache[:, :, dst], owner.cache[:, :, src])
            assert stats.num_bytes == n * BASE.bytes_per_block
        agent.pull([owner.handle], [3], [5], timeout_s=10.0, notify=b"release:req-7")
    finally:
        agent.close()
    assert owner.next_notification() == "release:req-7"


def test_tp2_owner_into_tp1_reader_fills_each_head_slice(owners):
    ranks = [owners(rank_layout(r, 2), seed=10 + r) for r in range(2)]
    agent, cache = _reader(BASE)
    try:
        agent.pull([o.handle for o in ranks], [0, 7, 9], [4, 5, 6], timeout_s=10.0)
    finally:
        agent.close()
    for r, o in enumerate(ranks):
        heads = slice(2 * r, 2 * r + 2)
        assert torch.equal(cache[:, :, [4, 5, 6], :, heads], o.cache[:, :, [0, 7, 9]])


def test_tp1_owner_into_tp2_reader_takes_its_heads(owners):
    owner = owners(BASE, seed=3)
    local = rank_layout(1, 2)
    agent, cache = _reader(local)
    try:
        agent.pull([owner.handle], [2, 3], [0, 1], timeout_s=10.0)
    finally:
        agent.close()
    assert torch.equal(cache[:, :, [0, 1]], owner.cache[:, :, [2, 3], :, 2:4])


def test_layout_mismatch_is_refused_before_any_transfer(owners):
    owner = owners(BASE, seed=4)
    other = replace(BASE, head_size=16)
    agent, cache = _reader(other)
    try:
        with pytest.raises(LayoutMismatchError, match="head_size.*16.*8"):
            agent.pull([owner.handle], [0], [0], timeout_s=5.0)
        with pytest.raises(LayoutMismatchError, match="total_num_kv_heads"):
            plan_heads(BASE, [replace(BASE, total_num_kv_heads=8, num_kv_heads=8)])
    finally:
        agent.close()
    assert not cache.any()


def test_out_of_range_remote_blocks_are_refused(owners):
    owner = owners(BASE, seed=6)
    agent, cache = _reader(BASE)
    try:
        with pytest.raises(ValueError, match="remote block ids"):
            agent.pull([owner.handle], [BASE.num_blocks + 3], [0], timeout_s=5.0)
    finally:
        agent.close()
    assert not cache.any()


def test_bad_block_ids_and_bad_handles():
    with pytest.raises(ValueError, match="not a KV agent handle"):
        KVAgentHandle.from_bytes(b"{nope")
    agent, _ = _reader(BASE)
    try:
        handle = agent.handle()
        with pytest.raises(ValueError, match="local block ids"):
            agent.pull([handle], [0], [BASE.num_blocks], timeout_s=1.0)
        with pytest.raises(ValueError, match="2 remote blocks but 1 local"):
            agent.pull([handle], [0, 1], [0], timeout_s=1.0)
    finally:
        agent.close()


def test_dead_owner_fails_within_the_timeout(owners):
    owner = owners(BASE, seed=5)
    handle = owner.handle
    owner.kill()
    agent, _ = _reader(BASE)
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferError):
            agent.pull([handle], list(range(8)), list(range(8)), timeout_s=3.0)
    finally:
        agent.close()
    assert time.monotonic() - t0 < 30  # bounded by the timeout plus UCX's own error path
