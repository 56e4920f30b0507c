"""Per-request sampling parameters, validated when built."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Past ~10 sampling is as good as uniform already; a bound keeps logits / temperature finite in
# float32 (1e39 is a finite Python float but inf there, and -inf / inf is NaN, which wins the
# argmax: a token masked out by allowed_token_ids, min_tokens or bad_words would be sampled).
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20
# Token id lists are walked on the engine thread at every step of the request (a stop check,
# a mask): one request's long list slowed every request's step (20M ids fit a message).
MAX_STOP_TOKEN_IDS = 1024
# Allowed ids are a set of the vocabulary's (duplicates dropped): above any vocabulary in use.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 256
# Each is tokenized (twice) on the worker's event loop as the request is added: 256 words of
# 100 000 characters held it ~20 s, long enough for routers to drop the worker as hung.
MAX_BAD_WORD_CHARS = 1024
# Stop strings are searched for, and their possible beginnings held back, at every token on
# the engine thread: 64 of 1024 characters cost ~0.5 ms a token on a 2-core VM, where
# unbounded ones let one request slow every other (OpenAI's API takes 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# Choices are tokenized as the request is added, and their token sequences matched against
# the output at every step: bounded as bad words are.
MAX_GUIDED_CHOICES = 256
MAX_GUIDED_CHOICE_CHARS = 1024
# Compiled into an automaton where the request is checked (engine/regex_dfa.py, whose build
# budgets keep a check under a second), then walked per token.
MAX_GUIDED_REGEX_CHARS = 16384
MAX_GUIDED_JSON_CHARS = 65536
_GUIDES = ("guided_choice", "guided_regex", "guided_json")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top logprobs to return per output token besides the sampled one's;
    # None: none at all, 0: only the sampled token's.
    logprobs: int | None = None
    # The same for every prompt token after the first (its logprob given the tokens before
    # it); None: none. Such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    # Keep the stop string, or the stop token's (or eos's) text, in the returned text.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # engine/penalties.py: > 1 discourages tokens already in the prompt or output (1: off);
    # subtracted once per token the output has / per occurrence there, in [-2, 2] (0: off).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Until the output has this many tokens, eos and stop_token_ids cannot be sampled and
    # stop strings do not end the request.
    min_tokens: int = 0
    # Added to these token ids' logits before sampling (OpenAI's logit_bias), in [-100, 100].
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these token ids can be sampled (empty: any); e.g. a classifier's label tokens.
    allowed_token_ids: list[int] = field(default_factory=list)
    # Words the output must not contain (engine/bad_words.py); the engine tokenizes them.
    bad_words: list[str] = field(default_factory=list)
    # The output is one of these texts (engine/guided_choice.py); the engine tokenizes them.
    guided_choice: list[str] = field(default_factory=list)
    # The output text fully matches this regular expression (engine/guided_regex.py).
    guided_regex: str | None = None
    # The output is JSON valid under this JSON schema (JSON text, or a dict made into it;
    # engine/json_schema_regex.py says which keywords are followed).
    guided_json: str | None = None
    # With guided_json: a regex of the whitespace allowed around every comma, colon and
    # bracket (vLLM's guided_whitespace_pattern; JSON whitespace only); None: json.dumps's
    # separators and no other whitespace.
    guided_whitespace_pattern: str | None = None
    # Scheduling, not sampling: with an engine's scheduling_policy "priority", lower runs
    # first (vLLM's convention); engines on "fcfs" refuse anything but 0.
    priority: int = 0

    def __post_init__(self) -> None:
        # None, vLLM's default for these, is none of them.
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words",
                     "guided_choice"):
            if getattr(self, name) is None:
                setattr(self, name, [])
        if self.logit_bias is None:
            self.logit_bias = {}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, "
                             f"got {type(self.logit_bias).__name__}")
        self.logit_bias = dict(self.logit_bias)
        self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        if isinstance(self.guided_choice, str):
            self.guided_choice = [self.guided_choice]
        self.guided_choice = list(self.guided_choice)
        if isinstance(self.guided_json, (dict, bool)):
            self.guided_json = json.dumps(self.guided_json)
        self._validate()
        self._validate_guides()
        # The same set, each id once: its mask is built at every step.
        self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, more than "
                             f"{MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
            if not _is_number(b) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for {t}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) \
                or not -2**31 <= self.priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids has {len(self.allowed_token_ids)} ids, more "
                             f"than {MAX_ALLOWED_TOKEN_IDS}")
        for t in self.allowed_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"allowed_token_ids must be non-negative token ids, got {t!r}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(self.bad_words)} entries, more than "
                             f"{MAX_BAD_WORDS}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be strings with a non-space character, "
                                 f"got {w!r}")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"a bad word has {len(w)} characters, more than "
                                 f"{MAX_BAD_WORD_CHARS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings, more than {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters, more than "
                                 f"{MAX_STOP_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids, more than "
                             f"{MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def guide(self) -> str | None:
        """The name of the guide the output follows (guided_choice, ...); None: none."""
        given = [name for name in _GUIDES if getattr(self, name)]
        return given[0] if given else None

    @property
    def has_pattern_guide(self) -> bool:
        """Whether it follows a pattern (guided_regex, or guided_json's), compiled to check."""
        return bool(self.guided_regex or self.guided_json)

    def _validate_guides(self) -> None:
        for name, bound in (("guided_regex", MAX_GUIDED_REGEX_CHARS),
                            ("guided_json", MAX_GUIDED_JSON_CHARS)):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
            if len(value) > bound:
                raise ValueError(f"{name} has {len(value)} characters, more than {bound}")
        given = [name for name in _GUIDES if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"one guide at a time: {' and '.join(given)} were both set")
        if self.guided_whitespace_pattern is not None:
            if not self.guided_json:
                raise ValueError("guided_whitespace_pattern applies to guided_json, which is "
                                 "not set")
            from engine.json_whitespace import check_whitespace_pattern

            check_whitespace_pattern(self.guided_whitespace_pattern)
        self._validate_guided_choice()
        if not given:
            return
        # The output ends with eos once it is whole; ignore_eos would sample past it.
        if self.ignore_eos:
            raise ValueError(f"{given[0]} ends the output at the eos token once it is whole: "
                             "ignore_eos cannot be set with it")
        if self.allowed_token_ids:
            raise ValueError(f"{given[0]} decides the allowed tokens at each step: "
                             "allowed_token_ids cannot be set with it")

    def _validate_guided_choice(self) -> None:
        choices = self.guided_choice
        if not choices:
            return
        if len(choices) > MAX_GUIDED_CHOICES:
            raise ValueError(f"guided_choice has {len(choices)} choices, more than "
                             f"{MAX_GUIDED_CHOICES}")
        for c in choices:
            if not isinstance(c, str) or not c:
                raise ValueError(f"guided_choice must be non-empty strings, got {c!r}")
            if len(c) > MAX_GUIDED_CHOICE_CHARS:
                raise ValueError(f"a guided_choice has {len(c)} characters, more than "
                                 f"{MAX_GUIDED_CHOICE_CHARS}")

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks against the model; called when the request reaches an engine."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary (size {vocab_size})")
        for t in [*self.logit_bias, *self.allowed_token_ids]:
            if t >= vocab_size:
                raise ValueError(f"logit_bias / allowed_token_ids token id {t} is outside the "
                                 f"vocabulary (size {vocab_size})")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k {self.top_k} exceeds the vocabulary size {vocab_size}")


def _is_number(x) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
