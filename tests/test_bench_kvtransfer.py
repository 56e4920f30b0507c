"""``pdserve bench kvtransfer`` and its CMA helper: ``process_vm_readv`` of an owner process's
cache returns exactly its bytes, refusals are reported, and the bench reports the CMA limit."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench import cma
from bench import kvtransfer as bench_kv
from engine.kv_layout import KVCacheLayout
from tests.test_kvtransfer import Owner

# A block (3 layers, K and V) is one run: 1200 scattered blocks are more runs than one syscall
# takes. 384 bytes a block.
LAYOUT = KVCacheLayout(num_layers=3, num_blocks=2048, block_size=4, num_kv_heads=2,
                       kv_head_start=0, total_num_kv_heads=2, head_size=8, dtype="float32",
                       tp_rank=0, tp_size=1)


@pytest.fixture
def owner():
    o = Owner(LAYOUT, 11, "nixl")
    yield o
    o.proc.stdin.close()
    o.kill()


def _cma_or_skip(o: Owner) -> None:
    why = cma.probe(o.proc.pid, o.handle.base_addr)
    if why:
        pytest.skip(f"process_vm_readv is refused here: {why}")


@pytest.mark.parametrize("pattern", ["random", "runs"])
def test_cma_read_returns_exactly_the_owners_bytes(owner, pattern):
    _cma_or_skip(owner)
    rng = np.random.default_rng(3)
    if pattern == "random":  # remote repeats are fine
        src = rng.integers(0, LAYOUT.num_blocks, 1200)
        dst = rng.choice(LAYOUT.num_blocks, 1200, replace=False)
    else:  # two neighbouring runs: one iovec per run
        src, dst = np.r_[10:40, 100:120], np.r_[50:80, 0:20]
    cache = torch.zeros(LAYOUT.shape, dtype=torch.float32)
    local, remote = cma.block_iovecs(LAYOUT, cache.data_ptr(), owner.handle.layout,
                                     owner.handle.base_addr, src, dst)
    if pattern == "random":
        assert len(local) > cma.IOV_MAX
    else:
        assert len(local) == 2
    assert cma.read(owner.proc.pid, local, remote) == len(dst) * LAYOUT.bytes_per_block
    assert torch.equal(cache[dst.tolist()], owner.cache[src.tolist()])
    untouched = sorted(set(range(LAYOUT.num_blocks)) - set(dst.tolist()))
    assert not cache[untouched].any()


def test_cma_refusals():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a reaped pid: nothing to read from
    buf = np.zeros(8, dtype=np.uint8)
    local = np.array([[buf.ctypes.data, 8]], dtype=np.uint64)
    with pytest.raises(cma.CMAError):
        cma.read(gone.pid, local, local.copy())
    assert cma.probe(gone.pid, buf.ctypes.data)
    with pytest.raises(ValueError, match="lengths"):
        cma.read(gone.pid, local, np.array([[buf.ctypes.data, 4]], dtype=np.uint64))
    with pytest.raises(ValueError, match="uint64"):
        cma.read(gone.pid, local.astype(np.int64), local.astype(np.int64))
    with pytest.raises(ValueError, match="descriptors"):
        cma.iovecs(np.zeros(3, dtype=np.uint64))
    half = replace(LAYOUT, num_kv_heads=1, kv_head_start=1, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match="whole rows"):
        cma.block_iovecs(LAYOUT, 4096, half, 4096, np.arange(2), np.arange(2))


@pytest.mark.slow  # ~15 s of bench sizes; the CMA reads and refusals are tested above
def test_bench_reports_the_cma_limit(capsys):
    ap = argparse.ArgumentParser()
    bench_kv.add_args(ap)
    # 8 MB pulls split over two NIXL streams; the bench checks the bytes that arrive.
    args = ap.parse_args(["--backend", "nixl", "--sizes-mb", "1,8", "--reps", "1",
                          "--nixl-streams", "2", "--json"])
    assert bench_kv.main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index('{\n  "threads"'):])  # NIXL logs to stdout before it
    assert report["nixl_streams"] == 2 and [s["size_mb"] for s in report["sizes"]] == [1, 8]
    for size in report["sizes"]:
        if report["cma_note"]:  # refused here (ptrace scope): reported, never made up
            assert size["cma_gb_s"] is None and size["cma_ratio"] == {}
            continue
        assert size["cma_gb_s"] > 0
        assert size["cma_ratio"]["nixl"] == pytest.approx(size["backend_gb_s"]["nixl"]
                                                          / size["cma_gb_s"])


def test_table_leaves_cma_cells_empty_when_refused(capsys):
    row = bench_kv.SizeResult(16, 64, 30.0, 50.0, {"nixl": 4.0}, {"nixl": 4.0 / 30.0})
    bench_kv._print_tables(["nixl"], bench_kv.SizesRun([row], "Operation not permitted"), [])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].count("|") == lines[2].count("|") == 9
    assert lines[2] == "| 16 MB | 64 | 30.00 | 50.00 |  | 4.00 | **0.13** |  |"
    assert any(line.endswith("not measured: Operation not permitted") for line in lines)
