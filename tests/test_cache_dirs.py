"""Where pdserve's per-host caches live (kernels/cache_dirs.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.presets import default_cache_dir
from engine.tokenizer_snapshot import cache_dir as tokenizer_cache_dir
from kernels.cache_dirs import pdserve_cache_dir
from kernels.cpu_build import cache_dir as kernel_cache_dir


def test_its_own_variable_wins_then_xdg_then_the_home_folder():
    home = Path.home()
    assert pdserve_cache_dir("OWN", "kernels", {}) == home / ".cache" / "pdserve" / "kernels"
    assert pdserve_cache_dir("OWN", "kernels", {"XDG_CACHE_HOME": "/var/cache/me"}) \
        == Path("/var/cache/me/pdserve/kernels")
    assert pdserve_cache_dir("OWN", "kernels", {"OWN": "/data/k", "XDG_CACHE_HOME": "/x"}) \
        == Path("/data/k")
    assert pdserve_cache_dir("OWN", "kernels", {"OWN": "~/k"}) == home / "k"
    # Empty means unset; a relative XDG_CACHE_HOME is invalid by the spec and ignored.
    assert pdserve_cache_dir("OWN", "m", {"OWN": "", "XDG_CACHE_HOME": ""}) \
        == home / ".cache" / "pdserve" / "m"
    assert pdserve_cache_dir("OWN", "m", {"XDG_CACHE_HOME": "rel/cache"}) \
        == home / ".cache" / "pdserve" / "m"
    assert pdserve_cache_dir("OWN", "m", {"XDG_CACHE_HOME": "~/xdg"}) == home / "xdg/pdserve/m"


@pytest.mark.parametrize("folder, var, name", [
    (kernel_cache_dir, "PDSERVE_KERNEL_CACHE", "kernels"),
    (default_cache_dir, "PDSERVE_CACHE_DIR", "models"),
    (tokenizer_cache_dir, "PDSERVE_TOKENIZER_CACHE", "tokenizers"),
])
def test_each_cache_reads_its_own_variable(monkeypatch, tmp_path, folder, var, name):
    monkeypatch.setenv(var, "~/" + name + "-here")
    assert folder() == Path.home() / f"{name}-here"
    monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert folder() == tmp_path / "pdserve" / name
