"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch stays out of the request's import
    from engine.penalties import PenaltyState
    from engine.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Prefill role: prompt computed, first token sampled, blocks held for a remote reader.
    LEASED = "leased"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # When a step first computed any of this request's tokens (queue time ends there).
    first_scheduled_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V is in the cache (computed here, hit in the prefix cache, or written
    # from outside in the decode role).
    num_computed_tokens: int = 0
    # Prefix-cache hit length found when the request was first scheduled.
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Logprobs per output token, filled when sampling_params.logprobs is set.
    logprobs: list = field(default_factory=list)
    # Token counts for the penalties (engine/penalties.py), once it has sampled with them.
    penalty_state: PenaltyState | None = field(default=None, repr=False, compare=False)
    # When sampling_params asks: [None] (the first prompt token has none), then the logprobs
    # of prompt tokens 1.. as the prefill computes them; None otherwise, and where the prompt
    # was computed elsewhere (the decode role). Outputs hand out this list once complete.
    prompt_logprobs: list | None = field(default=None, repr=False, compare=False)
    # sampling_params.bad_words as token sequences (engine/bad_words.py), set at intake.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False,
                                                 compare=False)
    # Its guide's cursor (engine/guides.py: guided_choice, guided_regex, guided_json), set at
    # intake; None without one.
    guide: object | None = field(default=None, repr=False, compare=False)
    # Outputs are made once per this many new tokens after the first (and on finishing): a
    # stream that sends N tokens a chunk need not wake its reader every step.
    stream_interval: int = 1
    # Its output so far as text, detokenized at intake (OutputProcessor.replay) for the
    # output processor to take over; None once taken.
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt_logprobs is None and self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list: per-step
        callers would otherwise copy every long prompt each time."""
        p = self.prompt_token_ids
        if stop <= len(p):
            return p[start:stop]
        o = self.output_token_ids
        if start >= len(p):
            return o[start - len(p):stop - len(p)]
        return p[start:] + o[:stop - len(p)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet (the prefill must then
        run every prompt token: prefix-cache hits would skip some)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
