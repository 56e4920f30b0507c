"""prepare_input builds its batch in array buffers (engine/model_runner.py); here it must give
exactly what the plain per-token construction gives, on the steps of a real engine run: decodes,
chunked prefills, prefix hits (whole and partial blocks), prompt logprobs and padded tables."""
from __future__ import annotations

import copy
import random

import torch

import engine.llm_engine as llm_engine
from engine import LLM, SamplingParams
from engine.model_runner import prepare_input
from engine.scheduler import SchedulerOutput

BLOCK = 16


def reference(sched: SchedulerOutput) -> dict:
    """Every field of the step's input, built token by token from lists."""
    ids, pos, slots, qs, lens, tables, sample, names, prompt = [], [], [], [0], [], [], [], [], []
    width = max(len(s.block_ids) for s in sched.scheduled)
    for s in sched.scheduled:
        req, n, table = s.request, s.num_new_tokens, list(s.block_ids)
        start = req.num_computed_tokens
        ids += req.token_ids_between(start, start + n)
        pos += range(start, start + n)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        qs.append(qs[-1] + n)
        lens.append(start + n)
        tables.append(table + [0] * (width - len(table)))
        if s.samples:
            sample.append(qs[-1] - 1)
            names.append(req.request_id)
        if req.prompt_logprobs is not None and req.wants_prompt_logprobs:
            first = max(start, len(req.prompt_logprobs) - 1)
            last = min(start + n, req.num_prompt_tokens - 1)
            if first < last:
                prompt += [(qs[-2] + p - start, req.request_id, req.prompt_token_ids[p + 1])
                           for p in range(first, last)]
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "query_start_loc": qs,
            "seq_lens": lens, "block_tables": tables,
            "sample_indices": sample + [p[0] for p in prompt], "sample_request_ids": names,
            "prompt_targets": [(p[1], p[2]) for p in prompt],
            "query_lens_list": [s.num_new_tokens for s in sched.scheduled],
            "seq_lens_list": lens, "num_decodes": sched.num_decodes,
            "block_copies": [[c.src_block_id, c.dst_block_id] for c in sched.block_copies]}


def built(sched: SchedulerOutput) -> dict:
    inp = prepare_input(sched, BLOCK, torch.device("cpu"))
    m = inp.meta
    dtypes = {"input_ids": inp.input_ids.dtype, "positions": inp.positions.dtype,
              "slot_mapping": m.slot_mapping.dtype, "query_start_loc": m.query_start_loc.dtype,
              "seq_lens": m.seq_lens.dtype, "block_tables": m.block_tables.dtype}
    assert dtypes == {"input_ids": torch.int64, "positions": torch.int64,
                      "slot_mapping": torch.int64, "query_start_loc": torch.int32,
                      "seq_lens": torch.int32, "block_tables": torch.int32}
    assert m.max_query_len == max(m.query_lens_list) and m.max_seq_len == max(m.seq_lens_list)
    return {"input_ids": inp.input_ids.tolist(), "positions": inp.positions.tolist(),
            "slot_mapping": m.slot_mapping.tolist(),
            "query_start_loc": m.query_start_loc.tolist(), "seq_lens": m.seq_lens.tolist(),
            "block_tables": m.block_tables.tolist(), "sample_indices": inp.sample_indices.tolist(),
            "sample_request_ids": inp.sample_request_ids,
            "prompt_targets": [(r.request_id, t) for r in inp.prompt_logprob_rows
                               for t in r.targets],
            "query_lens_list": m.query_lens_list, "seq_lens_list": list(m.seq_lens_list),
            "num_decodes": m.num_decodes,
            "block_copies": [] if inp.block_copies is None else inp.block_copies.tolist()}


def test_the_batch_matches_the_per_token_construction_on_a_real_run(monkeypatch):
    steps: list[SchedulerOutput] = []
    real = llm_engine.prepare_input

    def spy(sched, block_size, device):
        steps.append(copy.deepcopy(sched))  # the requests move on after the step
        return real(sched, block_size, device)

    monkeypatch.setattr(llm_engine, "prepare_input", spy)
    rng = random.Random(7)
    shared = [rng.randint(5, 7000) for _ in range(40)]  # 2 whole blocks and 8 tokens
    prompts = [[rng.randint(5, 7000) for _ in range(n)] for n in (1, 15, 16, 17, 90, 200)]
    prompts += [shared + [rng.randint(5, 7000) for _ in range(n)] for n in (3, 30, 61)]
    with LLM("tiny-llama", num_gpu_blocks=256, max_num_batched_tokens=64,
             block_size=BLOCK) as llm:
        plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        scored = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=2)
        llm.generate(prompts[1:2] + prompts[6:7], plain)  # cache the shared prefix first
        llm.generate(prompts, [scored if i % 3 == 0 else plain for i in range(len(prompts))])
    kinds = {(s.num_decodes > 0, s.num_decodes < len(s.scheduled)) for s in steps}
    assert kinds == {(True, False), (False, True), (True, True)}  # decode, prefill, mixed
    assert any(s.block_copies for s in steps)  # a partial-block hit ran
    assert any(s.request.num_computed_tokens > 0 and s.num_new_tokens > 1
               for st in steps for s in st.scheduled)  # a later chunk or a prefix hit
    for sched in steps:
        assert built(sched) == reference(sched)
