"""oneMKL's vendor query answered by our shim (checked in fresh processes: the shim works only
when it is loaded before torch, once per process)."""
import os
import platform
import subprocess
import sys

import pytest

from kernels.mkl_vendor import cpu_vendor

_PROBE = r"""
import ctypes, sys
FIRST
from kernels.mkl_vendor import enable_mkl_cpu_dispatch
import torch, torch.nn.functional as F
d = enable_mkl_cpu_dispatch()
try:
    answer = ctypes.CDLL(None).mkl_serv_intel_cpu_true()
except AttributeError:  # nothing in the global scope answers: oneMKL asks its own copy
    answer = -1
# Whatever path oneMKL takes must compute the same thing: sgemm and flash SDPA vs float64.
g = torch.Generator().manual_seed(0)
x, w = torch.randn(37, 300, generator=g), torch.randn(129, 300, generator=g)
lin = (F.linear(x, w).double() - x.double() @ w.double().T).abs().max().item()
q, k, v = (torch.randn(1, 4, 70, 64, generator=g) for _ in range(3))
ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
att = (F.scaled_dot_product_attention(q, k, v, is_causal=True).double() - ref).abs().max().item()
print(int(d.applied), answer, lin, att, d.reason)
"""

_X86_NON_INTEL = (sys.platform.startswith("linux") and platform.machine() == "x86_64"
                  and cpu_vendor() not in ("GenuineIntel", ""))


def _probe(first: str = "", env_value: str | None = None) -> tuple[bool, int, str]:
    env = dict(os.environ)
    env.pop("PDSERVE_MKL_VENDOR_SHIM", None)
    if env_value is not None:
        env["PDSERVE_MKL_VENDOR_SHIM"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE.replace("FIRST", first)], env=env,
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=4)
    # Both paths must agree with float64 to float32 accuracy.
    assert float(out[2]) < 1e-3 and float(out[3]) < 1e-4, out
    return out[0] == "1", int(out[1]), out[4] if len(out) > 4 else ""


@pytest.mark.skipif(not _X86_NON_INTEL, reason="oneMKL's vendor check matters on non-Intel x86")
def test_engine_import_answers_the_vendor_query_before_torch_loads():
    applied, answer, reason = _probe("import engine")
    assert applied, reason
    assert answer == 1


@pytest.mark.skipif(not _X86_NON_INTEL, reason="oneMKL's vendor check matters on non-Intel x86")
def test_the_shim_can_be_turned_off():
    applied, answer, reason = _probe("import engine", env_value="0")
    assert not applied and "PDSERVE_MKL_VENDOR_SHIM=0" in reason
    assert answer == -1


@pytest.mark.skipif(not _X86_NON_INTEL, reason="oneMKL's vendor check matters on non-Intel x86")
def test_torch_imported_first_is_reported_not_half_applied():
    applied, answer, reason = _probe("import torch")
    assert not applied and "torch was imported first" in reason
    assert answer == -1


@pytest.mark.skipif(_X86_NON_INTEL, reason="checks the no-op on other CPUs")
def test_elsewhere_nothing_is_loaded():
    applied, _, reason = _probe("import engine")
    assert not applied and reason
