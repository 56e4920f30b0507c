"""Builds the C kernels in ``kernels/csrc`` with the system C compiler on first use, and loads them.

No build step at install time: the shared object is compiled for this very CPU
(``-march=native``) into a cache folder keyed by the source, the compiler, the flags and the
CPU, so a later process loads it at once. The build writes a temporary file and renames it,
so processes that start together (TP ranks, parallel tests) never load a half-written library.
Where no compiler works the loader returns None and callers use the plain-torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kernels.cache_dirs import pdserve_cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_loaded: dict[str, ctypes.CDLL | None] = {}
_INCLUDE_C = re.compile(r'^#include "([\w.]+\.c)"', re.MULTILINE)
_lock = threading.Lock()


def cache_dir() -> Path:
    """$PDSERVE_KERNEL_CACHE, else the kernels folder of pdserve's cache (kernels/cache_dirs.py)."""
    return pdserve_cache_dir("PDSERVE_KERNEL_CACHE", "kernels")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# The /proc/cpuinfo fields that decide what ``-march=native`` emits (x86 and Arm spellings).
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "flags", "CPU implementer", "CPU part",
               "Features")


@functools.cache
def cpu_identity() -> bytes:
    """This CPU's model and instruction-set flags. Part of the cache key: a library built
    with ``-march=native`` on another CPU (a home folder shared between hosts, a container
    image moved) may hold instructions this one lacks, and would die of SIGILL, not fall back."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return (platform.machine() + platform.processor()).encode()
    return "\n".join(line for line in first.splitlines()
                     if line.split(":", 1)[0].strip() in _CPU_FIELDS).encode()


def load_kernel(name: str) -> ctypes.CDLL | None:
    """A compute kernel library: None when ``PDSERVE_DISABLE_CPU_KERNELS=1`` forces the
    plain-torch paths."""
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    return load_library(name)


def load_library(name: str, flags: tuple[str, ...] = FLAGS,
                 global_symbols: bool = False) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` compiled with ``flags`` and loaded (once per process); None if it
    cannot be built. ``global_symbols`` puts its symbols in the process's global scope
    (RTLD_GLOBAL), where they take precedence over libraries loaded later."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name, flags, global_symbols)
        return _loaded[name]


def _build_and_load(name: str, flags: tuple[str, ...],
                    global_symbols: bool) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: %s is not built (plain-torch paths instead)", name)
        return None
    source = CSRC / f"{name}.c"
    mode = ctypes.RTLD_GLOBAL if global_symbols else ctypes.DEFAULT_MODE
    try:
        target = cache_dir() / f"{name}-{cache_key(cc, source, flags)}.so"
        if not target.exists():
            _compile(cc, source, target, flags)
            return ctypes.CDLL(str(target), mode=mode)
        try:
            return ctypes.CDLL(str(target), mode=mode)
        except OSError as e:
            # A cached library that does not load (truncated by a full disk, damaged by hand)
            # would otherwise pin this host to the torch path until someone deletes it.
            logger.warning("cached %s does not load (%s): building it again", target, e)
            target.unlink(missing_ok=True)
            _compile(cc, source, target, flags)
            return ctypes.CDLL(str(target), mode=mode)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not build %s (%s): using the plain-torch path", name, e)
        return None


def cache_key(cc: str, source: Path, flags: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    # The headers it may include count too: a changed header must rebuild every kernel. So do
    # the other sources it includes (the decode graph compiles the kernels it chains).
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    included = b"".join((source.parent / name).read_bytes()
                        for name in _INCLUDE_C.findall(source.read_text()))
    return hashlib.sha256(source.read_bytes() + headers + included + version.encode()
                          + " ".join(flags).encode() + cpu_identity()).hexdigest()[:16]


def _compile(cc: str, source: Path, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
