"""A stopped engine gives its memory back (``ModelRunner.release``, which the executors call on
a GPU at shutdown): the storages are emptied, so references a caller still holds (a layer, a
view of the cache) keep no memory. The GPU side is tests/test_gpu_parity.py's."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import model_runner
from engine.layers import linear


@pytest.fixture
def torch_allocated_memory(monkeypatch):
    # On the CPU the cache lives in huge pages, and so do the weights the few-rows kernel reads
    # (when the linear-kernel timing picks it), which release leaves to the OS (they are freed
    # when the engine is dropped); torch-allocated ones stand in for the GPU's.
    monkeypatch.setattr(model_runner, "huge_page_zeros",
                        lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(linear, "to_huge_pages", lambda t: t)


def test_release_empties_the_storages_a_caller_still_holds(torch_allocated_memory):
    # oneDNN with the few-rows kernel: the weights go to huge pages whatever the timing says.
    with LLM("tiny-llama", num_gpu_blocks=16, linear_backend="onednn") as llm:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
        runner = llm.engine.executor.runner
        layer = llm.engine.decoder_layers()[0]
        kv = runner.kv_cache
    # On the CPU, shutdown leaves the runner to the garbage collector.
    assert runner.model is not None and kv.untyped_storage().nbytes() > 0
    runner.release()
    assert runner.model is None and runner.kv_cache is None and runner.graphs is None
    assert kv.untyped_storage().nbytes() == 0
    # Sizes, not the tensors: a failing assert's message would print an emptied tensor,
    # which reads memory it no longer has.
    sizes = {name: p.untyped_storage().nbytes() for name, p in layer.named_parameters()}
    assert sizes and set(sizes.values()) == {0}, sizes
    runner.release()  # idempotent
