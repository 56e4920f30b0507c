"""The model-level parts of ``pdserve bench gpu``: engine vs HF decode, CUDA graphs on vs off,
and the nano-vllm W1 throughput workload.

Each part builds its own engine inside a helper, so the engine is unreferenced (and its KV
cache and graph pool freeable) when the helper returns; the next part or the HF model then
sizes itself against an empty device.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.gpu_decode import (RunTiming, build_engine, load_hf_model, random_prompts,
                              timed_engine_run, timed_hf_run, token_id_limit)
from engine.setup import free_device_memory

# Published H100 output-token throughput for this workload on Qwen3-0.6B (nano-vllm's
# benchmark); a reference constant, not measured by this run.
W1_REFERENCE_TOK_S = 28_600.0
W1_REFERENCE_NOTE = ("28.6k tok/s: published H100 figure for nano-vllm's bench.py workload "
                     "(reference constant, not measured here)")
# Every decode-engine KV cache spans at least this many tokens, so the graphs' block tables
# (and the decode kernel's partition grid) are as wide as in a default deployment.
_MIN_KV_TOKENS = 16384
_WARMUP_TOKENS = 4


@dataclass
class DecodeRow:
    batch: int
    prompt_len: int
    output_len: int
    engine_decode_tok_s: float
    hf_decode_tok_s: float
    ratio_vs_hf: float  # engine / HF
    engine_prefill_s: float
    hf_prefill_s: float


@dataclass
class GraphRow:
    batch: int
    eager_decode_tok_s: float
    graph_decode_tok_s: float | None  # None off CUDA
    ratio: float | None  # graphs / eager
    graph_replays: int | None  # decode steps replayed from a graph in the timed run


@dataclass
class W1Result:
    num_seqs: int
    len_range: tuple[int, int]  # uniform, inclusive, for both input and output lengths
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    reference_tok_s: float
    fraction_of_reference: float
    reference_note: str
    warmup_seqs: int


def _kv_blocks(batch: int, seq_len: int, block_size: int = 16) -> int:
    need = 2 * batch * math.ceil((seq_len + 1) / block_size)
    return max(need, _MIN_KV_TOKENS // block_size)


def _engine_decode(opts, vocab: int, batches, enforce_eager: bool) -> dict[int, tuple]:
    """batch -> (RunTiming, graph replays or None) on one engine built for the largest batch."""
    llm = build_engine(opts.model, opts.device, opts.dtype, max(batches),
                       opts.max_num_batched_tokens, enforce_eager=enforce_eager,
                       num_gpu_blocks=_kv_blocks(max(batches), opts.prompt_len + opts.output_len))
    graphs = getattr(llm.engine.executor.runner, "graphs", None)
    results = {}
    for b in batches:
        warm = random_prompts(b, opts.prompt_len, vocab, opts.seed + 1000 + b)
        timed_engine_run(llm, warm, [_WARMUP_TOKENS] * b)
        prompts = random_prompts(b, opts.prompt_len, vocab, opts.seed + b)
        before = graphs.num_replays if graphs is not None else 0
        timing = timed_engine_run(llm, prompts, [opts.output_len] * b)
        replays = graphs.num_replays - before if graphs is not None else None
        results[b] = (timing, replays)
    llm.shutdown()
    return results


def _hf_decode(opts, path, vocab: int) -> dict[int, RunTiming]:
    model = load_hf_model(path, opts.dtype, opts.device)
    results = {}
    for b in opts.decode_batches:
        warm = random_prompts(b, opts.prompt_len, vocab, opts.seed + 1000 + b)
        timed_hf_run(model, warm, _WARMUP_TOKENS, opts.device)
        prompts = random_prompts(b, opts.prompt_len, vocab, opts.seed + b)
        results[b] = timed_hf_run(model, prompts, opts.output_len, opts.device)
    return results


def run_decode(opts, path, vocab: int, log) -> list[DecodeRow]:
    log(f"decode: engine, batches {list(opts.decode_batches)}")
    eng = _engine_decode(opts, vocab, opts.decode_batches, enforce_eager=False)
    free_device_memory()
    log("decode: HF transformers generate")
    hf = _hf_decode(opts, path, vocab)
    free_device_memory()
    rows = []
    for b in opts.decode_batches:
        e, h = eng[b][0], hf[b]
        rows.append(DecodeRow(b, opts.prompt_len, opts.output_len, e.decode_tok_s, h.decode_tok_s,
                              e.decode_tok_s / h.decode_tok_s, e.prefill_s, h.prefill_s))
    return rows


def run_graphs(opts, vocab: int, log) -> list[GraphRow]:
    log(f"graphs: eager engine, batches {list(opts.graph_batches)}")
    eager = _engine_decode(opts, vocab, opts.graph_batches, enforce_eager=True)
    free_device_memory()
    graphed = {}
    if opts.on_cuda:
        log("graphs: CUDA-graph engine")
        graphed = _engine_decode(opts, vocab, opts.graph_batches, enforce_eager=False)
        free_device_memory()
    rows = []
    for b in opts.graph_batches:
        e = eager[b][0].decode_tok_s
        g, replays = graphed.get(b, (None, None))
        if opts.on_cuda and not replays:
            # No graph ran (none captured, or every step declined): the ratio would compare
            # eager with eager and read as "graphs gain nothing".
            raise RuntimeError(f"graphs: the CUDA-graph engine replayed no graph at batch {b} "
                               f"(replays: {replays})")
        g_tok_s = None if g is None else g.decode_tok_s
        rows.append(GraphRow(b, e, g_tok_s, None if g is None else g_tok_s / e, replays))
    return rows


def w1_requests(num_seqs: int, lo: int, hi: int, vocab: int,
                seed: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draws: every prompt (length, then ids), then every output length."""
    rng = random.Random(seed)
    top = token_id_limit(vocab)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))]
               for _ in range(num_seqs)]
    return prompts, [rng.randint(lo, hi) for _ in range(num_seqs)]


def run_w1(opts, vocab: int, log) -> W1Result:
    lo, hi = opts.w1_len_range
    n = opts.num_seqs_w1
    prompts, outs = w1_requests(n, lo, hi, vocab, opts.seed)
    # A quarter-size draw of the same workload compiles the Triton variants it meets first;
    # any met only in the timed run compile there once (and come from the disk cache later).
    warm_n = max(1, n // 4)
    warm_prompts, warm_outs = w1_requests(warm_n, lo, hi, vocab, opts.seed + 1)
    log(f"w1: {n} seqs, lengths U[{lo}, {hi}], {sum(outs)} output tokens "
        f"(warm-up: {warm_n} seqs)")
    timing = _w1_engine_run(opts, prompts, outs, warm_prompts, warm_outs)
    free_device_memory()
    return W1Result(n, (lo, hi), sum(map(len, prompts)), timing.output_tokens, timing.e2e_s,
                    timing.output_tok_s, W1_REFERENCE_TOK_S,
                    timing.output_tok_s / W1_REFERENCE_TOK_S, W1_REFERENCE_NOTE, warm_n)


def _w1_engine_run(opts, prompts, outs, warm_prompts, warm_outs) -> RunTiming:
    llm = build_engine(opts.model, opts.device, opts.dtype, len(prompts),
                       opts.max_num_batched_tokens,
                       gpu_memory_utilization=opts.gpu_memory_utilization)
    # nano-vllm samples at temperature 0.6; sampling vs greedy barely moves throughput.
    timed_engine_run(llm, warm_prompts, warm_outs, temperature=0.6)
    timing = timed_engine_run(llm, prompts, outs, temperature=0.6)
    llm.shutdown()
    return timing
