"""oneMKL's vector math (VML) is warmed up at engine start, one element per function on one
thread, so that no op split over threads is a VML function's first call (kernels/mkl_vml.py).

The race itself is too rare to trigger in a test: these check that the warm-up covers every
VML function torch links and every VML op the sampler runs, and that engine start calls it."""
from __future__ import annotations

import ctypes
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.penalties import PenaltyState
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kernels.mkl_vml import VML_DTYPES, VML_OPS, warm_up_vml

# Float unary ops ATen's vml.h could hand to oneMKL, with oneMKL's name for each.
_CANDIDATES = {
    "abs": "Abs", "acos": "Acos", "acosh": "Acosh", "asin": "Asin", "asinh": "Asinh",
    "atan": "Atan", "atanh": "Atanh", "ceil": "Ceil", "cos": "Cos", "cosh": "Cosh",
    "erf": "Erf", "erfc": "Erfc", "erfinv": "ErfInv", "exp": "Exp", "exp2": "Exp2",
    "expm1": "Expm1", "floor": "Floor", "lgamma": "LGamma", "log": "Ln", "log10": "Log10",
    "log1p": "Log1p", "log2": "Log2", "reciprocal": "Inv", "round": "Round",
    "rsqrt": "InvSqrt", "sin": "Sin", "sinh": "Sinh", "sqrt": "Sqrt", "tan": "Tan",
    "tanh": "Tanh", "trunc": "Trunc",
}
_MKL = torch.backends.mkl.is_available()


def _linked(symbol: str) -> bool:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    return hasattr(lib, symbol)


@pytest.mark.skipif(not _MKL, reason="torch built without oneMKL")
def test_the_warm_up_covers_every_vml_function_torch_links():
    linked = {op for op, name in _CANDIDATES.items()
              if _linked(f"vms{name}") or _linked(f"vmd{name}")}
    assert "log" in linked  # the symbols are visible: the check below means something
    # Another torch build may link fewer: warming up an op that is not VML costs nothing.
    assert linked <= set(VML_OPS), linked - set(VML_OPS)
    assert set(VML_DTYPES) == {torch.float32, torch.float64}  # vms* and vmd*


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__.rstrip("_"))
        return func(*args, **(kwargs or {}))


def test_every_vml_op_the_sampler_runs_is_warmed_up():
    vocab = 8192  # rows of it split over threads: ATen splits these ops from 2048 elements
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.3),
              SamplingParams(temperature=1.0, seed=7, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=2)]
    states = [None, PenaltyState.for_prompt([1, 2, 3], vocab, torch.device("cpu")), None, None]
    generators = [None, None, torch.Generator().manual_seed(7), None]
    with _Ops() as ops:
        Sampler()(logits, params, generators, states)
    used = ops.names & set(_CANDIDATES)
    assert "log" in used  # the Gumbel noise
    assert used <= set(VML_OPS)


def test_engine_start_warms_up_vml_before_it_builds_the_model(monkeypatch):
    import engine.setup
    from engine import LLM

    events = []

    def warm_up() -> None:
        events.append("warm-up")
        warm_up_vml()

    real_load = engine.setup.load_model

    def load_model(*args, **kwargs):
        events.append("load")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine.setup, "warm_up_vml", warm_up, raising=False)
    monkeypatch.setattr(engine.setup, "load_model", load_model)
    with LLM("tiny-llama", num_gpu_blocks=64):
        pass
    assert events == ["warm-up", "load"]
