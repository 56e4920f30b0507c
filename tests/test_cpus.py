"""The CPUs a process may use (engine/cpus.py), what the launcher, the core share and TP ranks
size their threads from: its affinity (taskset, a container's cpuset) and its cgroup's CPU
quota, not the host's CPUs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import cpus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to 1")
def test_threads_follow_the_cpus_the_process_may_run_on():
    # As under `taskset -c N pdserve up`: pinned to one of the host's CPUs.
    code = """
import os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from engine.config import EngineConfig
from engine.cpus import usable_cpus
from engine.tp_worker import worker_threads
from engine.worker_runtime import WorkerConfig
from router.launcher import ClusterSpec
cfg = WorkerConfig(engine=EngineConfig("tiny-llama", role="prefill", kv_transfer_backend="nixl"),
                   core_share_path="/tmp/unused")
print(usable_cpus(), ClusterSpec(num_prefill=0).worker_env()["OMP_NUM_THREADS"],
      cfg.shared_cores, cfg.engine_config().max_cpu_threads, worker_threads(1))
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # The launcher's OMP_NUM_THREADS for a lone worker, the core share's cores, the engine's
    # packed-weight threads and a TP rank's threads: 1 each, not the host's CPUs.
    assert r.stdout.split() == ["1"] * 5


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """A cgroup v2 tree of this process's: /a/b, under tmp_path; 8 CPUs in its affinity."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    proc_cgroup = tmp_path / "proc-self-cgroup"
    proc_cgroup.write_text("0::/a/b\n")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(cpus, "PROC_CGROUP", str(proc_cgroup))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    return tmp_path


def test_a_cgroup_cpu_quota_caps_the_cpus(cgroup):
    assert cpus.usable_cpus() == 8  # no cpu.max anywhere
    (cgroup / "a" / "b" / "cpu.max").write_text("max 100000\n")  # no quota
    assert cpus.usable_cpus() == 8
    (cgroup / "a" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 threads
    assert cpus.usable_cpus() == 2  # a parent's quota binds its children
    (cgroup / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cpus.cgroup_cpu_limit() == 1 and cpus.usable_cpus() == 1
    (cgroup / "a" / "b" / "cpu.max").write_text("3200000 100000\n")  # 32: above the affinity
    (cgroup / "cpu.max").unlink()
    (cgroup / "a" / "cpu.max").write_text("junk\n")  # what does not parse counts as no quota
    assert cpus.usable_cpus() == 8


def test_without_cgroup_v2_or_affinity_the_host_s_cpus_count(cgroup, monkeypatch):
    (cgroup / "cpu.max").write_text("100000 100000\n")
    (cgroup / "proc-self-cgroup").write_text("4:memory:/x\n1:cpu:/\n")  # cgroup v1 only
    assert cpus.cgroup_cpu_limit() is None and cpus.usable_cpus() == 8
    monkeypatch.setattr(cpus, "PROC_CGROUP", str(cgroup / "missing"))
    assert cpus.usable_cpus() == 8
    monkeypatch.delattr(os, "sched_getaffinity")  # not on every platform
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert cpus.usable_cpus() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpus.usable_cpus() == 1
