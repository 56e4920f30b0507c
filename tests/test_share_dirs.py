"""The launchers' core-share folders (router/share_dirs.py): gone with their cluster, with a
program that never stopped its cluster, and, after a launcher was killed, with the next
launcher's sweep, but never while a worker still uses one. The killed-launcher case on a real
cluster is in test_launcher_stop.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.core_share import CoreShare, CoreShareConfig
from router import share_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(root, maker: int, with_file: bool = True) -> str:
    path = root / f"{share_dirs.PREFIX}{maker}-{len(os.listdir(root))}"
    path.mkdir(mode=0o700)
    if with_file:
        (path / share_dirs.SHARE_FILE).write_bytes(b"")
    return str(path)


def test_a_sweep_removes_only_what_a_dead_launcher_left_unused(tmp_path):
    dead = _dead_pid()
    abandoned = _folder(tmp_path, dead)
    empty = _folder(tmp_path, dead, with_file=False)  # killed before its first worker
    live_maker = _folder(tmp_path, os.getpid())
    in_use = _folder(tmp_path, dead)
    worker = CoreShare(CoreShareConfig(os.path.join(in_use, share_dirs.SHARE_FILE),
                                       num_cores=2, base_threads=1))  # holds its slot's lock
    unnamed = tmp_path / f"{share_dirs.PREFIX}x7k2"  # the old naming: no maker to ask about
    unnamed.mkdir()
    a_file = tmp_path / f"{share_dirs.PREFIX}{dead}-file"
    a_file.write_text("")
    a_link = tmp_path / f"{share_dirs.PREFIX}{dead}-link"
    a_link.symlink_to(tmp_path)
    try:
        assert sorted(share_dirs.sweep(str(tmp_path))) == sorted([abandoned, empty])
        for kept in (live_maker, in_use, unnamed, a_file, a_link):
            assert os.path.lexists(kept), kept
    finally:
        worker.close()
    assert share_dirs.sweep(str(tmp_path)) == [in_use]  # its last worker is gone


def test_a_share_file_someone_else_controls_counts_as_in_use(tmp_path):
    folder = _folder(tmp_path, _dead_pid(), with_file=False)
    os.symlink("/etc/hostname", os.path.join(folder, share_dirs.SHARE_FILE))  # O_NOFOLLOW
    assert share_dirs.sweep(str(tmp_path)) == []


def test_a_cluster_s_folder_names_its_maker_and_goes_with_its_stop():
    path = share_dirs.make()
    try:
        assert os.path.basename(path).startswith(f"{share_dirs.PREFIX}{os.getpid()}-")
        assert share_dirs.LIVE[path] == os.getpid()
        assert path not in share_dirs.sweep(os.path.dirname(path))  # its maker lives
    finally:
        share_dirs.remove(path)
    assert not os.path.exists(path) and path not in share_dirs.LIVE


_UNSTOPPED = """
import os, sys
from router.launcher import Cluster, ClusterSpec
cluster = Cluster(ClusterSpec(redis_url="redis://127.0.0.1:1"))
cluster._spawn = lambda name, args, env=None: None  # no services: only the folder matters
cluster.add_worker("decode", wait=False)
print(cluster._share_dir, flush=True)
if os.fork() == 0:
    sys.exit(0)  # a child's normal exit runs its parent's atexit hooks too: they must not remove
os.wait()
print(os.path.isdir(cluster._share_dir), flush=True)
"""


def test_a_program_that_never_stops_its_cluster_leaves_no_share_folder():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # else no share
    out = subprocess.run([sys.executable, "-c", _UNSTOPPED], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    share_dir, alive_after_child = out
    assert alive_after_child == "True"  # the forked child left it to its maker
    assert not os.path.exists(share_dir)  # the maker's exit removed it


@pytest.mark.parametrize("maker", ["0", "12ab", ""])
def test_names_no_launcher_makes_are_left(tmp_path, maker):
    path = tmp_path / f"{share_dirs.PREFIX}{maker}-x"
    path.mkdir()
    assert share_dirs.sweep(str(tmp_path)) == [] and path.is_dir()
