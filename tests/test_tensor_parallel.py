"""TP=2 (rank 0 here, rank 1 in a worker process, gloo) against TP=1 on the same weights.

Greedy tokens must be identical and logprobs within 1e-4, with chunked prefill and prefix
hits on; each rank's cache holds exactly its own heads; a killed worker fails the engine fast;
shutdown and a dead parent leave no processes behind.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.executor_error import ExecutorError
from engine.llm_engine import LLMEngine

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
MAX_NEW = 12
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, vocab) for _ in range(48)]
    fresh = [[rng.randrange(5, vocab) for _ in range(n)] for n in (4, 29, 70)]
    # Two prompts share a 3-block prefix, so the second round hits the prefix cache.
    return fresh + [shared + [rng.randrange(5, vocab) for _ in range(n)] for n in (9, 21)]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)


def _run(llm: LLM, prompts: list[list[int]]):
    # Two rounds: the second re-reads the shared prefix from the cache, and the part of the
    # next block each prompt's first round filled (partial-block hits: copied on every rank).
    return llm.generate(prompts, _params()) + llm.generate(prompts[-2:], _params())


def _assert_same(tp1, tp2) -> None:
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]
    for a, b in zip(tp1, tp2):
        got = torch.tensor([lp.sampled.logprob for lp in b.logprobs])
        want = torch.tensor([lp.sampled.logprob for lp in a.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # Random weights must still give varied text, or equality would prove little.
    assert all(len(set(o.token_ids)) >= MAX_NEW // 2 for o in tp1)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# The slow tier for tiny-qwen2: what only it has is the q/k/v bias, whose split across ranks
# tests/test_parallel_layers.py checks (tied embeddings and its rope theta are qwen3's too).
@pytest.mark.parametrize("preset", [
    pytest.param(p, marks=pytest.mark.slow) if p == "tiny-qwen2" else p for p in PRESETS])
def test_tp2_matches_tp1(preset, preset_path):
    path = str(preset_path(preset))
    # A 24-token budget splits every long prompt into chunks mixed with decodes.
    config = dict(max_num_batched_tokens=24, num_gpu_blocks=64)
    ref = LLM(path, **config)
    prompts = _prompts(ref.engine.model_config.vocab_size)
    expected = _run(ref, prompts)
    with LLM(path, tensor_parallel_size=2, **config) as llm:
        got = _run(llm, prompts)
        assert llm.engine.get_stats().prefix_cache_hits >= 6  # 2 prompts x 3 shared blocks
        partial = llm.engine.kv_manager.stats.partial_hits
        assert partial == ref.engine.kv_manager.stats.partial_hits > 0
        _assert_all_free(llm)
    _assert_same(expected, got)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> str:
    from tests.test_model_parity import build_hf, save_hf

    # 4 query heads, 1 KV head: at TP=2 both ranks hold a replica of the one KV head.
    return str(save_hf(build_hf("qwen3", seed=4), tmp_path_factory.mktemp("qwen3-mqa")))


def test_fewer_kv_heads_than_ranks(one_kv_head_model):
    prompts = [[(7 * i + 3 * n) % 500 + 5 for i in range(n)] for n in (5, 33, 60)]
    expected = _run(LLM(one_kv_head_model, max_num_batched_tokens=24), prompts)
    with LLM(one_kv_head_model, tensor_parallel_size=2, max_num_batched_tokens=24) as llm:
        got = _run(llm, prompts)
        layouts = llm.engine.kv_cache_layouts()
    assert [(lay.kv_head_start, lay.num_kv_heads) for lay in layouts] == [(0, 1), (0, 1)]
    _assert_same(expected, got)


def _lease_blocks(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    while True:
        for out in engine.step():
            if out.kv_lease is not None:
                return out.kv_lease.block_ids


def test_each_rank_caches_its_own_heads(preset_path):
    path = str(preset_path("tiny-llama"))  # 4 KV heads: rank 0 holds 0-1, rank 1 holds 2-3
    prompt = _prompts(8000)[2]
    ref = LLMEngine(EngineConfig(path, role="prefill", num_gpu_blocks=32))
    ref_blocks = _lease_blocks(ref, prompt)
    full = ref.kv_cache[ref_blocks]  # [blocks, layers, 2, block_size, 4, head_size]
    with LLMEngine(EngineConfig(path, role="prefill", num_gpu_blocks=32,
                                tensor_parallel_size=2)) as engine:
        blocks = _lease_blocks(engine, prompt)
        layouts = engine.kv_cache_layouts()
        for rank, layout in enumerate(layouts):
            assert (layout.tp_rank, layout.tp_size, layout.num_kv_heads,
                    layout.total_num_kv_heads) == (rank, 2, 2, 4)
            part = engine.executor.read_blocks(rank, blocks)
            heads = slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
            torch.testing.assert_close(part, full[..., heads, :], atol=1e-4, rtol=0)
        assert layouts[1].kv_head_start == 2
        # Refused for every rank alike, and the engine lives on: rank 1 died on the ids it
        # refused (and the engine with it), rank 0 read -1 as the last block.
        for rank, bad in ((0, [-1]), (1, [-1]), (1, [32]), (2, [0])):
            with pytest.raises(ValueError, match="out of range|rank must be"):
                engine.executor.read_blocks(rank, bad)
        engine.executor.check_health()
        torch.testing.assert_close(engine.executor.read_blocks(1, blocks[:1]),
                                   full[:1, ..., 2:4, :], atol=1e-4, rtol=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for every practical purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_killed_worker_fails_fast_and_shutdown_cleans_up(preset_path):
    path = str(preset_path("tiny-llama"))
    shm_before = set(os.listdir("/dev/shm"))
    engine = LLMEngine(EngineConfig(path, tensor_parallel_size=2, num_gpu_blocks=64))
    pid = engine.executor.workers[0].process.pid
    engine.add_request("a", list(range(10, 200)), SamplingParams(max_tokens=64, ignore_eos=True))
    engine.step()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ExecutorError, match=r"rank 1 .*killed by signal 9"):
        for _ in range(64):  # the very next step notices; bounded in case it did not
            engine.step()
    # The engine stays failed with the same error instead of hanging on a later step.
    with pytest.raises(ExecutorError, match="rank 1"):
        engine.step()
    engine.shutdown()
    assert not _alive(pid)
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_shutdown_stops_workers(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-qwen2")), tensor_parallel_size=2,
                                    num_gpu_blocks=16))
    proc = engine.executor.workers[0].process
    engine.shutdown()
    assert proc.returncode == 0  # it was told to quit and did, no kill needed
    engine.shutdown()  # idempotent
    with pytest.raises(ExecutorError, match="shut down"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
        engine.step()


def test_worker_exits_when_rank0_is_killed(preset_path, tmp_path):
    # A script without a __main__ guard: workers are fresh interpreters, so this is fine.
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from engine import LLM
        llm = LLM({str(preset_path("tiny-llama"))!r}, tensor_parallel_size=2, num_gpu_blocks=8)
        print(llm.engine.executor.workers[0].process.pid, flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        worker_pid = int(rank0.stdout.readline())
        assert _alive(worker_pid)
        rank0.kill()
        rank0.wait()
        assert _wait_gone(worker_pid), "the TP worker outlived its killed rank 0"
    finally:
        rank0.kill()


@pytest.mark.parametrize("tp, match", [(3, "does not divide the model's 8 attention heads"),
                                       (16, "does not divide the model's 8 attention heads"),
                                       (0, "tensor_parallel_size must be a positive integer")])
def test_bad_tensor_parallel_size(preset_path, tp, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(preset_path("tiny-llama")), tensor_parallel_size=tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_heads_tp_cannot_split_are_refused_by_the_flags_name(tmp_path, tp):
    from transformers import LlamaConfig

    from engine.model_config import ModelConfig
    from engine.setup import check_tensor_parallel

    LlamaConfig(hidden_size=96, num_hidden_layers=1, num_attention_heads=12,
                num_key_value_heads=3, intermediate_size=48, vocab_size=64).save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp} does not divide the "
                                         "model's 3 num_key_value_heads"):
        check_tensor_parallel(cfg, tp, torch.device("cpu"))
    check_tensor_parallel(cfg, 3, torch.device("cpu"))  # a multiple of them: split exactly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL tensor parallelism needs at least two CUDA GPUs")
@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_matches_tp1_nccl(preset, preset_path):
    path = str(preset_path(preset))
    config = dict(max_num_batched_tokens=24, num_gpu_blocks=64, dtype="float32")
    ref = LLM(path, **config)
    prompts = _prompts(ref.engine.model_config.vocab_size)
    expected = _run(ref, prompts)
    with LLM(path, tensor_parallel_size=2, **config) as llm:
        got = _run(llm, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
