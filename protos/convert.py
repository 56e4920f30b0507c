"""Conversions between the protos and the engine's dataclasses (both directions)."""
from __future__ import annotations

from engine.logprobs import Logprob, TokenLogprobs
from engine.sampling_params import SamplingParams
from protos import common_pb2

# Wire ids are int64 so that negative or huge ids arrive intact and get a clear error.
_MAX_TOKEN_ID = 2**31 - 1


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams; unset optional fields keep the engine defaults. ValueError if bad."""
    kw: dict = {}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs",
                 "skip_special_tokens", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "min_tokens", "priority", "prompt_logprobs"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    kw["stop"] = list(msg.stop)
    kw["stop_token_ids"] = list(msg.stop_token_ids)
    kw["ignore_eos"] = msg.ignore_eos
    kw["include_stop_str_in_output"] = msg.include_stop_str_in_output
    kw["logit_bias"] = dict(msg.logit_bias)
    kw["allowed_token_ids"] = list(msg.allowed_token_ids)
    kw["bad_words"] = list(msg.bad_words)
    kw["guided_choice"] = list(msg.guided_choice)
    for name in ("guided_regex", "guided_json", "guided_whitespace_pattern"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    return SamplingParams(**kw)


def fill_sampling_defaults(msg: common_pb2.SamplingParams, defaults: dict) -> None:
    """Sets the fields msg leaves unset to ``defaults`` (the model's recommended ones,
    engine/generation_defaults.py)."""
    for name, value in defaults.items():
        if not msg.HasField(name):
            setattr(msg, name, value)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        min_p=p.min_p, stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens, logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
        priority=p.priority, bad_words=p.bad_words, guided_choice=p.guided_choice,
        guided_regex=p.guided_regex, guided_json=p.guided_json,
        guided_whitespace_pattern=p.guided_whitespace_pattern)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


# A worker's request ids: the router's (at most 256 characters) with its suffixes (a nonce,
# ".mN" per migration, "/i" per sequence); a caller's longer one is refused rather than kept
# (a ReleaseKV's unknown id is remembered) and copied into every stream event and Redis.
MAX_WORKER_REQUEST_ID_CHARS = 1024


def check_request_id(request_id: str) -> str:
    """A request id a worker is called with: non-empty and bounded (ValueError otherwise)."""
    if not request_id:
        raise ValueError("request_id is empty")
    if len(request_id) > MAX_WORKER_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is {len(request_id)} characters; at most "
                         f"{MAX_WORKER_REQUEST_ID_CHARS}")
    return request_id


def check_token_ids(ids, what: str = "prompt") -> list[int]:
    """Plain ints in [0, 2**31); the engine checks them against the vocabulary."""
    ids = list(ids)
    for t in ids:
        if not 0 <= t <= _MAX_TOKEN_ID:
            raise ValueError(f"{what} token id {t} is out of range")
    return ids


def check_prompt_token_ids(ids) -> list[int]:
    """A worker request's prompt: ``check_token_ids``, and not empty (a resumed request's
    output or a first token does not stand in for it)."""
    ids = check_token_ids(ids)
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    return ids


def _logprob_to_proto(lp: Logprob) -> common_pb2.Logprob:
    return common_pb2.Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                              token=lp.decoded_token or "")


def logprobs_to_proto(items: list[TokenLogprobs] | None) -> list[common_pb2.TokenLogprobs]:
    if not items:
        return []
    return [common_pb2.TokenLogprobs(sampled=_logprob_to_proto(t.sampled),
                                     top=[_logprob_to_proto(x) for x in t.top]) for t in items]


def prompt_logprobs_to_proto(items: list[TokenLogprobs | None] | None
                             ) -> list[common_pb2.TokenLogprobs]:
    """The engine's [None, lp_1, ...] as the wire's lp_1, ... (empty when not asked)."""
    return logprobs_to_proto(items[1:] if items else None)


def logprobs_from_proto(items) -> list[TokenLogprobs]:
    def one(m: common_pb2.Logprob) -> Logprob:
        return Logprob(token_id=m.token_id, logprob=m.logprob, rank=m.rank,
                       decoded_token=m.token or None)

    return [TokenLogprobs(sampled=one(t.sampled), top=[one(x) for x in t.top]) for t in items]


def stop_reason_to_proto(reason: int | str | None) -> common_pb2.StopReason | None:
    if reason is None:
        return None
    if isinstance(reason, str):
        return common_pb2.StopReason(stop_string=reason)
    return common_pb2.StopReason(stop_token_id=int(reason))


def stop_reason_from_proto(msg: common_pb2.StopReason | None) -> int | str | None:
    if msg is None:
        return None
    which = msg.WhichOneof("reason")
    return None if which is None else getattr(msg, which)
