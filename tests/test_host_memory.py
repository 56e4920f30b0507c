"""The memory a CPU rank's KV cache may take (engine/host_memory.py): the host's MemAvailable,
or in a container its cgroup's headroom where that is less. A worker in a container held to
a few GiB saw the host's free memory, mapped a cache the cgroup could not hold and was ended by
its OOM killer as the cache was zeroed. The /proc and /sys read are fakes under tmp_path."""
from __future__ import annotations

import re

import pytest
import torch

from engine import host_memory, setup
from engine.config import EngineConfig
from engine.host_memory import AvailableMemory, available_memory

MIB, GIB = 1 << 20, 1 << 30
# What cgroup v1 writes for "no limit": 2**63 rounded down to a page.
V1_UNLIMITED = "9223372036854771712"


def write(root, path: str, text: str) -> None:
    f = root / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)


@pytest.fixture
def root(tmp_path):
    """A host with 8 GiB available, this process in cgroup /a/b of a v2 hierarchy."""
    write(tmp_path, "proc/meminfo", "MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    write(tmp_path, "proc/self/cgroup", "0::/a/b\n")
    (tmp_path / "sys/fs/cgroup/a/b").mkdir(parents=True)
    return tmp_path


def test_a_cgroup_v2_limit_below_the_hosts_memory_bounds_it(root):
    cg = root / "sys/fs/cgroup/a/b"
    write(root, "sys/fs/cgroup/a/b/memory.max", f"{2 * GIB}\n")
    write(root, "sys/fs/cgroup/a/b/memory.current", f"{512 * MIB}\n")
    # The page cache it may drop first (a checkpoint just read) is not in use.
    write(root, "sys/fs/cgroup/a/b/memory.stat", f"anon 1000\ninactive_file {256 * MIB}\n")
    assert available_memory(str(root)) == AvailableMemory(
        2 * GIB - 256 * MIB, str(cg / "memory.max"), 2 * GIB)
    # A parent's limit binds its children too, here more tightly.
    write(root, "sys/fs/cgroup/a/memory.max", f"{GIB}\n")
    write(root, "sys/fs/cgroup/a/memory.current", f"{900 * MIB}\n")
    assert available_memory(str(root)) == AvailableMemory(
        124 * MIB, str(root / "sys/fs/cgroup/a/memory.max"), GIB)


def test_cgroup_v2_max_and_a_limit_above_the_host_leave_memavailable(root):
    write(root, "sys/fs/cgroup/a/b/memory.max", "max\n")
    write(root, "sys/fs/cgroup/a/b/memory.current", f"{512 * MIB}\n")
    write(root, "sys/fs/cgroup/a/memory.max", f"{64 * GIB}\n")
    write(root, "sys/fs/cgroup/a/memory.current", f"{GIB}\n")
    assert available_memory(str(root)) == AvailableMemory(8 * GIB)


def test_a_cgroup_v1_memory_limit_bounds_it(root):
    write(root, "proc/self/cgroup", "5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    v1 = root / "sys/fs/cgroup/memory/docker/c1"
    write(root, "sys/fs/cgroup/memory/docker/c1/memory.limit_in_bytes", f"{3 * GIB}\n")
    write(root, "sys/fs/cgroup/memory/docker/c1/memory.usage_in_bytes", f"{GIB}\n")
    write(root, "sys/fs/cgroup/memory/docker/c1/memory.stat",
          f"inactive_file 1\ntotal_inactive_file {GIB}\n")  # hierarchical: the total counts
    write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", V1_UNLIMITED + "\n")
    write(root, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{4 * GIB}\n")
    assert available_memory(str(root)) == AvailableMemory(
        3 * GIB, str(v1 / "memory.limit_in_bytes"), 3 * GIB)


def test_an_unlimited_cgroup_v1_leaves_memavailable(root):
    write(root, "proc/self/cgroup", "4:memory:/docker/c1\n")
    write(root, "sys/fs/cgroup/memory/docker/c1/memory.limit_in_bytes", V1_UNLIMITED)
    write(root, "sys/fs/cgroup/memory/docker/c1/memory.usage_in_bytes", f"{GIB}")
    assert available_memory(str(root)) == AvailableMemory(8 * GIB)


def test_a_cgroup_path_the_mount_lacks_falls_back_to_the_mounts_own_limit(root):
    # A container without a cgroup namespace of its own: /proc/self/cgroup names the host's
    # path, while the mount is the container's cgroup.
    write(root, "proc/self/cgroup", "4:memory:/docker/c1\n")
    write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{GIB}")
    write(root, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{256 * MIB}")
    assert available_memory(str(root)).nbytes == 768 * MIB


def test_missing_files_leave_what_is_known(root):
    # A limit without its usage is no headroom anyone can tell.
    write(root, "sys/fs/cgroup/a/b/memory.max", f"{GIB}")
    assert available_memory(str(root)) == AvailableMemory(8 * GIB)
    # No /proc/self/cgroup: the mount's own limit still counts.
    (root / "proc/self/cgroup").unlink()
    write(root, "sys/fs/cgroup/memory.max", f"{2 * GIB}")
    write(root, "sys/fs/cgroup/memory.current", f"{GIB}")
    assert available_memory(str(root)).nbytes == GIB
    # No /proc/meminfo either: the cgroup's headroom alone.
    (root / "proc/meminfo").unlink()
    assert available_memory(str(root)).nbytes == GIB
    (root / "sys/fs/cgroup/memory.max").unlink()
    assert available_memory(str(root)) is None


def test_a_kv_cache_over_the_cgroups_headroom_is_refused_naming_it(root, monkeypatch):
    monkeypatch.setattr(setup, "available_memory",
                        lambda: host_memory.available_memory(str(root)))
    config = EngineConfig(model="micro-llama", kv_cache_memory_gib=1.5)
    cpu = torch.device("cpu")
    assert setup.kv_capacity_blocks(config, MIB, cpu) == 1536  # 8 GiB on the host
    write(root, "sys/fs/cgroup/a/memory.max", f"{2 * GIB}\n")
    write(root, "sys/fs/cgroup/a/memory.current", f"{GIB}\n")
    limit = root / "sys/fs/cgroup/a/memory.max"
    with pytest.raises(ValueError, match=(
            r"--kv-cache-memory-gib 1.5 asks for a KV cache of 1.50 GiB, but this process's "
            rf"cgroup memory limit \({re.escape(str(limit))}: 2.00 GiB\) leaves only 1.00 GiB "
            "available")):
        setup.kv_capacity_blocks(config, MIB, cpu)


def test_a_cgroup_whose_name_holds_braces_is_named_as_it_is(tmp_path, monkeypatch):
    """A cgroup's name is its creator's (cgroupfs takes braces): the refusal's message was a
    format string with the limit file's path in it, which raised IndexError instead."""
    write(tmp_path, "proc/meminfo", "MemAvailable: 8388608 kB\n")
    write(tmp_path, "proc/self/cgroup", "0::/job{1}\n")
    write(tmp_path, "sys/fs/cgroup/job{1}/memory.max", f"{GIB}\n")
    write(tmp_path, "sys/fs/cgroup/job{1}/memory.current", f"{768 * MIB}\n")
    monkeypatch.setattr(setup, "available_memory",
                        lambda: host_memory.available_memory(str(tmp_path)))
    limit = tmp_path / "sys/fs/cgroup/job{1}/memory.max"
    with pytest.raises(ValueError, match=(
            rf"limit \({re.escape(str(limit))}: 1.00 GiB\) leaves only 256.00 MiB available")):
        setup.kv_capacity_blocks(EngineConfig(model="micro-llama", kv_cache_memory_gib=0.5),
                                 MIB, torch.device("cpu"))
