"""One rank's forward pass over the paged KV cache, and the inputs rank 0 builds for it.

Rank 0 flattens the scheduler output into a ``ModelInput`` (``prepare_input``); every rank runs
the same input through its ``ModelRunner``; rank 0 samples from the logits. Runs on whatever
thread steps the engine; never on an event loop.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from engine.bad_words import bad_word_bans
from engine.cpu_graph import CPUModelGraph
from engine.cuda_graph import CUDAGraphConfig, DecodeGraphRunner
from engine.kv_layout import KVCacheLayout
from engine.penalties import PenaltyState
from engine.sampler import Sampler, SamplerOutput, make_generator, token_logprobs
from engine.scheduler import SchedulerOutput
from kernels.attention_backend import AttentionMetadata
from kernels.huge_pages import huge_page_zeros


@dataclass
class PromptLogprobRows:
    """Rank 0 only: rows of the logits (after the sampled ones) that score prompt tokens."""

    request_id: str
    # Prompt token ids the rows score, in order: row r scores targets[r] given what precedes it.
    targets: list[int]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # [num_sampled] rows of the hidden states whose logits are sampled.
    sample_indices: torch.Tensor
    # Rank 0 only (workers get an empty list): who each sampled row belongs to.
    sample_request_ids: list[str]
    # Rank 0 only: after the sampled rows, sample_indices go on with these requests' prompt
    # positions, whose logits become prompt logprobs.
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # [num_copies, 2] (source, destination) block ids, on the CPU: whole blocks copied before
    # the forward.
    block_copies: torch.Tensor | None = None


class ModelRunner:
    """One rank's model and its share of the paged KV cache."""

    def __init__(self, model: torch.nn.Module, layout: KVCacheLayout, dtype: torch.dtype,
                 device: torch.device, graph_config: CUDAGraphConfig | None = None,
                 cpu_graph: bool = False) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        # The current CUDA device is per thread and Triton launches, and graphs capture, on it:
        # a rank on cuda:1 whose thread is on cuda:0 ran them there.
        self._cuda_index = device.index if device.type == "cuda" else None
        self._use_device()
        # [num_blocks, num_layers, 2, block_size, num_kv_heads_on_this_rank, head_size]. On
        # the CPU in huge pages: decode attention reads every sequence's blocks wherever they
        # lie (32 decodes of 700 tokens on tiny-llama: 31.0 ms a step against 34.5).
        self.kv_cache = (huge_page_zeros(layout.shape, dtype) if device.type == "cpu"
                         else torch.zeros(layout.shape, dtype=dtype, device=device))
        model.bind_kv_cache(self.kv_cache)
        # Captured after the cache exists: the graphs hold its address.
        self.graphs: DecodeGraphRunner | CPUModelGraph | None = None
        if graph_config is not None:
            self.graphs = DecodeGraphRunner(model, graph_config, device)
        elif cpu_graph:  # None where the model has a piece the C graph does not reproduce
            self.graphs = CPUModelGraph.build(model)

    def release(self) -> None:
        """Frees the KV cache, the weights and the graphs, and on a GPU hands the caching
        allocator's idle memory back to the device for other engines and processes. The
        storages themselves are emptied (those torch allocated: not the CPU cache's huge
        pages), so the memory goes back even where the caller still holds a layer, a view of
        the cache or a graph runner. The runner cannot run afterwards. Idempotent."""
        if self.model is None:
            return
        tensors = [self.kv_cache, *self.model.parameters(), *self.model.buffers()]
        self.graphs = None
        self.model = None
        self.kv_cache = None
        for t in tensors:
            storage = t.untyped_storage()
            if storage.resizable():
                storage.resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> torch.Tensor | None:
        """The forward pass; float32 logits of the sample_indices rows [num_rows, vocab] (the
        sampled rows, then prompt logprob rows), None when there are none.

        Every rank calls this with the same input, so the layers' collectives pair up.
        """
        self._use_device()  # the engine's thread steps, not the one that built the runner
        if inp.block_copies is not None and inp.block_copies.numel():
            self.copy_blocks(inp.block_copies)
        bucket = self.graphs.bucket_for(inp.meta) if self.graphs is not None else None
        if bucket is not None:  # every rank decides alike, so collectives still pair up
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.meta, bucket)
        else:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta)  # [num_tokens, hidden]
        if inp.sample_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[inp.sample_indices])

    def _use_device(self) -> None:
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """Copies whole blocks ([num_copies, 2] source, destination ids) of this rank's cache.

        Sources are gathered before any destination is written, so a block that is both a
        source and another copy's destination gives its old contents.
        """
        if copies.dim() != 2 or copies.shape[1] != 2:
            raise ValueError(f"block copies must be [num_copies, 2], got {tuple(copies.shape)}")
        # Checked where the ids live (the CPU: no device sync), then moved once.
        if int(copies.min()) < 0 or int(copies.max()) >= self.kv_cache.shape[0]:
            raise ValueError(f"block copies name blocks outside [0, {self.kv_cache.shape[0]})")
        copies = copies.to(device=self.kv_cache.device, dtype=torch.int64)
        # [num_copies, num_layers, 2, block_size, num_kv_heads, head_size]
        src = self.kv_cache.index_select(0, copies[:, 0])
        self.kv_cache.index_copy_(0, copies[:, 1], src)


def sample_tokens(sampler: Sampler, logits: torch.Tensor, sched: SchedulerOutput,
                  device: torch.device) -> SamplerOutput:
    """One token per row of ``logits`` ([num_sampled, vocab]) for the requests that sample."""
    reqs = [s.request for s in sched.scheduled if s.samples]
    gens = [request_generator(r, device) for r in reqs]
    states = None
    if any(r.sampling_params.has_penalties for r in reqs):
        states = [request_penalty_state(r, logits.shape[1], logits.device)
                  if r.sampling_params.has_penalties else None for r in reqs]
    lengths = ([r.num_output_tokens for r in reqs]
               if any(r.sampling_params.min_tokens for r in reqs) else None)
    bans = None
    if any(r.bad_words_token_ids for r in reqs):
        bans = [bad_word_bans(r.bad_words_token_ids, r.output_token_ids)
                if r.bad_words_token_ids else [] for r in reqs]
    choices = None
    if any(r.guide is not None for r in reqs):
        choices = [r.guide.allowed(r.output_token_ids) if r.guide is not None else None
                   for r in reqs]
    return sampler(logits, [r.sampling_params for r in reqs], gens, states, lengths, bans,
                   choices)


def score_prompt_tokens(logits: torch.Tensor, rows: list[PromptLogprobRows],
                        requests: dict) -> list:
    """Appends the prompt logprobs of ``logits`` [num_rows, vocab] (rows in ``rows``' order)
    to their requests' ``prompt_logprobs``; returns them all (TokenLogprobs)."""
    targets = torch.tensor([t for r in rows for t in r.targets], dtype=torch.int64)
    num_top = [requests[r.request_id].sampling_params.prompt_logprobs
               for r in rows for _ in r.targets]
    scored = token_logprobs(logits, targets, num_top)
    i = 0
    for r in rows:
        requests[r.request_id].prompt_logprobs.extend(scored[i:i + len(r.targets)])
        i += len(r.targets)
    return scored


def request_penalty_state(req, vocab_size: int, device: torch.device) -> PenaltyState:
    """The request's penalty counts, made at its first sampled step and brought up to date
    with the tokens it has output since its last."""
    if req.penalty_state is None:
        req.penalty_state = PenaltyState.for_prompt(req.prompt_token_ids, vocab_size, device)
    req.penalty_state.update(req.output_token_ids)
    return req.penalty_state


def request_generator(req, device: torch.device) -> torch.Generator | None:
    """A seeded request's RNG for its next token, keyed by (seed, output index).

    Re-seeding per token (rather than advancing one stream) makes the token depend only on
    the seed and its position: the same after preemption and recompute, and the same when
    a decode worker continues what a prefill worker started.
    """
    seed = req.sampling_params.seed
    if seed is None:
        return None
    return make_generator(_token_seed(seed, req.num_output_tokens), device)


def prepare_input(sched: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
    """Flattens the scheduled requests (decodes first) into one batch.

    Built in ``array`` buffers that become tensors without a copy: ``torch.tensor`` of nested
    lists converts ~140 ns an element, so a 32-request block table cost ~0.27 ms a step,
    about a decode step of a small model on a GPU."""
    bs = block_size
    input_ids, positions, slots = array("q"), array("q"), array("q")
    query_start, seq_lens = array("i", [0]), array("i")
    sample_idx: list[int] = []
    sample_ids: list[str] = []
    prompt_idx: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    max_blocks = max(len(s.block_ids) for s in sched.scheduled)
    tables = array("i")  # [num_seqs * max_blocks], padded with block 0
    for s in sched.scheduled:
        req, n, ids = s.request, s.num_new_tokens, s.block_ids
        start = req.num_computed_tokens
        input_ids.extend(req.token_ids_between(start, start + n))
        if n == 1:
            positions.append(start)
            slots.append(ids[start // bs] * bs + start % bs)
        else:
            positions.extend(range(start, start + n))
            _append_slots(slots, ids, start, start + n, bs)
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        tables.extend(ids)
        tables.frombytes(bytes(tables.itemsize * (max_blocks - len(ids))))  # the padding
        if s.samples:
            sample_idx.append(query_start[-1] - 1)
            sample_ids.append(req.request_id)
        if req.prompt_logprobs is not None and req.wants_prompt_logprobs:
            # Position j's logits score prompt token j + 1; the last prompt position's are
            # the sampled row. Positions scored before a preemption are not scored again.
            first = max(start, len(req.prompt_logprobs) - 1)
            last = min(start + n, req.num_prompt_tokens - 1)
            if first < last:
                prompt_idx.extend(range(query_start[-2] + first - start,
                                        query_start[-2] + last - start))
                prompt_rows.append(PromptLogprobRows(
                    req.request_id, req.prompt_token_ids[first + 1:last + 1]))
    num_seqs = len(sched.scheduled)
    block_tables = _tensor(tables, torch.int32).view(num_seqs, max_blocks)
    meta = AttentionMetadata(
        slot_mapping=_tensor(slots, torch.int64).to(device),
        query_start_loc=_tensor(query_start, torch.int32).to(device),
        seq_lens=_tensor(seq_lens, torch.int32).to(device),
        block_tables=block_tables.to(device),
        query_lens_list=[s.num_new_tokens for s in sched.scheduled],
        seq_lens_list=seq_lens.tolist(),
        max_query_len=max(s.num_new_tokens for s in sched.scheduled),
        max_seq_len=max(seq_lens),
        block_size=bs,
        num_decodes=sched.num_decodes,
    )
    copies = None
    if sched.block_copies:
        # [num_copies, 2]
        copies = torch.tensor([[c.src_block_id, c.dst_block_id] for c in sched.block_copies],
                              dtype=torch.int64)
    return ModelInput(
        block_copies=copies,
        input_ids=_tensor(input_ids, torch.int64).to(device),
        positions=_tensor(positions, torch.int64).to(device),
        meta=meta,
        sample_indices=torch.tensor(sample_idx + prompt_idx, dtype=torch.int64, device=device),
        sample_request_ids=sample_ids,
        prompt_logprob_rows=prompt_rows,
    )


def _append_slots(slots: array, block_ids, start: int, stop: int, bs: int) -> None:
    """Cache slots of positions [start, stop): a range per block, not a division per token."""
    pos = start
    while pos < stop:
        b = pos // bs
        end = min(stop, (b + 1) * bs)
        first = block_ids[b] * bs + pos - b * bs
        slots.extend(range(first, first + end - pos))
        pos = end


def _tensor(buf: array, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over ``buf``'s memory (it keeps ``buf`` alive); ``buf`` is not reused."""
    if not len(buf):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype)


def _token_seed(seed: int, index: int) -> int:
    # splitmix64-style mixing so neighbouring (seed, index) pairs give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF

