"""The host allocator keeps freed activation memory for reuse (checked in fresh processes:
the setting is process-wide)."""
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, sys, torch
from kernels.host_malloc import tune_host_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
t = tune_host_malloc()
before = libc.mallinfo2().hblkhd
x = torch.empty(100 << 18)  # 100 MiB of float32
mapped = libc.mallinfo2().hblkhd - before
del x
print(int(t.applied), mapped >> 20, t.reason)
"""


def _probe(env_value: str | None) -> tuple[bool, int, str]:
    env = dict(os.environ)
    env.pop("PDSERVE_HOST_MALLOC_TUNING", None)
    if env_value is not None:
        env["PDSERVE_HOST_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout.split(maxsplit=2)
    return out[0] == "1", int(out[1]), out[2] if len(out) > 2 else ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tuned_process_serves_a_100_mib_tensor_from_the_heap():
    applied, mapped_mib, _ = _probe(None)
    assert applied
    assert mapped_mib == 0  # reused heap, not a fresh mapping that faults page by page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_opting_out_leaves_glibc_mapping_large_tensors():
    applied, mapped_mib, reason = _probe("0")
    assert not applied and "PDSERVE_HOST_MALLOC_TUNING" in reason
    assert mapped_mib >= 100
