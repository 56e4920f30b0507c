"""Continuous batching with chunked prefill.

Every step fills a token budget (``max_num_batched_tokens``): running requests first (a decode
costs one token, an unfinished prefill its next chunk), then waiting requests in arrival order.
There is no separate prefill phase: a request is just "``num_computed_tokens`` of
``num_tokens`` done", so prefill chunks and decodes share one flattened batch. When the cache
runs out of blocks, the most recently admitted running request is preempted and later recomputed
(its blocks usually come back as prefix-cache hits). A decode-role engine's requests arrive
with their prompt KV in blocks they hold while waiting; when nothing runs and they leave the
first waiting request no room, the last of them is preempted the same way.

With ``scheduling_policy="priority"`` both queues stay ordered by (priority, arrival): waiting
requests are admitted in that order, running ones get the budget in that order, and the one
preempted is the last (the lowest priority, then the latest to arrive).
"""
from __future__ import annotations

import time

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import BlockCopy, ComputedBlocks, KVCacheManager
from engine.request import Request, RequestStatus

# Prompt tokens per step whose logits are kept for prompt logprobs: each is a [vocab] float32
# row (512 rows of a 152k vocabulary: 311 MB). With chunked prefill, such prompts advance in
# chunks of at most this many tokens a step.
MAX_PROMPT_LOGPROB_TOKENS = 512


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # The request's whole block table (the KV cache manager's live ``array("i")``, or any
    # sequence of ints; read-only here).
    block_ids: Sequence[int]

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so it samples."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    # Decodes (one new token) first, then prefill chunks; backends batch the decodes.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Partial-block hits of the requests admitted: run before the forward writes any KV.
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.partial_block_hits = config.enable_partial_block_hits
        self.by_priority = config.scheduling_policy == "priority"
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- queues ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        if self.by_priority:
            _insert_in_order(self.waiting, request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Takes a request out of the queues; blocks go back unless the caller keeps them."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)

    # --- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._prompt_logprob_budget = MAX_PROMPT_LOGPROB_TOKENS
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.block_copies = self.kv.end_schedule()
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not self.chunked_prefill:
                i += 1
                continue
            num_new = self._capped(req, min(num_new, budget))
            if num_new == 0:
                i += 1
                continue
            if not self._allocate_or_preempt(req, num_new, out):
                break  # the request preempted itself: nothing lower in priority is left
            out.scheduled.append(ScheduledRequest(req, num_new,
                                                  self.kv.block_table(req.request_id)))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(req, num_new) is None:
            # Before the last running request preempts itself, a decode-role request waiting
            # on its written KV gives its blocks up: a request that cannot reuse its own
            # blocks (prompt logprobs, no prefix caching) preempted itself, came back a chunk
            # at a time (each fitting), took the step's budget and ran out again, for ever,
            # while the holders, never admitted, kept their blocks.
            if self.running[-1] is req and self._preempt_waiting_holder(req, req):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, for_blocks: bool = True) -> None:
        """``for_blocks``: preempted for want of KV blocks, as the preemption counts (a failed
        step's requests start over the same way, but were not)."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if for_blocks:
            req.num_preemptions += 1
            self.num_preemptions += 1
        if self.by_priority:
            _insert_in_order(self.waiting, req)
        else:
            self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed = None
            if req.num_computed_tokens == 0:
                # Prompt logprobs need every prompt position's logits: no prefix-cache hits.
                computed = (ComputedBlocks() if req.wants_prompt_logprobs
                            else self.kv.get_computed_blocks(req, self.partial_block_hits))
                num_done = computed.num_computed_tokens
            else:
                # Decode role: the prompt's KV was written into its blocks from outside.
                num_done = req.num_computed_tokens
            num_new = req.num_tokens - num_done
            if num_new > budget and not self.chunked_prefill:
                break
            num_new = self._capped(req, min(num_new, budget))
            if num_new == 0:
                break
            if self.kv.allocate_slots(req, num_new, computed) is None:
                if self.running or out.scheduled or not self._preempt_waiting_holder(req):
                    break
                continue  # the head again, with the blocks freed
            self.waiting.popleft()
            if computed is not None:
                req.num_computed_tokens = num_done
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_done
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if self.by_priority:
                _insert_in_order(self.running, req)
            else:
                self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new,
                                                  self.kv.block_table(req.request_id)))
            budget -= num_new

    def _preempt_waiting_holder(self, head: Request, outranking: Request | None = None) -> bool:
        """Decode role: requests admitted with their prompt KV wait holding its blocks. With
        nothing running, none of those blocks would ever come back, so when they leave the
        head no room, the last such request (the lowest priority) gives its blocks up and
        will recompute, as a preempted running request does. ``outranking``: only a holder
        that does not go before it (the priority policy) gives way. False when there is none."""
        for victim in reversed(self.waiting):
            if outranking is not None and self.by_priority and \
                    _priority_key(victim) < _priority_key(outranking):
                continue
            if victim is not head and victim.num_computed_tokens > 0:
                self.kv.free(victim)
                victim.status = RequestStatus.PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def _capped(self, req: Request, num_new: int) -> int:
        """num_new, or with chunked prefill less for a prompt whose logprobs are kept, so a
        step keeps at most MAX_PROMPT_LOGPROB_TOKENS rows of logits for them (0: wait)."""
        if req.prompt_logprobs is None or not req.wants_prompt_logprobs:
            return num_new
        if self.chunked_prefill:
            num_new = min(num_new, self._prompt_logprob_budget)
        self._prompt_logprob_budget -= num_new
        return num_new

    def undo(self, out: SchedulerOutput) -> None:
        """The step of ``out`` failed: its requests give their blocks up and start over (as
        preempted ones do), and the blocks it was to compute leave the prefix cache."""
        self.kv.uncache_last_schedule()
        # Last first: each goes to the head of the queue, so they keep their order there.
        for s in reversed(out.scheduled):
            req = s.request
            if req in self.running:
                self.running.remove(req)
                self._preempt(req, for_blocks=False)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances each scheduled request by the tokens this step computed."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens


def _priority_key(req: Request) -> tuple[int, float]:
    return req.sampling_params.priority, req.arrival_time


def _insert_in_order(queue: deque[Request] | list[Request], req: Request) -> None:
    """Inserts req after every request that goes before it or ties with it."""
    key = _priority_key(req)
    i = len(queue)
    while i > 0 and _priority_key(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, req)
