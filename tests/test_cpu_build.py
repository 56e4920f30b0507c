"""The C kernels' build: cache keyed by the CPU, vectors as wide as the CPU's registers."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kernels import cpu_build
from kernels.cpu_build import CSRC, cache_key, compiler, cpu_identity

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")


def test_cache_key_changes_with_the_cpu(monkeypatch):
    source = CSRC / "fused_ops_cpu.c"
    here = cache_key(compiler(), source, cpu_build.FLAGS)
    assert cache_key(compiler(), source, cpu_build.FLAGS) == here
    monkeypatch.setattr(cpu_build, "cpu_identity", lambda: b"vendor_id: other\nflags: sse2")
    assert cache_key(compiler(), source, cpu_build.FLAGS) != here


def _cpu_flags() -> set[str]:
    for line in cpu_identity().decode().splitlines():
        if line.split(":", 1)[0].strip() == "flags":
            return set(line.split(":", 1)[1].split())
    pytest.skip("no x86 flags line in /proc/cpuinfo")


def test_vector_width_matches_the_registers(tmp_path: Path):
    # Wider vectors than the registers were split by GCC with per-lane conversions: the
    # kernels ran 3x slower than torch on an AVX2-only CPU.
    flags = _cpu_flags()
    probe = tmp_path / "probe.c"
    probe.write_text('#include <stdio.h>\n#include "cpu_math.h"\n'
                     'int main(void) { printf("%d\\n", VEC_WIDTH); return 0; }\n')
    exe = tmp_path / "probe"
    subprocess.run([compiler(), "-O1", "-march=native", f"-I{CSRC}", str(probe), "-o", str(exe)],
                   check=True, capture_output=True, timeout=120)
    width = int(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
    assert width == (16 if "avx512f" in flags else 8 if "avx" in flags else 4)


@pytest.mark.parametrize("source", sorted(CSRC.glob("*.c")), ids=lambda p: p.stem)
def test_every_kernel_compiles(source: Path, tmp_path: Path):
    # Where a kernel fails to build the engine quietly takes the plain-torch path, and the
    # kernel's own tests skip: a compile error has to fail here.
    cpu_build._compile(compiler(), source, tmp_path / f"{source.stem}.so", cpu_build.FLAGS)
    assert (tmp_path / f"{source.stem}.so").stat().st_size > 0


def test_a_damaged_cached_library_is_built_again(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    name = "kv_write_cpu"
    target = tmp_path / f"{name}-{cache_key(compiler(), CSRC / f'{name}.c', cpu_build.FLAGS)}.so"
    target.write_bytes(b"\x7fELF truncated")  # what a full disk may leave behind
    lib = cpu_build._build_and_load(name, cpu_build.FLAGS, global_symbols=False)
    assert lib is not None and target.stat().st_size > 1000
    assert cpu_build._build_and_load(name, cpu_build.FLAGS, global_symbols=False) is not None
