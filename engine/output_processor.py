"""Per-request text and stop conditions: turns sampled tokens into RequestOutputs."""
from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.logprobs import TokenLogprobs
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

# The most tokens one output may hold back (a stream interval past this is a mistake, and its
# chunks would approach gRPC's message size limit with logprobs).
MAX_STREAM_INTERVAL = 1024


def check_stream_interval(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STREAM_INTERVAL:
        raise ValueError(f"stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                         f"got {n!r}")


@dataclass
class StopDecision:
    status: RequestStatus | None  # None: keep going
    stop_reason: int | str | None = None


@dataclass
class Replay:
    """A request's output so far, replayed at intake (OutputProcessor.replay)."""
    output_token_ids: list[int]
    # Holding the text of output_token_ids; None where the engine does not detokenize, or
    # where the output has ended.
    detokenizer: IncrementalDetokenizer | None
    # What ended the output already, or None.
    ended: str | None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int],
                 max_model_len: int, detokenize: bool) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenize = detokenize and tokenizer is not None
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Output tokens already reported per request (streams report deltas).
        self._reported: dict[str, int] = {}
        # Requests that have made no output yet: their first leaves at once, whatever their
        # stream interval (it carries the first token, or the decode role's first timings).
        self._unreported: set[str] = set()

    def add_request(self, req: Request) -> None:
        self._reported[req.request_id] = len(req.output_token_ids)
        self._unreported.add(req.request_id)
        detok, req.detokenizer = req.detokenizer, None
        if self.detokenize and detok is None:
            detok = self.replay(req.prompt_token_ids, req.output_token_ids,
                                req.sampling_params).detokenizer
        if detok is not None:
            self.detokenizers[req.request_id] = detok

    def remove(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self._reported.pop(request_id, None)
        self._unreported.discard(request_id)

    def output_due(self, req: Request) -> bool:
        """Whether an unfinished request makes an output this step: its first, then one per
        ``req.stream_interval`` tokens. Held tokens (and their text) go out with the next."""
        rid = req.request_id
        if req.stream_interval <= 1 or rid in self._unreported:
            return True
        return req.num_output_tokens - self._reported.get(rid, 0) >= req.stream_interval

    def append_token(self, req: Request, token_id: int, logprobs: TokenLogprobs | None) -> StopDecision:
        """Records one sampled token, updates text, and decides whether the request stops."""
        req.append_output_token(token_id)
        if logprobs is not None:
            self.decode_logprobs([logprobs])
            req.logprobs.append(logprobs)
        params = req.sampling_params
        detok = self.detokenizers.get(req.request_id)
        stop_token, eos = self._ends(token_id, req.num_output_tokens, params)
        # As a stop string's, a stop token's text (eos's too) stays out of the text unless
        # include_stop_str_in_output (vLLM's rule); its id is in token_ids all the same.
        if detok is not None and (params.include_stop_str_in_output or not (stop_token or eos)):
            detok.update([token_id])
        if stop_token:
            return StopDecision(RequestStatus.FINISHED_STOPPED, token_id)
        if eos:
            return StopDecision(RequestStatus.FINISHED_STOPPED, None)
        if detok is not None and params.stop:
            hit = _check_stop_strings(detok, params, req.num_output_tokens)
            if hit is not None:
                return StopDecision(RequestStatus.FINISHED_STOPPED, hit)
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return StopDecision(RequestStatus.FINISHED_LENGTH)
        return StopDecision(None)

    def _ends(self, token_id: int, num_output_tokens: int, params) -> tuple[bool, bool]:
        """Whether output token number ``num_output_tokens`` is a stop token, and whether it
        is an eos that ends the output. Neither ends it within min_tokens (as stop strings do
        not): the sampler bans them there, but lifts its bans when they would leave nothing
        to sample (allowed_token_ids=[eos])."""
        if num_output_tokens <= params.min_tokens:
            return False, False
        return (token_id in params.stop_token_ids,
                not params.ignore_eos and token_id in self.eos_token_ids)

    def replay(self, prompt_token_ids: list[int], output_token_ids: list[int],
               params) -> Replay:
        """Output produced elsewhere (the decode role's first token, streamed by the prefill
        worker; a migrated request's output so far), which was streamed already, replayed
        one token at a time as it was produced: that leaves exactly the text the client has
        not received yet pending (in one batch, a tail held back there, an unfinished
        character or a possible stop string, would differ from what was held here). Also
        finds what in it would have ended the request already (a stop token, eos or a stop
        string): resuming it would generate past the request's end. Callers replay at intake,
        off the engine's thread, where a long resumed output would stall every stream's step."""
        detok = None
        if self.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
        for n, token_id in enumerate(output_token_ids, 1):
            stop_token, eos = self._ends(token_id, n, params)
            if stop_token or eos:
                return Replay(output_token_ids, None, f"output token {n} ({token_id}) is "
                                                      f"{'a stop token' if stop_token else 'eos'}")
            if detok is None:
                continue
            detok.update([token_id])
            if params.stop:
                hit = _check_stop_strings(detok, params, n)
                if hit is not None:
                    return Replay(output_token_ids, None,
                                  f"output token {n} completes the stop string {hit!r}")
            detok.take_delta()
        return Replay(output_token_ids, detok, None)

    def decode_logprobs(self, items: list[TokenLogprobs]) -> None:
        """Sets each Logprob's decoded_token: its token as text on its own, special tokens
        included (unless this engine does not detokenize)."""
        if not self.detokenize:
            return
        decode = self.tokenizer.decode
        for item in items:
            for lp in (item.sampled, *item.top):
                lp.decoded_token = decode([lp.token_id], skip_special_tokens=False)

    def make_output(self, req: Request, finished: bool, kv_lease=None) -> RequestOutput:
        rid = req.request_id
        start = self._reported.get(rid, 0)
        self._reported[rid] = req.num_output_tokens
        self._unreported.discard(rid)
        text = delta = ""
        detok = self.detokenizers.get(rid)
        if detok is not None and finished:
            # A stop token (or eos) kept with include_stop_str_in_output ends the output as it
            # is: its text was cut at a stop string it completed, the stop reason still the
            # token. (Not kept, the flush holds only earlier tokens' text, searched as ever.)
            kept_stop_token = (req.status == RequestStatus.FINISHED_STOPPED
                               and detok.stop_str is None
                               and req.sampling_params.include_stop_str_in_output)
            delta = detok.finish(check_stop=not kept_stop_token)
            text = detok.output_text
            if req.status == RequestStatus.FINISHED_LENGTH and detok.stop_str is not None:
                # The flush let out text held behind an unfinished character, and it holds a
                # stop string: the output ends there, and says so (it said length).
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_str
        elif detok is not None:
            delta = detok.take_delta()
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            new_token_ids=req.output_token_ids[start:],
            text=text,
            text_delta=delta,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
            prompt_logprobs=_prompt_logprobs(req),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            kv_lease=kv_lease,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
        )


def _prompt_logprobs(req: Request) -> list[TokenLogprobs | None] | None:
    if req.prompt_logprobs is None or req.wants_prompt_logprobs:
        return None
    return req.prompt_logprobs  # complete: nothing appends to it any more


def _check_stop_strings(detok: IncrementalDetokenizer, params,
                        num_output_tokens: int) -> str | None:
    """The stop string the newest text completes, once the output is past min_tokens (as in
    vLLM, the token that may end it is number min_tokens + 1, as for stop tokens)."""
    if num_output_tokens <= params.min_tokens:
        detok.skip_stop_check(params.stop)
        return None
    return detok.check_stop(params.stop, params.include_stop_str_in_output)
