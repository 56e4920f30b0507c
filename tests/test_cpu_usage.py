"""bench/cpu_usage.py: the CPU a benchmark point's processes used, read from /proc."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.cpu_usage import CPUMeter, CPUShare, machine_busy_s, tree_cpu_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A parent that sleeps while the child it started spins, until stdin closes.
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
child.wait()
"""


@pytest.fixture
def sleeping_parent_of_a_spinner():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        yield parent.pid, child
    finally:
        parent.stdin.close()
        parent.wait(30)
        parent.stdout.close()


def test_a_group_counts_its_processes_children_unless_alone(sleeping_parent_of_a_spinner):
    parent, child = sleeping_parent_of_a_spinner
    meter = CPUMeter({"tree": [parent], "alone": [parent], "child": [child]},
                     alone=frozenset({"alone"}))
    meter.start()
    spun, deadline = tree_cpu_s(child), time.monotonic() + 60
    while tree_cpu_s(child) - spun < 0.3:  # until the child has spun 0.3 s of CPU
        assert time.monotonic() < deadline, "the spinning child got no CPU for a minute"
        time.sleep(0.05)
    share = meter.stop()
    assert share.wall_s > 0
    assert share.cores["child"] > 0
    # The tree holds the spinning child; the parent alone only slept.
    assert share.cores["tree"] >= share.cores["child"] * 0.9
    assert share.cores["alone"] < share.cores["child"] / 2
    assert share.machine_cores > 0


def test_a_process_that_is_gone_counts_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert tree_cpu_s(proc.pid) == 0.0
    meter = CPUMeter({"gone": [proc.pid]})
    meter.start()
    assert meter.stop().cores == {"gone": 0.0}


def test_machine_busy_time_only_grows():
    a = machine_busy_s()
    b = machine_busy_s()
    assert a is not None and b >= a


def test_pooled_shares_weigh_each_run_by_its_length():
    pooled = CPUShare.pooled([CPUShare(1.0, 2.0, {"router": 0.2}),
                              CPUShare(3.0, 1.0, {"router": 0.6, "client": 0.4}), None])
    assert pooled.wall_s == 4.0
    assert pooled.machine_cores == pytest.approx((2.0 + 3.0) / 4)
    assert pooled.cores == pytest.approx({"router": (0.2 + 1.8) / 4, "client": 1.2 / 4})
    assert CPUShare.pooled([]) is None
    assert CPUShare.pooled([CPUShare(0.0, 1.0, {})]) is None  # nothing measured
