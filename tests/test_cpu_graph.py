"""Model steps through the compiled layer code (engine/cpu_graph.py): the same hidden states as
the Python model, bit for bit, for each model family, for decode-only steps and steps with
prefill chunks (with and without a cached prefix); per-step checks; where it declines."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_graph import CPUModelGraph
from kernels.attention_backend import AttentionMetadata
from kernels.cpu_mkl_linear import mkl_available

pytestmark = pytest.mark.skipif(not mkl_available(), reason="no oneMKL in this torch")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(5, 7000) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _checked_graph(llm: LLM, seen: list[AttentionMetadata]) -> CPUModelGraph:
    """The engine's graph, wrapped to run the Python model on each step too and compare."""
    runner = llm.engine.executor.runner
    graph = runner.graphs
    assert isinstance(graph, CPUModelGraph)
    run = graph.run

    def both(input_ids, positions, meta, bucket):
        # The Python path first: both write the same K/V into the same slots.
        want = runner.model(input_ids, positions, meta).clone()
        got = run(input_ids, positions, meta, bucket)
        assert torch.equal(got, want), (got - want).abs().max()
        seen.append(meta)
        return got

    graph.run = both
    return graph


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("num_prompts", [3, 13])  # the few-rows kernel's rows, and past them
def test_graph_equals_python_model_bit_for_bit(preset, num_prompts, preset_path):
    # A 40-token budget: prompts split into chunks (the later ones over a cached prefix),
    # mixed with decodes in one step.
    llm = LLM(str(preset_path(preset)), linear_backend="mkl", max_num_batched_tokens=40)
    seen: list[AttentionMetadata] = []
    graph = _checked_graph(llm, seen)
    outs = llm.generate(_prompts(num_prompts), _greedy(30))  # long enough to overlap
    assert len(seen) >= 10 and graph.num_replays == len(seen)
    # Decode-only steps past the few-rows kernel's 8 rows when there are prompts for them.
    widest = max(m.num_seqs for m in seen if m.num_decodes == m.num_seqs)
    assert (widest > 8) == (num_prompts > 8)
    kinds = {(m.num_decodes == m.num_seqs, m.num_decodes > 0) for m in seen}
    assert kinds >= {(True, True), (False, True), (False, False)}  # decode, mixed, prefill
    assert any(q < s for m in seen for q, s in zip(m.query_lens_list, m.seq_lens_list)
               if q > 1)  # a chunk over its own cached prefix
    # Varied tokens, or equal states would prove little.
    assert len({t for o in outs for t in o.token_ids}) > 2 * 30


def test_graph_tokens_equal_eager(preset_path):
    path = str(preset_path("tiny-llama"))
    prompts = _prompts(9, seed=3)
    graph_llm = LLM(path, linear_backend="mkl")
    eager = LLM(path, linear_backend="mkl", enforce_eager=True)
    assert eager.engine.executor.runner.graphs is None
    got = [o.token_ids for o in graph_llm.generate(prompts, _greedy(24))]
    assert graph_llm.engine.executor.runner.graphs.num_replays >= 23
    assert got == [o.token_ids for o in eager.generate(prompts, _greedy(24))]


def test_bad_step_inputs_are_refused(preset_path):
    llm = LLM(str(preset_path("tiny-llama")), linear_backend="mkl")
    seen: list[AttentionMetadata] = []
    graph = _checked_graph(llm, seen)
    llm.generate(_prompts(2), _greedy(3))
    meta = seen[-1]
    ids, pos = torch.zeros(meta.num_seqs, dtype=torch.int64), meta.seq_lens.long() - 1
    bad_cases = [
        ({"slot_mapping": meta.slot_mapping.clone().fill_(graph.num_blocks * graph.block_size)},
         "slots must be below"),
        ({"block_tables": meta.block_tables.clone().fill_(graph.num_blocks)}, "block ids"),
        ({"seq_lens": meta.seq_lens.long()}, "seq_lens must be"),
    ]
    for change, match in bad_cases:
        bad = AttentionMetadata(**{**meta.__dict__, **change})
        with pytest.raises(ValueError, match=match):
            CPUModelGraph.run(graph, ids, pos, bad, meta.num_seqs)
    with pytest.raises(ValueError, match="positions must be in"):
        CPUModelGraph.run(graph, ids, pos + 10 ** 7, meta, meta.num_seqs)
    # A prefill step's block ids too (its attention runs in the backend, which trusts the graph).
    first = seen[0]
    assert first.num_decodes == 0
    bad = AttentionMetadata(**{**first.__dict__,
                               "block_tables": first.block_tables.clone().fill_(-1)})
    n = first.slot_mapping.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        CPUModelGraph.run(graph, torch.zeros(n, dtype=torch.int64),
                          torch.arange(n, dtype=torch.int64), bad, n)


def _addresses(struct) -> list[int]:
    """The non-null data addresses a graph struct carries (not the GEMM's function pointer)."""
    out = []
    for name, kind in struct._fields_:
        value = getattr(struct, name)
        if kind is ctypes.c_void_p and name != "gemm" and value:
            out.append(value)
        elif isinstance(value, ctypes.Structure):
            out += _addresses(value)
    return out


def test_every_address_the_graph_carries_is_pinned(preset_path):
    """A re-pack or re-bind after the build must not free memory the C code reads: every
    tensor behind an address in the structs stays referenced by the graph."""
    graph = LLM(str(preset_path("tiny-qwen3")), linear_backend="mkl").engine.executor.runner.graphs
    addrs = _addresses(graph._model_w)
    for layer in graph._layers:
        addrs += _addresses(layer)
    # Per layer: 4 packed weights, 4 norms (qwen3 has q/k norms), K and V caches at least.
    assert len(addrs) >= 2 + 10 * len(graph._layers)
    assert set(addrs) <= {t.data_ptr() for t in graph._pinned}


def test_declines_what_it_does_not_reproduce(preset_path):
    path = str(preset_path("tiny-llama"))
    assert LLM(path, linear_backend="torch").engine.executor.runner.graphs is None
    assert LLM(path, linear_backend="mkl", enforce_eager=True).engine.executor.runner.graphs \
        is None
    llm = LLM(path, linear_backend="mkl", attention_backend="torch")
    assert llm.engine.executor.runner.graphs is None
    # The C graph takes one eps for every norm.
    model = LLM(path, linear_backend="mkl").engine.executor.runner.model
    assert CPUModelGraph.build(model) is not None
    model.model.layers[1].post_attention_layernorm.eps *= 2
    assert CPUModelGraph.build(model) is None


def test_layer_pre_hooks_run_between_layers(preset_path):
    """A decoder layer's forward pre-hooks (the core share's give-back) still run before
    every layer, and the states stay bit for bit the Python path's."""
    llm = LLM(str(preset_path("tiny-qwen3")), linear_backend="mkl")
    layers = llm.engine.decoder_layers()
    calls: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda m, args, i=i: calls.append(i))
               for i, layer in enumerate(layers)]
    seen: list[AttentionMetadata] = []
    _checked_graph(llm, seen)  # the Python path runs too: its hooks fire once per layer as well
    llm.generate(_prompts(4, seed=5), _greedy(6))
    for h in handles:
        h.remove()
    steps = len(seen)
    assert steps >= 5
    # Each decode step: once from the Python model, once from the graph, in layer order.
    per_layer = {i: calls.count(i) for i in range(len(layers))}
    assert set(per_layer.values()) == {per_layer[0]} and per_layer[0] >= 2 * steps
