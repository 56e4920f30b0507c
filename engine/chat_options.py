"""What a chat request asks of the template besides its messages, as vLLM's chat API names
it: ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` (extra
variables the template reads, e.g. Qwen3's ``enable_thinking``), ``tools`` (the functions the
model may call, engine/chat_tools.py) and, for a model shipping several named templates,
which one renders (``chat_template_name``). Checked here, once, for
``LLM.chat`` and the router alike; every refusal is a ValueError (INVALID_ARGUMENT).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.chat_tools import check_tools
from engine.json_values import json_size, plain_json

# chat_template_kwargs are rendered into every prompt of the request and travel in it: their
# JSON may be this large at most, and nest this deep (a template reads flags and small
# settings, not documents).
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_TEMPLATE_KWARGS_DEPTH = 16
# Names the renderer sets itself: the arguments of transformers' render_jinja_template and
# what it hands the template (messages, its globals), and the special tokens' strings. A
# kwarg of one of these names would replace the conversation or the flags above, or the
# model's own turn markers, behind the request's back. "self": jinja2's Template.render takes
# the variables as **kwargs beside it, so that name fails the call itself (a TypeError, an
# INTERNAL error, not the request's).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "messages", "conversation", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
    "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens"})


@dataclass(frozen=True)
class ChatOptions:
    # None: True, unless continue_final_message (which leaves the last message open instead).
    # vLLM refuses continue_final_message alone (its default here is True); pdserve has taken
    # it alone since before this flag, and refuses only both set True.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # One of the model's named templates; None: its "default" (or its only one).
    chat_template_name: str | None = None
    # OpenAI's tool specs the template renders (engine/chat_tools.py); None: no tools.
    tools: Sequence[Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not (self.add_generation_prompt is None
                or isinstance(self.add_generation_prompt, bool)):
            raise ValueError(f"add_generation_prompt must be true or false, "
                             f"got {self.add_generation_prompt!r}")
        if not isinstance(self.continue_final_message, bool):
            raise ValueError(f"continue_final_message must be true or false, "
                             f"got {self.continue_final_message!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                             "true: the first opens a new assistant turn, the second continues "
                             "the last message")
        if self.chat_template_name is not None and (
                not isinstance(self.chat_template_name, str) or not self.chat_template_name):
            raise ValueError(f"chat_template_name must be a non-empty string, "
                             f"got {self.chat_template_name!r}")
        object.__setattr__(self, "chat_template_kwargs",
                           check_template_kwargs(self.chat_template_kwargs))
        object.__setattr__(self, "tools", check_tools(self.tools))

    @property
    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain-dict copy of ``kwargs`` after checking: string keys none of them reserved,
    values JSON's (None, bool, int, finite float, str, lists, string-keyed dicts), nested
    and sized within the bounds above."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be a mapping of names to JSON values, "
                         f"got {type(kwargs).__name__}")
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: "
                         "the server sets these itself (use the request's own fields)")
    out = plain_json(kwargs, "chat_template_kwargs", MAX_TEMPLATE_KWARGS_DEPTH,
                     "chat_template_kwargs")
    size = json_size(out)
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs are {size} bytes of JSON; at most "
                         f"{MAX_TEMPLATE_KWARGS_BYTES}")
    return out
