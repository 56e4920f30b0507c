"""A stopped engine gives its memory back (``ModelRunner.release``, which the executors call on
a GPU at shutdown): the storages are emptied, so references a caller still holds (a layer, a
view of the cache) keep no memory. The GPU side is tests/test_gpu_parity.py's."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import model_runner


@pytest.fixture
def torch_allocated_cache(monkeypatch):
    # The CPU cache lives in huge pages, which release leaves to the OS (it is freed when the
    # engine is dropped); a torch-allocated cache stands in for the GPU's.
    monkeypatch.setattr(model_runner, "huge_page_zeros",
                        lambda shape, dtype: torch.zeros(shape, dtype=dtype))


def test_release_empties_the_storages_a_caller_still_holds(torch_allocated_cache):
    with LLM("tiny-llama", num_gpu_blocks=16) as llm:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
        runner = llm.engine.executor.runner
        layer = llm.engine.decoder_layers()[0]
        kv = runner.kv_cache
    # On the CPU, shutdown leaves the runner to the garbage collector.
    assert runner.model is not None and kv.untyped_storage().nbytes() > 0
    runner.release()
    assert runner.model is None and runner.kv_cache is None and runner.graphs is None
    assert kv.untyped_storage().nbytes() == 0
    params = list(layer.parameters())
    assert params and all(p.untyped_storage().nbytes() == 0 for p in params)
    runner.release()  # idempotent
