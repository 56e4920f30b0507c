"""Decode CUDA graphs: buckets, which steps qualify, and the padded static-buffer path.

On CPU the graph runner runs with ``capture=False``: the same padding, static buffers and
bucket metadata, without the capture. Those tests check that padding never changes a token or
writes the cache; the ``gpu`` tests check capture and replay against eager on a real GPU.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graph import CUDAGraphConfig, DecodeGraphRunner
from engine.model_runner import prepare_input
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kernels.input_checks import DEBUG_ENV

# Requests finish at different steps, so decode batches shrink through every bucket.
MAX_TOKENS = [12, 4, 9, 12, 6, 2, 10]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]


def test_buckets_cover_every_batch_size():
    assert CUDAGraphConfig(20, 4, 16).batch_sizes == [1, 2, 4, 8, 16, 20]
    assert CUDAGraphConfig(1, 4, 16).batch_sizes == [1]
    assert CUDAGraphConfig(32, 4, 16).batch_sizes == [1, 2, 4, 8, 16, 24, 32]
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="max_batch_size"):
            CUDAGraphConfig(bad, 4, 16)


@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens,largest", [
    (256, 64, 64), (16, 2048, 16), (1024, 4096, 512)])
def test_graphs_are_captured_only_for_batches_a_step_can_form(preset_path, max_num_seqs,
                                                              max_num_batched_tokens, largest):
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.setup import RankSpec, cuda_graph_config

    config = EngineConfig(model="tiny-llama", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    path = preset_path("tiny-llama")
    # Only the spec's device is read: no GPU is needed to derive what would be captured.
    spec = RankSpec(config, str(path), "bfloat16", "cuda:0")
    graphs = cuda_graph_config(spec, ModelConfig.from_pretrained(path), num_blocks=1024)
    assert graphs.max_batch_size == largest == graphs.batch_sizes[-1]


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphRunner(torch.nn.Identity(), CUDAGraphConfig(2, 2, 16), torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randint(5, 7000) for _ in range(n)] for n in (3, 17, 31, 32, 33, 50, 64)]


@pytest.fixture(scope="module")
def expected(prompts):
    with LLM("tiny-llama", enforce_eager=True, num_gpu_blocks=512) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, _params())]
    assert len({t for o in outs for t in o}) > 15, "greedy outputs are too repetitive to compare"
    return outs


def _padded_llm(max_batch_size: int, max_blocks: int) -> LLM:
    llm = LLM("tiny-llama", num_gpu_blocks=512)
    llm.engine.executor.runner.graphs = _uncaptured(llm, max_batch_size, max_blocks)
    return llm


@pytest.mark.parametrize("max_batch_size,max_blocks", [(8, 8), (5, 8), (3, 5)])
def test_padded_decode_matches_eager(prompts, expected, max_batch_size, max_blocks):
    """Bigger batches and longer contexts than the graphs cover fall back to eager steps."""
    with _padded_llm(max_batch_size, max_blocks) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params())]
        graphs = llm.engine.executor.runner.graphs
        assert graphs.num_replays > 0
        s = llm.engine.get_stats()
        assert s.num_free_blocks == s.num_total_blocks
    assert got == expected


def _decode_step(block_size: int, lens: list[int], first_block: int) -> SchedulerOutput:
    sched = SchedulerOutput()
    for i, n in enumerate(lens):
        req = Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4))
        req.num_computed_tokens = n - 1
        blocks = list(range(first_block + 8 * i, first_block + 8 * i + -(-n // block_size)))
        sched.scheduled.append(ScheduledRequest(req, 1, blocks))
    return sched


@pytest.fixture(scope="module")
def small_llm():
    with LLM("tiny-llama", num_gpu_blocks=64) as llm:
        yield llm


def _uncaptured(llm: LLM, max_batch_size: int, max_blocks: int) -> DecodeGraphRunner:
    runner = llm.engine.executor.runner
    return DecodeGraphRunner(runner.model, CUDAGraphConfig(max_batch_size, max_blocks,
                                                           llm.engine.block_size),
                             runner.device, capture=False)


def test_padding_rows_write_nothing_into_the_cache(small_llm):
    runner, bs = small_llm.engine.executor.runner, small_llm.engine.block_size
    graphs = _uncaptured(small_llm, 8, 4)
    inp = prepare_input(_decode_step(bs, [5, 20, 40], first_block=1), bs, runner.device)
    assert graphs.bucket_for(inp.meta) == 4
    runner.kv_cache.zero_()
    graphs.run(inp.input_ids, inp.positions, inp.meta, 4)
    # [num_blocks, block_size] tokens: only the three real slots changed.
    touched = runner.kv_cache.abs().sum(dim=(1, 2, 4, 5))
    written = touched.flatten().nonzero().flatten().tolist()
    assert written == sorted(inp.meta.slot_mapping.tolist())


def test_only_pure_decode_steps_qualify(small_llm):
    runner, bs = small_llm.engine.executor.runner, small_llm.engine.block_size
    graphs = _uncaptured(small_llm, 4, 2)
    ok = prepare_input(_decode_step(bs, [5, 20, 32], 1), bs, runner.device)
    assert graphs.bucket_for(ok.meta) == 4
    too_many = prepare_input(_decode_step(bs, [5] * 5, 1), bs, runner.device)
    assert graphs.bucket_for(too_many.meta) is None
    too_long = prepare_input(_decode_step(bs, [5, 33], 1), bs, runner.device)
    assert graphs.bucket_for(too_long.meta) is None
    mixed = _decode_step(bs, [5, 20], 1)
    mixed.scheduled[1].num_new_tokens = 3
    mixed.scheduled[1].request.num_computed_tokens = 17
    assert graphs.bucket_for(prepare_input(mixed, bs, runner.device).meta) is None


class _Graph:
    replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.mark.parametrize("bad", ["slot", "block"])
def test_a_replayed_step_checks_its_indices_as_an_eager_one_does(small_llm, bad, monkeypatch):
    # A replay runs no Python, so not the attention backend's checks either: an index past the
    # cache would be written there. Here a stand-in graph replays (capture needs a GPU); CPU
    # tensors make the checks affordable, as the debug flag does on a GPU (where the runner's
    # tensors live when the suite runs there, and the checks would cost a sync a step).
    runner, bs = small_llm.engine.executor.runner, small_llm.engine.block_size
    if runner.device.type != "cpu":
        monkeypatch.setenv(DEBUG_ENV, "1")
    num_blocks = small_llm.engine.num_blocks
    graphs = DecodeGraphRunner(runner.model, CUDAGraphConfig(4, 4, bs, num_blocks=num_blocks),
                               runner.device, capture=False)
    graphs.capture, graphs.graphs[4] = True, _Graph()
    graphs.outputs[4] = torch.zeros(4, 8)
    inp = prepare_input(_decode_step(bs, [5, 20, 40], first_block=1), bs, runner.device)
    assert graphs.bucket_for(inp.meta) == 4
    graphs.run(inp.input_ids, inp.positions, inp.meta, 4)
    assert graphs.graphs[4].replays == 1
    if bad == "slot":
        inp.meta.slot_mapping[1] = num_blocks * bs
    else:
        inp.meta.block_tables[2, 0] = num_blocks
    with pytest.raises(ValueError, match="slot_mapping: slots|block_tables: block ids"):
        graphs.run(inp.input_ids, inp.positions, inp.meta, 4)
    assert graphs.graphs[4].replays == 1  # refused before anything ran


class _AsCaptured(DecodeGraphRunner):
    """Runs each bucket with the metadata a capture records: host lengths at their static upper
    bound, the real lengths only in the device tensors."""

    def _forward(self, bucket: int, seq_lens_list: list[int] | None = None) -> torch.Tensor:
        return super()._forward(bucket)


def test_the_captured_metadata_gives_the_eager_tokens_with_the_triton_kernels(prompts):
    """What a GPU replays, run on CPU under Triton's interpreter: the grid and the host bounds
    frozen at capture, every row's own length read from the static device buffers."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU test checks capture itself")
    # Batches of 3, 2 and 1: the interpreter runs every program of the grid in Python.
    some = prompts[:3]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 2, 4)]
    with LLM("micro-llama", attention_backend="triton", num_gpu_blocks=256) as llm:
        runner = llm.engine.executor.runner
        # Short partitions: the frozen bound then spans partitions no real context reaches,
        # which the split-K reduce must leave out.
        backends = {id(m.backend): m.backend for m in runner.model.modules()
                    if hasattr(m, "backend")}
        assert [b.name for b in backends.values()] == ["triton"]
        for backend in backends.values():
            backend.partition_size = 32
        eager = [o.token_ids for o in llm.generate(some, params)]
        graphs = _AsCaptured(runner.model, CUDAGraphConfig(4, 6, llm.engine.block_size),
                             runner.device, capture=False)
        runner.graphs = graphs
        got = [o.token_ids for o in llm.generate(some, params)]
        assert graphs.num_replays > 0
        # The frozen host bound is past every real context: the kernels must not trust it.
        assert graphs.metas[4].max_seq_len > max(len(p) + 6 for p in some)
    assert len({t for o in eager for t in o}) > 8, "greedy outputs are too repetitive to compare"
    assert got == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager_on_gpu(prompts, dtype):
    params = _params()
    with LLM("tiny-llama", device="cuda", dtype=dtype, enforce_eager=True,
             num_gpu_blocks=512) as llm:
        eager = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny-llama", device="cuda", dtype=dtype, max_num_seqs=8,
             num_gpu_blocks=512) as llm:
        graphs = llm.engine.executor.runner.graphs
        assert graphs is not None and graphs.capture
        assert sorted(graphs.graphs) == graphs.cfg.batch_sizes == [1, 2, 4, 8]
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert graphs.num_replays > 0
    assert got == eager
