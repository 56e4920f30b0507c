"""Chat prompts: a conversation rendered with the model's chat template, then tokenized.

The template is the Jinja one the checkpoint ships in ``tokenizer_config.json`` (rendered by
``transformers``, in its sandboxed environment), or one the operator supplies
(``pdserve router --chat-template``) for models that have none or to override it. The
rendered text carries its own special tokens (bos, turn markers), so it is encoded without
the tokenizer's automatic ones, as Hugging Face does.
"""
from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import Tokenizer, read_utf8

# A conversation longer than this is refused before rendering; the prompt's token count is
# checked against the model's length limit afterwards anyway.
MAX_CHAT_MESSAGES = 4096
# The file name jinja2 compiles a template given as a string under.
_TEMPLATE_CODE = "<template>"


class ChatTemplateMissing(ValueError):
    """The model has no chat template and the operator gave none: a server-side condition,
    not a bad request (the router answers FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant", or what the template accepts
    content: str

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role.strip():
            raise ValueError(f"a chat message's role must be a non-empty string, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"a chat message's content must be a string, "
                             f"got {type(self.content).__name__}")


def check_messages(messages: Sequence[ChatMessage | Mapping]) -> list[ChatMessage]:
    """``ChatMessage``s from messages or ``{"role": ..., "content": ...}`` mappings; ValueError
    naming the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("chat messages must be a list of {role, content} messages")
    if not messages:
        raise ValueError("the chat has no messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"the chat has {len(messages)} messages, more than {MAX_CHAT_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            raise ValueError(f"chat message {i} must have exactly the keys role and content, "
                             f"got {m!r}")
        try:
            out.append(ChatMessage(m["role"], m["content"]))
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
    return out


def load_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``: a file's contents, or the value itself when it
    is a template written inline (it contains ``{{`` or ``{%``). None stays None (the model's
    own). ValueError when the file is missing, unreadable or not UTF-8, or the template does
    not parse."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError("chat_template must be a file path or a Jinja template")
    if "{{" in value or "{%" in value:
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template file {value!r} does not exist")
        text = read_utf8(path, "chat template file")
    _parse(text, value)
    return text


def _parse(text: str, source: str) -> None:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template {source!r} does not parse: {e}") from None


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage | Mapping], *,
                    continue_final_message: bool = False,
                    chat_template: str | None = None) -> list[int]:
    """The prompt token ids of a conversation. The template ends with the opening of the
    assistant's turn, or, with ``continue_final_message``, leaves the last message open so the
    model continues it (an assistant reply begun by the caller)."""
    msgs = check_messages(messages)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise ChatTemplateMissing(f"model {tokenizer.folder.name!r} has no chat template: "
                                  "start the router with --chat-template, or send text or "
                                  "token ids")
    if continue_final_message and not msgs[-1].content:
        raise ValueError("continue_final_message needs a final message with content")
    text = render_chat(tokenizer, msgs, template, continue_final_message)
    return tokenizer.encode_plain(text)


def render_chat(tokenizer: Tokenizer, msgs: list[ChatMessage], template: str,
                continue_final_message: bool) -> str:
    """The conversation as text, rendered as ``apply_chat_template(tokenize=False)`` does:
    transformers' sandboxed Jinja environment, with the special tokens' strings as variables."""
    from jinja2 import TemplateError

    render_jinja_template = chat_renderer()
    try:
        rendered, _ = render_jinja_template(
            conversations=[[{"role": m.role, "content": m.content} for m in msgs]],
            chat_template=template, add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message, **tokenizer.special_tokens_map)
    except TemplateError as e:
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    except Exception as e:
        # Raised by the template's own code ('a' + 1, 1 // 0 on this conversation's values), it
        # is the template failing on the request, as a TemplateError is; raised outside it, it
        # is a bug here and stays what it is.
        if not _raised_in_template(e):
            raise
        raise ValueError(f"the chat template failed on the conversation: "
                         f"{type(e).__name__}: {e}") from e
    return rendered[0]


def _raised_in_template(error: Exception) -> bool:
    return any(frame.f_code.co_filename == _TEMPLATE_CODE
               for frame, _ in traceback.walk_tb(error.__traceback__))


def chat_renderer():
    """transformers' template renderer. Its import costs ~1 s (part of transformers), so
    processes that render no chats never pay it and a router with a template pays it at start
    (``load_served_model``), not on its first chat request."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template
