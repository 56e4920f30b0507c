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
from typing import Any

from engine.chat_options import ChatOptions
from engine.chat_tools import check_tool_call_id, check_tool_calls
from engine.tokenizer import Tokenizer, read_utf8

# A conversation longer than this is refused before rendering; the prompt's token count is
# checked against the model's length limit afterwards anyway.
MAX_CHAT_MESSAGES = 4096
# Roles are words ("system", "tool", "ipython"); templates quote a role they refuse, and the
# refusal goes back to the client and into the router's access log.
MAX_ROLE_CHARS = 256
# The file name jinja2 compiles a template given as a string under.
_TEMPLATE_CODE = "<template>"


class ChatTemplateUnusable(ValueError):
    """The server's template cannot render any chat: a server-side condition, not a bad
    request (the router answers FAILED_PRECONDITION)."""


class ChatTemplateMissing(ChatTemplateUnusable):
    """The model has no chat template and the operator gave none."""


class ChatTemplateBroken(ChatTemplateUnusable):
    """The template does not parse (the model's, or the operator's)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant", "tool", or what the template accepts
    content: str
    # The speaker's name (OpenAI's "name"); the template sees it as the message's "name" key,
    # absent when None, as transformers passes a message without one.
    name: str | None = None
    # An assistant's calls of the request's tools, and a "tool" message's answer to one of
    # them (engine/chat_tools.py); absent from the message the template sees when None.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role.strip():
            raise ValueError(f"a chat message's role must be a non-empty string, got {self.role!r}")
        if len(self.role) > MAX_ROLE_CHARS:
            raise ValueError(f"a chat message's role is {len(self.role)} characters; at most "
                             f"{MAX_ROLE_CHARS}")
        if not isinstance(self.content, str):
            raise ValueError(f"a chat message's content must be a string, "
                             f"got {type(self.content).__name__}")
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"a chat message's name must be a string, "
                             f"got {type(self.name).__name__}")
        object.__setattr__(self, "tool_calls", check_tool_calls(self.tool_calls))
        object.__setattr__(self, "tool_call_id", check_tool_call_id(self.tool_call_id))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls is not None:
            d["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


_MESSAGE_KEYS = {"role", "content"}
_OPTIONAL_KEYS = {"name", "tool_calls", "tool_call_id"}


def check_messages(messages: Sequence[ChatMessage | Mapping]) -> list[ChatMessage]:
    """``ChatMessage``s from messages or ``{"role": ..., "content": ...}`` mappings (with
    ``"name"``, ``"tool_calls"`` and ``"tool_call_id"`` optionally; the content of one with
    tool calls may be None, as OpenAI's is); ValueError naming the first bad one."""
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
        if not isinstance(m, Mapping) or not _MESSAGE_KEYS <= set(m) <= \
                _MESSAGE_KEYS | _OPTIONAL_KEYS:
            raise ValueError(f"chat message {i} must have the keys role and content (and "
                             f"optionally {', '.join(sorted(_OPTIONAL_KEYS))}), got {m!r}")
        content = m["content"]
        if content is None and m.get("tool_calls"):
            content = ""  # the templates test it ({% if message.content %}) or print it
        try:
            out.append(ChatMessage(m["role"], content, m.get("name"), m.get("tool_calls"),
                                   m.get("tool_call_id")))
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
    return out


def load_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``: a file's contents, or the value itself when it
    is a template written inline (it contains ``{{`` or ``{%``). None stays None (the model's
    own). ValueError when the file is missing, unreadable or not UTF-8, or the template does
    not parse (ChatTemplateBroken)."""
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
    check_chat_template(text, f"chat template {value!r}")
    return text


def check_chat_template(text: str, what: str, hint: str = "") -> None:
    """ChatTemplateBroken, naming ``what`` (and adding ``hint``), when ``text`` does not parse
    as transformers parses a chat template."""
    from jinja2 import TemplateSyntaxError

    try:
        _compile(text)
    except (TemplateSyntaxError, SyntaxError) as e:  # SyntaxError: see render_chat
        raise ChatTemplateBroken(f"{what} does not parse: {e}{hint}") from None


def _compile(text: str) -> None:
    """Compiles ``text`` in the environment transformers renders with: its extensions
    ({% break %} and {% continue %}, {% generation %}) are syntax a bare Jinja environment
    refuses. transformers caches the compiled template, so the first chat does not pay it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private name: a transformers that moved it compiles as below
        _fallback_environment().from_string(text)
    else:
        _compile_jinja_template(text)


def _fallback_environment():
    """A sandboxed environment with the syntax transformers' adds (to compile, not render)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(extensions=[loopcontrols, Generation])


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage | Mapping], *,
                    continue_final_message: bool = False,
                    chat_template: str | None = None,
                    options: ChatOptions | None = None) -> list[int]:
    """The prompt token ids of a conversation. The template ends with the opening of the
    assistant's turn, or, with ``continue_final_message``, leaves the last message open so the
    model continues it (an assistant reply begun by the caller). ``options`` (which carry
    their own continue_final_message) add vLLM's other chat options."""
    if options is None:
        options = ChatOptions(continue_final_message=continue_final_message)
    elif continue_final_message:
        raise ValueError("give continue_final_message in options, not beside them")
    chat = prepared_chat(tokenizer, messages, chat_template, options)
    return tokenizer.encode_plain(render_chat(tokenizer, chat.messages, chat.template, options))


@dataclass(frozen=True)
class PreparedChat:
    """A conversation checked and its template chosen: what rendering takes."""
    messages: list[ChatMessage]
    template: str


def prepared_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage | Mapping],
                  chat_template: str | None, options: ChatOptions) -> PreparedChat:
    """The checks a conversation passes before it renders (ValueError naming the first
    failure), and the template it renders with (select_template)."""
    msgs = check_messages(messages)
    clash = sorted(set(options.chat_template_kwargs) & set(tokenizer.special_tokens_map))
    if clash:  # a special token this tokenizer names beyond the reserved ones
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}: "
                         "the template reads the tokenizer's special tokens under these names")
    return PreparedChat(msgs, select_template(tokenizer, chat_template,
                                              options.chat_template_name))


def select_template(tokenizer: Tokenizer, chat_template: str | None,
                    name: str | None) -> str:
    """The template a chat renders with: ``chat_template`` (the operator's, or LLM.chat's
    caller's), else the model's named ``name``, else the model's default. ChatTemplateMissing
    when there is none; ValueError for a name the model lacks, or none given where the model
    has several templates and no "default" (transformers refuses that too)."""
    named = tokenizer.chat_templates
    if name is not None:
        if chat_template is not None:
            raise ValueError("chat_template_name selects one of the model's named templates, "
                             "but chats here render with a template given in its place")
        if name not in named:
            have = (f"it has {_names(named)}" if named else "it has no named templates")
            raise ValueError(f"model {tokenizer.folder.name!r} has no chat template named "
                             f"{name!r}: {have}")
        return named[name]
    if chat_template is not None:
        return chat_template
    if tokenizer.chat_template:
        return tokenizer.chat_template
    if named:
        raise ValueError(f"model {tokenizer.folder.name!r} has several chat templates and none "
                         f"named 'default': choose one with chat_template_name ({_names(named)})")
    # Said to LLM.chat's caller as to the router's (which names its own flag).
    raise ChatTemplateMissing(f"model {tokenizer.folder.name!r} has no chat template: "
                              "give one (chat_template), or send text or token ids")


def _names(named: Mapping[str, str]) -> str:
    return ", ".join(repr(n) for n in sorted(named))


def render_chat(tokenizer: Tokenizer, msgs: list[ChatMessage], template: str,
                options: ChatOptions) -> str:
    """The conversation as text, rendered as ``apply_chat_template(tokenize=False)`` does:
    transformers' sandboxed Jinja environment, with the special tokens' strings as variables.
    ValueError when the template refuses the conversation (its raise_exception) or fails on
    it; ChatTemplateBroken when it does not parse, whatever the conversation."""
    return render_template(template, [m.as_dict() for m in msgs], tokenizer.special_tokens_map,
                           tools=options.tools,
                           add_generation_prompt=options.generation_prompt,
                           continue_final_message=options.continue_final_message,
                           kwargs=options.chat_template_kwargs)


def render_template(template: str, conversation: list[dict], special_tokens: Mapping[str, str],
                    *, tools: list[dict] | None, add_generation_prompt: bool,
                    continue_final_message: bool, kwargs: Mapping[str, Any]) -> str:
    """render_chat on plain values (what router/template_child.py receives): ``conversation``
    the messages' dicts, ``kwargs`` the chat_template_kwargs, checked to set none of the
    other names the template sees."""
    from jinja2 import TemplateError, TemplateSyntaxError

    render_jinja_template = chat_renderer()
    try:
        rendered, _ = render_jinja_template(
            conversations=[conversation], chat_template=template, tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **special_tokens, **kwargs)
    except (TemplateSyntaxError, SyntaxError) as e:
        # Python's SyntaxError: what Jinja's parser lets through into the code it compiles
        # ({% break %} outside a loop). Either way no conversation renders.
        raise ChatTemplateBroken(f"the chat template does not parse: {e}") from None
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
