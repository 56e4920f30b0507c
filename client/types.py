"""What the SDK hands back: plain dataclasses, no protobuf in user code."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from client.chat import Chat, chat_prompt
from protos import common_pb2, router_pb2

# The keyword arguments generate() and complete() accept (the router's SamplingParams).
SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # 1 = the model's most likely token.
    rank: int
    # The token as text on its own, special tokens included.
    token: str = ""


@dataclass
class TokenLogprobs:
    sampled: Logprob
    top: list[Logprob]


@dataclass
class Timings:
    """Seconds per phase of one request (see the router's RequestTimings)."""

    router_queue_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    first_decode_step_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: Timings
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    # True when the decode worker prefilled the prompt itself (then both ids name it).
    local_prefill: bool = False
    # Times a worker failed under the request and the router continued it elsewhere; the
    # worker ids above name the last ones.
    migrations: int = 0


@dataclass(frozen=True)
class ModelIdentity:
    """Which model a router serves, by content (the router's ModelIdentity): two routers of
    equal identities give a stream the same continuation."""

    name: str
    # "{files}:{weights}": digests of the model's config and tokenizer files and of its weights
    # (nothing after the colon where the router has only the tokenizer).
    fingerprint: str
    # A digest of the chat template chats are rendered with ("" for none).
    chat_template: str


@dataclass
class GenerationChunk:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Final chunk only: "stop", "length" or "abort", the stop token/string, and usage.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    # Which sequence it belongs to when the request asked for n > 1 (0 otherwise).
    index: int = 0
    # With prompt_logprobs, on sequence 0's first chunk (vLLM's shape): None for the first
    # prompt token, which nothing precedes, then each prompt token's logprob given the ones
    # before it, with its rank and top tokens ([None] for a one-token prompt, as in process).
    # None elsewhere.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # On the stream's first chunk: the model that answers (None on the others). A stream
    # that fails over goes on only on a router of this model.
    model: ModelIdentity | None = None


@dataclass
class Choice:
    """One of a request's n sequences, whole."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    usage: Usage
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class Completion:
    """The whole result: every sequence in index order in ``choices`` (n of them; one when
    n = 1), and sequence 0's fields directly (``token_ids``, ``text``, ...)."""

    request_id: str
    choices: list[Choice]
    # The request's: with n > 1 the prompt counted once and completion tokens summed over the
    # choices (OpenAI's and vLLM's usage), each choice's own in ``choices``. n = 1: choice 0's.
    usage: Usage
    # With prompt_logprobs: as on GenerationChunk (they belong to the prompt, not a choice).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The model that answered (None from a router older than this field).
    model: ModelIdentity | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.choices[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self.choices[0].logprobs


# What generate() and complete() take as the prompt.
Prompt = str | list[int] | list[Mapping[str, str]] | Chat


@dataclass
class Tokenized:
    token_ids: list[int]
    # The longest prompt plus output the workers take (0 while the router knows none).
    max_model_len: int


@dataclass
class ModelInfo:
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    has_chat_template: bool
    # Only the sampling fields the model recommends (its generation_config.json).
    sampling_defaults: dict
    eos_token_ids: list[int]
    # What a stream's first chunk names (None from a router older than this field).
    identity: ModelIdentity | None = None
    # The model's named chat templates, where it ships several (Chat.chat_template_name).
    chat_template_names: list[str] = field(default_factory=list)
    # Whether a chat may bring its own template (Chat.chat_template).
    accepts_request_chat_template: bool = False


def _set_chat(req, prompt: Chat | Sequence[Mapping[str, str]]) -> None:
    req.chat.SetInParent()  # an empty conversation still says it is one
    req.chat.CopyFrom(_chat_prompt(prompt if isinstance(prompt, Chat) else Chat(prompt)))


def _chat_prompt(chat: Chat) -> router_pb2.ChatPrompt:
    return chat_prompt(chat, _sendable_text)


def build_request(prompt: Prompt, request_id: str | None, sampling: dict,
                  expect_model: ModelIdentity | None = None) -> router_pb2.GenerateRequest:
    """``expect_model``: only a router of this model may answer (GenerateRequest.expect_model);
    the client tries its others while one refuses."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling arguments: {', '.join(sorted(unknown))} "
                        f"(accepted: {', '.join(sorted(SAMPLING_FIELDS))})")
    if request_id is not None and not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    # A lone string is one entry, as SamplingParams takes it: protobuf would take each of
    # its characters as an entry (every "h", "e", ... banned for bad_words="hello").
    for name in ("stop", "bad_words", "guided_choice"):
        if isinstance(sampling.get(name), str):
            sampling = {**sampling, name: [sampling[name]]}
    # A schema goes as JSON text: a dict (a pydantic model's model_json_schema()) is sent so.
    if isinstance(sampling.get("guided_json"), (dict, bool)):
        sampling = {**sampling, "guided_json": json.dumps(sampling["guided_json"])}
    given = {k: v for k, v in sampling.items() if v is not None}
    try:
        params = common_pb2.SamplingParams(**given)
    except (ValueError, TypeError, OverflowError) as e:  # overflow: 2**1100 as a double
        raise ValueError(f"sampling argument {_misfit(given)} cannot be sent: {e}") from None
    req = router_pb2.GenerateRequest(
        request_id=_sendable_text(request_id, "request_id") if request_id else "",
        sampling=params)
    if expect_model is not None:
        if not isinstance(expect_model, ModelIdentity):
            raise TypeError("expect_model must be a ModelIdentity (a stream's chunk.model, "
                            f"Completion.model or ModelInfo.identity), got {expect_model!r}")
        req.expect_model.CopyFrom(router_pb2.ModelIdentity(
            name=expect_model.name, fingerprint=expect_model.fingerprint,
            chat_template=expect_model.chat_template))
    if isinstance(prompt, str):
        req.text = _sendable_text(prompt, "the prompt")
    elif isinstance(prompt, Chat) or (isinstance(prompt, (list, tuple)) and prompt
                                      and all(isinstance(m, Mapping) for m in prompt)):
        _set_chat(req, prompt)
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.token_ids.ids.extend(_sendable_ids(prompt, "prompt"))
    else:
        raise TypeError("prompt must be a str, a list of token ids (int, not bool), a list of "
                        "chat messages or a Chat")
    return req


def _sendable_ids(token_ids, what: str):
    """``token_ids`` unless one is past the messages' int64 (protobuf's own error names
    neither the field nor the id; the router judges the vocabulary)."""
    bad = next((t for t in token_ids if not -(1 << 63) <= t < (1 << 63)), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} cannot be sent: it is not a 64-bit integer")
    return token_ids


def _sendable_text(text: str, what: str) -> str:
    """``text`` unless protobuf cannot encode it as UTF-8 (a lone surrogate, as from a
    mis-decoded file): then a ValueError that says which text and where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end]
        if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
            # How Python decodes bytes that are not UTF-8 in argv, the environment or file
            # names (surrogateescape): the user knows the byte, not the surrogate.
            found = (f"{'byte' if len(bad) == 1 else 'bytes'} "
                     f"{' '.join(f'0x{ord(c) - 0xDC00:02x}' for c in bad)} at character "
                     f"{e.start}: not UTF-8; is the text in another encoding?")
        else:
            found = f"{e.reason}: {bad!r} at character {e.start}"
        raise ValueError(f"{what} cannot be sent: it is not valid Unicode text ({found})") \
            from None
    return text


def _misfit(given: dict) -> str:
    """The first of ``given``'s fields the request message refuses (out of its integer range,
    of the wrong type), as ``name=value``: protobuf's own error does not name it."""
    for k, v in given.items():
        try:
            common_pb2.SamplingParams(**{k: v})
        except (ValueError, TypeError, OverflowError):
            return f"{k}={v!r}"
    return "?"


def tokenize_request(prompt: str | list | Chat) -> router_pb2.TokenizeRequest:
    req = router_pb2.TokenizeRequest()
    if isinstance(prompt, str):
        req.text = _sendable_text(prompt, "the text")
    elif isinstance(prompt, Chat) or (isinstance(prompt, (list, tuple))
                                      and all(isinstance(m, Mapping) for m in prompt)):
        _set_chat(req, prompt)
    else:
        raise TypeError("tokenize takes a str, a list of chat messages or a Chat")
    return req


def detokenize_request(token_ids: list[int],
                       skip_special_tokens: bool) -> router_pb2.DetokenizeRequest:
    if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise TypeError("detokenize takes a list of token ids")
    return router_pb2.DetokenizeRequest(token_ids=_sendable_ids(token_ids, "detokenize"),
                                        skip_special_tokens=skip_special_tokens)


def model_info_from_proto(m: router_pb2.ModelInfo) -> ModelInfo:
    defaults = {f.name: v for f, v in m.sampling_defaults.ListFields()}
    return ModelInfo(m.model, m.vocab_size, m.max_model_len, m.block_size, m.has_chat_template,
                     defaults, list(m.eos_token_ids), _identity(m, "identity"),
                     list(m.chat_template_names), m.accepts_request_chat_template)


def _identity(m, name: str) -> ModelIdentity | None:
    """The ModelIdentity in ``m``'s field ``name``, if set."""
    if not m.HasField(name):
        return None
    i = getattr(m, name)
    return ModelIdentity(i.name, i.fingerprint, i.chat_template)


def _logprobs(items) -> list[TokenLogprobs]:
    def one(m) -> Logprob:
        return Logprob(m.token_id, m.logprob, m.rank, m.token)

    return [TokenLogprobs(one(t.sampled), [one(x) for x in t.top]) for t in items]


def _prompt_logprobs(items, scored: bool) -> list[TokenLogprobs | None] | None:
    """``scored``: the message carries the prompt's logprobs. The wire has prompt tokens 1..
    only, so a one-token prompt's are an empty list there, which cannot say so itself."""
    return [None, *_logprobs(items)] if items or scored else None


def _stop(msg, has: bool) -> int | str | None:
    if not has:
        return None
    which = msg.WhichOneof("reason")
    return None if which is None else getattr(msg, which)


def _usage(u) -> Usage:
    t = u.timings
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                 Timings(**{f: getattr(t, f) for f in Timings.__dataclass_fields__}),
                 u.prefill_worker_id, u.decode_worker_id, u.local_prefill, u.migrations)


def chunk_from_proto(m: router_pb2.GenerateChunk,
                     scored_prompt: bool = False) -> GenerationChunk:
    """``scored_prompt``: it is the first chunk of sequence 0 of a request that asked for
    prompt_logprobs (and not a continuation, which carries none)."""
    return GenerationChunk(
        request_id=m.request_id, token_ids=list(m.token_ids), text=m.text_delta,
        logprobs=_logprobs(m.logprobs), finish_reason=m.finish_reason or None,
        stop_reason=_stop(m.stop_reason, m.HasField("stop_reason")),
        usage=_usage(m.usage) if m.HasField("usage") else None, index=m.index,
        prompt_logprobs=_prompt_logprobs(m.prompt_logprobs, scored_prompt),
        model=_identity(m, "model"))


def _choice(m, index: int) -> Choice:
    return Choice(index=index, token_ids=list(m.token_ids), text=m.text,
                  finish_reason=m.finish_reason,
                  stop_reason=_stop(m.stop_reason, m.HasField("stop_reason")),
                  usage=_usage(m.usage), logprobs=_logprobs(m.logprobs))


def completion_from_proto(m: router_pb2.CompleteResponse, request_id: str = "",
                          moves: int = 0, scored_prompt: bool = False) -> Completion:
    """``request_id``: the caller's (a retry went out under ``<id>~rN``, the caller's all the
    same); ``moves``: the client's failovers, counted in every choice's migrations (each
    sequence moved), and the request's summed over them, as the router sums its own;
    ``scored_prompt``: the request asked for prompt_logprobs."""
    choices = [_choice(c, c.index) for c in m.choices]
    if not choices:  # n = 1: the request's usage is its one sequence's
        choices = [_choice(m, 0)]
        usage = choices[0].usage
    else:
        usage = _usage(m.usage)
        for c in choices:
            c.usage.migrations += moves
        moves *= len(choices)
    usage.migrations += moves
    return Completion(request_id or m.request_id, choices, usage,
                      _prompt_logprobs(m.prompt_logprobs, scored_prompt),
                      _identity(m, "model"))
