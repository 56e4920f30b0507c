"""bench/gpu_check.sh, the one call a lent GPU gets, run here with stand-ins for python3 and
nvidia-smi: its exit status must say whether every step passed, since a lease is too short to
read through logs for a failure (it used to exit with `uniq`'s status, 0)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Exits with $FAKE_RC for every command, and with $FAKE_CUDA_RC for the script's GPU check.
_FAKE = """#!/bin/sh
case "$*" in *cuda.is_available*) exit "${FAKE_CUDA_RC:-0}" ;; esac
echo "fake $0 $*"
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "gpu_check.sh", tmp_path / "bench")
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    for name in ("python3", "nvidia-smi"):
        (fakes / name).write_text(_FAKE)
        (fakes / name).chmod(stat.S_IRWXU)
    (tmp_path / ".gpu-carry").mkdir()
    (tmp_path / ".gpu-carry" / "setup.sh").write_text(f'export PATH="{fakes}:$PATH"\n')
    return tmp_path


def _run(checkout: Path, *parts: str, **env: str) -> subprocess.CompletedProcess:
    out = checkout / "out"
    shutil.rmtree(out, ignore_errors=True)
    return subprocess.run(["bash", str(checkout / "bench" / "gpu_check.sh"), *parts],
                          env={**os.environ, "OUT": str(out), **env}, capture_output=True,
                          text=True, timeout=60)


def test_every_step_passing_exits_0(checkout):
    done = _run(checkout)  # the default parts: smoke, bench
    assert done.returncode == 0, done.stdout
    # versions (2 steps), smoke's 3 test runs, bench's 2 runs
    assert sum(line == "== rc=0" for line in done.stdout.splitlines()) == 7
    assert "fake" in done.stdout


def test_a_failing_step_fails_the_check(checkout):
    done = _run(checkout, "profile", FAKE_RC="1")
    assert done.returncode == 1 and "== rc=1" in done.stdout


def test_no_gpu_fails_before_any_step(checkout):
    done = _run(checkout, "smoke", FAKE_CUDA_RC="1")
    assert done.returncode == 1 and "torch sees no CUDA GPU" in done.stdout
    assert "== rc=" not in done.stdout


def test_steps_past_the_budget_are_skipped_and_fail_the_check(checkout):
    done = _run(checkout, "smoke", GPU_CHECK_BUDGET_S="5")
    assert done.returncode == 1
    assert "skipped (budget of 5s spent)" in done.stdout and "== rc=0" not in done.stdout


def test_samplers_do_not_outlive_a_bench_that_ended_early(checkout):
    # The benches end at once here, with no workers for the py-spy samplers to find: each
    # sampler would poll for them for minutes of the lease (120-150 s) before this fix.
    done = _run(checkout, "c1", "serve", GPU_CHECK_SAMPLER_GRACE_S="0")
    assert done.returncode == 0, done.stdout
    assert sum(line == "== rc=0" for line in done.stdout.splitlines()) == 4  # c1 + 3 serves
    assert done.stdout.count("== sampler stopped") == 3
