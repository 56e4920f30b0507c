"""The engine: request intake, one step of schedule -> forward -> sample -> outputs, abort,
and the prefill/decode roles the services drive.

Not tied to any event loop: services call it from their own engine thread. ``add_request``,
``abort`` and ``release_kv`` may be called from any thread; they queue work that the next
``step`` applies, so callers never wait for a forward pass.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.bad_words import tokenize_bad_words
from engine.guides import Guides
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, NoFreeBlocksError  # noqa: F401 (re-export)
from engine.engine_kv_transfer import EngineKVTransfer
from engine.model_config import ModelConfig
from engine.executor import Executor, make_executor
from engine.model_runner import prepare_input, sample_tokens, score_prompt_tokens
from engine.output_processor import OutputProcessor, Replay, check_stream_interval
from engine.outputs import (EngineStats, KVAllocation, KVLease, LeaseEnded, PrefixCacheReset,
                            RequestOutput)
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sampler import Sampler
from engine.setup import EngineSetup, resolve_engine, resolve_max_model_len


@dataclass
class _Lease:
    request: Request
    lease: KVLease


class LLMEngine(EngineKVTransfer):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts: EngineSetup = resolve_engine(config)
        self.model_config: ModelConfig = parts.model_config
        self.model_path = parts.model_path
        self.tokenizer = parts.tokenizer
        self.block_size = config.block_size
        self.device = parts.device
        self.executor: Executor = make_executor(parts.spec, parts.model_config)
        try:
            self.max_model_len = resolve_max_model_len(config, parts.model_config,
                                                       self.executor.num_blocks)
        except ValueError:
            self.executor.shutdown()
            raise
        self.num_blocks = self.executor.num_blocks
        self.kv_manager = KVCacheManager(self.num_blocks, config.block_size,
                                         config.enable_prefix_caching)
        # Until a consumer asks for them (enable_kv_events): an offline engine's would pile up.
        self.kv_manager.pool.record_events = False
        self.scheduler = Scheduler(config, self.kv_manager)
        self.sampler = Sampler(parts.model_config.eos_token_ids)
        self.guides = Guides(parts.tokenizer, parts.model_config.eos_token_ids)
        self.outputs = OutputProcessor(parts.tokenizer, parts.model_config.eos_token_ids,
                                       self.max_model_len, config.detokenize)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Held for a whole step; intake paths never take it, so they never wait for a forward.
        self._lock = threading.RLock()
        self._ids_lock = threading.Lock()
        self._ids: set[str] = set()  # ids queued or live, to refuse duplicates at once
        self._leases: dict[str, _Lease] = {}
        self._lease_events: list[LeaseEnded] = []
        self._awaiting_kv: dict[str, Request] = {}
        self._admitting: dict[str, Request] = {}  # committed; its "admit" not drained yet
        # request id -> (request, when its blocks may be reused): see quarantine_kv.
        self._quarantined: dict[str, tuple[Request, float]] = {}
        # Outputs made outside a step (aborts), or by a step that then failed: the next
        # step returns them first.
        self._owed_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.num_expired_leases = 0
        # Tokens per executed step (the offline benchmark's roofline replays these sizes).
        self.step_num_tokens: collections.deque[int] = collections.deque(maxlen=1 << 16)
        self.step_num_sampled: collections.deque[int] = collections.deque(maxlen=1 << 16)
        # Called in each step once its schedule is made, before its forward (in the stepping
        # thread, under the step lock): a served engine publishes its KV events there. After
        # the step, the blocks its schedule evicted stayed in the prefix index for a whole
        # forward (seconds of a long prefill on CPUs), and routers sent their prefixes here.
        self.on_scheduled: Callable[[LLMEngine], None] | None = None
        self.kv_connector = None
        if config.kv_transfer_backend is not None:
            from engine.kv_connector import KVConnector
            self.kv_connector = KVConnector(self)

    # --- intake ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_path} has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams,
                        resume: list[int] = ()) -> None:
        """``resume``: output tokens a resumed request brings, which follow the prompt in its
        context (checked as such, each token once, a bad one named for what it is)."""
        self._check_vocab(resume, "resumed output token id")
        num_tokens = len(token_ids) + len(resume)
        if not num_tokens:
            raise ValueError("prompt is empty")
        self._check_vocab(token_ids, "prompt token id")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_tokens} tokens; max_model_len is "
                             f"{self.max_model_len} (room for at least one output token is needed)")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate_vocab(self.model_config.vocab_size)
        if params.stop and not self.outputs.detokenize:
            # Matched on the text, which is not made: the request ran to max_tokens.
            raise ValueError("stop strings need detokenized output: this engine has "
                             "detokenize=False, or its model no tokenizer (use "
                             "stop_token_ids)")
        if params.priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {params.priority} needs an engine with scheduling "
                             "policy priority (--scheduling-policy priority)")

    def _check_vocab(self, token_ids, what: str) -> None:
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"{what} {t!r} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    resume_token_ids: list[int] = (), stream_interval: int = 1) -> list[int]:
        """Validates and queues a request; returns its prompt token ids.

        ``resume_token_ids`` continues a request that already produced those output tokens
        elsewhere (a migration): their KV is recomputed with the prompt's, as after a
        preemption, and sampling goes on from output number ``len(resume_token_ids)``.
        ``stream_interval``: after its first output, the request makes one per this many
        tokens (and its final one), each carrying every token since the last.
        """
        params = params if params is not None else SamplingParams()
        check_stream_interval(stream_interval)
        token_ids = self.tokenize(prompt)
        replay = self.validate_resume(token_ids, resume_token_ids, params)
        req = Request(request_id, token_ids, params, output_token_ids=replay.output_token_ids,
                      bad_words_token_ids=tokenize_bad_words(self.tokenizer, params.bad_words),
                      guide=self.guides.cursor(params, replay.output_token_ids),
                      stream_interval=stream_interval, detokenizer=replay.detokenizer)
        self._claim_id(request_id)
        self._inbox.put(("add", req))
        return token_ids

    def validate_resume(self, prompt_token_ids: list[int], resume_token_ids,
                        params: SamplingParams) -> Replay:
        """Validates a prompt and the output it resumes from (possibly none), replayed."""
        resume = list(resume_token_ids)
        self.validate_prompt(prompt_token_ids, params, resume)
        if resume and len(resume) >= params.max_tokens:
            raise ValueError(f"{len(resume)} resumed output tokens leave nothing to generate "
                             f"(max_tokens={params.max_tokens})")
        replay = self.outputs.replay(list(prompt_token_ids), resume, params)
        if replay.ended is not None:
            raise ValueError(f"the resumed output has ended already: {replay.ended}")
        return replay

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now when the engine is idle, else at the next step."""
        self._inbox.put(("abort", request_id))
        self._apply_if_idle()

    def release_kv(self, request_id: str) -> None:
        """Prefill role: the reader has the blocks; give them back."""
        self._inbox.put(("release", request_id))
        self._apply_if_idle()

    def quarantine_kv(self, request_id: str) -> None:
        """Decode role: a failed pull may still write into this request's blocks. The request
        ends (aborted) now; its blocks, and its id, stay out of use for ``kv_quarantine_s``."""
        self._inbox.put(("quarantine", request_id))
        self._apply_if_idle()

    def _apply_if_idle(self) -> None:
        if self._lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self._lock.release()

    def _claim_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        with self._ids_lock:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            self._ids.add(request_id)

    def _release_id(self, request_id: str) -> None:
        with self._ids_lock:
            self._ids.discard(request_id)

    # --- decode role ----------------------------------------------------------------------
    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              first_token_id: int, params: SamplingParams,
                              resume_token_ids: list[int] = (),
                              stream_interval: int = 1) -> KVAllocation:
        """Allocates blocks for a prompt whose KV will be written from outside.

        Leading blocks this engine already holds in its prefix cache are reused; the caller
        fills ``block_ids_to_fill`` and then calls ``commit_prefilled`` (or ``abort``). A
        migrated request's ``resume_token_ids`` follow the prompt in the KV written.
        ``stream_interval``: as for ``add_request``.
        """
        check_stream_interval(stream_interval)
        self._check_vocab([first_token_id], "first token id")
        replay = self.validate_resume(prompt_token_ids,
                                      list(resume_token_ids) + [first_token_id], params)
        req = Request(request_id, list(prompt_token_ids), params,
                      output_token_ids=replay.output_token_ids,
                      bad_words_token_ids=tokenize_bad_words(self.tokenizer, params.bad_words),
                      guide=self.guides.cursor(params, replay.output_token_ids),
                      stream_interval=stream_interval, detokenizer=replay.detokenizer)
        req.prompt_logprobs = None  # the prompt was computed, and scored, where it ran
        self._claim_id(request_id)
        n = req.num_tokens - 1  # everything before first_token_id
        with self._lock:
            # An abort queued for an earlier request under this id (its caller left as it
            # ended, while a step ran) applies to that one: applied at the next step, after
            # this allocation, it would end this request.
            self._drain_inbox()
            try:
                computed = self.kv_manager.get_computed_blocks(req)
                cached = min(computed.num_computed_tokens, n)
                allocated = self.kv_manager.allocate_slots(req, n - cached, computed,
                                                           cache_blocks=False)
            except BaseException:  # the id and any block must not stay taken for nobody
                self._drop_allocation(req)
                raise
            if allocated is None:
                self._drop_allocation(req)
                raise NoFreeBlocksError(f"no room for {n} tokens "
                                        f"({self.kv_manager.num_free_blocks} free blocks)")
            req.num_cached_tokens = cached
            self._awaiting_kv[request_id] = req
            return KVAllocation(request_id, list(self.kv_manager.get_block_ids(request_id)),
                                cached, n, self.block_size)

    def _drop_allocation(self, req: Request) -> None:
        """Frees a decode-role allocation that failed, and its id. Its block hashes, kept by
        id, would otherwise be taken for those of the next prompt under that id: wrong KV
        from the prefix cache."""
        self.kv_manager.free(req)
        self._release_id(req.request_id)

    def commit_prefilled(self, request_id: str) -> None:
        """The prompt KV is in place: admit the request into the continuous batch."""
        with self._lock:
            req = self._awaiting_kv.pop(request_id, None)
            if req is None:
                raise ValueError(f"request {request_id!r} is not waiting for KV")
            req.num_computed_tokens = req.num_tokens - 1
            self.kv_manager.cache_blocks(req, req.num_computed_tokens)
            # Until its "admit" is drained it is in neither the scheduler nor _awaiting_kv:
            # an abort meanwhile (another thread's cancel) must still find it here.
            self._admitting[request_id] = req
        self._inbox.put(("admit", req))

    # --- stepping -------------------------------------------------------------------------
    @property
    def num_leases(self) -> int:
        """Requests whose blocks are leased to a reader (prefill role); safe from any thread."""
        return len(self._leases)

    def check_health(self) -> None:
        """Raises once this engine can no longer step (engine.executor.Executor.check_health)."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return (not self._inbox.empty() or self.scheduler.has_unfinished()
                or bool(self._owed_outputs))

    def step(self) -> list[RequestOutput]:
        with self._lock:
            self._drain_inbox()
            self._expire_leases()
            outputs, self._owed_outputs = self._owed_outputs, []
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return outputs
            try:
                if self.on_scheduled is not None:
                    self.on_scheduled(self)
                inp = prepare_input(sched, self.block_size, self.device)
                # [num_sampled + prompt logprob rows, vocab]
                logits = self.executor.execute_model(inp)
                num_sampled = len(inp.sample_request_ids)
                if inp.prompt_logprob_rows:  # before the first token's output, which has them
                    scored = score_prompt_tokens(logits[num_sampled:], inp.prompt_logprob_rows,
                                                 self.scheduler.requests)
                    self.outputs.decode_logprobs(scored)
                # Sample before the scheduler moves the requests past this step.
                out = None if not num_sampled else sample_tokens(
                    self.sampler, logits[:num_sampled], sched, self.device)
            except BaseException:
                # An interrupted step (Ctrl-C in a notebook, a CUDA OOM) left blocks cached
                # whose KV it never wrote: a later prompt with their prefix read them.
                self.scheduler.undo(sched)
                self._owed_outputs[:0] = outputs
                raise
            self.scheduler.update_after_step(sched)
            self.num_steps += 1
            self.step_num_tokens.append(sched.num_scheduled_tokens)
            self.step_num_sampled.append(len(inp.sample_request_ids))
            if out is None:
                return outputs
            try:
                for i, rid in enumerate(inp.sample_request_ids):
                    req = self.scheduler.requests[rid]
                    output = self._on_token(req, out.token_ids[i], out.logprobs[i])
                    if output is not None:
                        outputs.append(output)
            except BaseException:
                self._unadvance_tokenless(sched)
                self._owed_outputs[:0] = outputs
                raise
            return outputs

    def _unadvance_tokenless(self, sched) -> None:
        """After an interrupted hand-out of a step's tokens (Ctrl-C in a notebook, a
        detokenizer error): a request advanced past the step whose token was never appended
        would be scheduled no new token ever again, holding its blocks for good. It computes
        the step's tokens again (their KV, written by the step, is rewritten the same)."""
        for s in sched.scheduled:
            req = s.request
            if req.request_id in self.scheduler.requests \
                    and req.num_computed_tokens >= req.num_tokens:
                req.num_computed_tokens -= s.num_new_tokens

    def _on_token(self, req: Request, token_id: int, logprobs) -> RequestOutput | None:
        """The request's output for this token: None while its stream interval holds it."""
        decision = self.outputs.append_token(req, token_id, logprobs)
        if decision.status is not None:
            req.stop_reason = decision.stop_reason
            self._finish(req, decision.status)
            return self._final(req)
        if self.config.role == "prefill":
            return self._lease(req)
        if not self.outputs.output_due(req):
            return None
        return self.outputs.make_output(req, finished=False)

    def _final(self, req: Request) -> RequestOutput:
        out = self.outputs.make_output(req, finished=True)
        self.outputs.remove(req.request_id)
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._release_id(req.request_id)

    def _lease(self, req: Request) -> RequestOutput:
        self.scheduler.finish(req, RequestStatus.LEASED, free_blocks=False)
        lease = KVLease(req.request_id, list(self.kv_manager.get_block_ids(req.request_id)),
                        req.num_tokens - 1, self.block_size,
                        time.monotonic() + self.config.kv_lease_timeout_s)
        self._leases[req.request_id] = _Lease(req, lease)
        if self.kv_connector is not None:  # a reader comes next: the owner must be polling
            self.kv_connector.agent.reads_due_soon()
        out = self.outputs.make_output(req, finished=False, kv_lease=lease)
        self.outputs.remove(req.request_id)
        return out

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "admit":
                # Aborted between its commit and now, and maybe its id taken again since: only
                # the very request its commit admitted goes in (the old one ran on the new
                # one's blocks, under its id, and the new one's admit found nothing).
                if self._admitting.get(arg.request_id) is not arg:
                    continue
                del self._admitting[arg.request_id]
            if kind == "add" or kind == "admit":
                self.scheduler.add_request(arg)
                self.outputs.add_request(arg)
            elif kind == "abort":
                self._abort_now(arg)
            elif kind == "release":
                self._release_now(arg)
            elif kind == "quarantine":
                self._quarantine_now(arg)

    def _abort_now(self, request_id: str) -> None:
        if request_id in self._leases:
            self._release_now(request_id)
            return
        req = (self.scheduler.requests.get(request_id) or self._awaiting_kv.pop(request_id, None)
               or self._admitting.pop(request_id, None))
        if req is None:
            return
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._owed_outputs.append(self._final(req))

    def _quarantine_now(self, request_id: str) -> None:
        req = self._awaiting_kv.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED, free_blocks=False)
        self._owed_outputs.append(self._final(req))
        self._quarantined[request_id] = (req, time.monotonic() + self.config.kv_quarantine_s)

    def _release_now(self, request_id: str, expired: bool = False) -> None:
        held = self._leases.pop(request_id, None)
        if held is not None:
            self.kv_manager.free(held.request)
            self._release_id(request_id)
            if self.kv_manager.pool.record_events:  # taken with the block events
                self._lease_events.append(LeaseEnded(request_id, expired))

    def reclaim_expired_leases(self) -> None:
        """Frees expired leases now if no step is running (an idle engine still reclaims)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_inbox()
                self._expire_leases()
            finally:
                self._lock.release()

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, until) in self._quarantined.items() if until <= now]:
            req, _ = self._quarantined.pop(rid)
            self.kv_manager.free(req)
            self._release_id(rid)
        if not self._leases:
            return
        for rid in [r for r, h in self._leases.items() if h.lease.expires_at <= now]:
            self._release_now(rid, expired=True)
            self.num_expired_leases += 1

    def enable_kv_events(self) -> None:
        """Records block-stored/removed events from now on, for ``take_kv_events`` (a served
        engine, whose worker publishes them to the prefix index). Call before the first step."""
        self.kv_manager.pool.record_events = True

    def take_kv_events(self) -> list:
        """Block-stored/removed events since the last call (for a prefix index elsewhere),
        then the leases ended since (``LeaseEnded``, for the transfer ledger). Under the step
        lock: decode-role allocation threads touch the pool too."""
        with self._lock:
            events = self.kv_manager.take_events()
            if self._lease_events:
                events += self._lease_events
                self._lease_events = []
            return events

    def cached_block_hashes(self) -> list:
        """The prefix cache's block hashes now; under the step lock, like the events."""
        with self._lock:
            return self.kv_manager.cached_block_hashes()

    def reset_prefix_cache(self) -> PrefixCacheReset:
        """Forgets every cached prefix block (vLLM's reset_prefix_cache): later prompts compute
        their KV afresh. Refused while any block is held (running requests, KV leases,
        quarantined pulls); the removals come out of ``take_kv_events``."""
        with self._lock:
            self._drain_inbox()  # releases and aborts already asked for free their blocks first
            return self.kv_manager.reset_prefix_cache()

    # --- introspection --------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        with self._lock:
            # An abort, release or quarantine queued on an idle engine can miss its drain: its
            # try-lock fails while another thread holds the lock briefly (the KV connector's
            # poller), and that holder has drained already. Applied here, stats show every
            # call that returned before this one.
            self._drain_inbox()
            s = self.kv_manager.stats
            return EngineStats(
                num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
                num_leased=len(self._leases), num_free_blocks=self.kv_manager.num_free_blocks,
                num_total_blocks=self.num_blocks, prefix_cache_queries=s.queries,
                prefix_cache_hits=s.hits, prefix_cache_evictions=s.evictions,
                prefix_cache_partial_hits=s.partial_hits,
                num_preemptions=self.scheduler.num_preemptions,
                num_expired_leases=self.num_expired_leases, num_steps=self.num_steps,
                num_quarantined=len(self._quarantined))

    # --- lifecycle ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the TP worker processes; the engine cannot step afterwards. Idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
