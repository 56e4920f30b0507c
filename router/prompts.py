"""The model as the router sees it: the files it reads from the model folder (tokenizer,
vocabulary, eos ids, sampling defaults, chat template) and what it does with them: a request's
prompt into token ids (text, token ids or a chat), ids back into text, the model's info."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from engine.chat_options import MAX_TEMPLATE_KWARGS_DEPTH, ChatOptions
from engine.chat_tools import parse_json
from engine.chat_template import (ChatMessage, ChatTemplateMissing, ChatTemplateUnusable,
                                  chat_prompt_ids, chat_renderer, check_chat_template,
                                  prepared_chat)
from engine.model_fingerprint import text_digest
from engine.tokenizer import Tokenizer
from protos import common_pb2, convert, router_pb2
from router.errors import RouterRejectError
from router.template_sandbox import RenderJob, TemplateSandbox

# Prompts of more characters (or token ids) than this are rendered and tokenized in a worker
# thread rather than on the router's event loop: tokenizing takes ~0.35 us a character (a
# chat's rendering about as much again), so a 10 MB chat held the loop, and every stream and
# health check on it, for seconds. Below it the work takes under a millisecond and the thread
# hop (~60 us, measured with the tiny-llama tokenizer) would cost more than it saves.
INLINE_PROMPT_CHARS = 2048
# A request's own chat template: models' run to ~20 KB (tool-use ones); the bound keeps what
# each one costs to compile, and the compiled templates transformers caches (128), small.
MAX_REQUEST_CHAT_TEMPLATE_CHARS = 128 * 1024


@dataclass
class ServedModel:
    name: str  # the router's --model
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    # engine/generation_defaults.py: what a request's unset sampling fields become.
    sampling_defaults: dict = field(default_factory=dict)
    # The operator's --chat-template text; None: the tokenizer's own.
    chat_template: str | None = None
    # The folder's content (engine/model_fingerprint.py): workers serving another model get
    # no requests. "" checks none.
    fingerprint: str = ""
    # Whether a chat may bring its own template (--trust-request-chat-template): a template
    # is code the router runs; Jinja's sandbox bounds what it reaches, ``sandbox`` what it
    # costs.
    trust_request_chat_template: bool = False
    # What a stream must not change midway (GenerateRequest.expect_model), set from the rest.
    identity: router_pb2.ModelIdentity = field(init=False, repr=False)
    # The processes a request's own template renders in (router/template_sandbox.py), which
    # the router starts with --trust-request-chat-template; None: rendered here, in the
    # caller's thread, as for callers that build a ServedModel themselves.
    sandbox: TemplateSandbox | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        template = (self.chat_template if self.chat_template is not None
                    else self.tokenizer.chat_template)
        if self.chat_template is None and self.tokenizer.chat_templates:
            # Any of them may render a stream's prompt: the digest covers them all.
            template = json.dumps(self.tokenizer.chat_templates, sort_keys=True)
        self.identity = router_pb2.ModelIdentity(
            name=self.name, fingerprint=self.fingerprint,
            chat_template=text_digest(template) if template else "")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or self.tokenizer.chat_template
                    or self.tokenizer.chat_templates)

    @property
    def chat_template_names(self) -> list[str]:
        """The names a chat may select; none under the operator's template, which replaces
        the model's."""
        return [] if self.chat_template is not None else sorted(self.tokenizer.chat_templates)

    async def prompt_ids_async(self, msg: router_pb2.GenerateRequest | router_pb2.TokenizeRequest
                               ) -> list[int]:
        """prompt_ids, in a worker thread for a large prompt (INLINE_PROMPT_CHARS), and a
        chat's own template in the sandbox's processes; the same errors either way."""
        if self.sandbox is not None and msg.WhichOneof("prompt") == "chat" \
                and msg.chat.chat_template:
            return await self._sandboxed_chat_ids(msg.chat)
        if not _large_prompt(msg):
            return self.prompt_ids(msg)
        return await asyncio.to_thread(self.prompt_ids, msg)

    async def _sandboxed_chat_ids(self, chat: router_pb2.ChatPrompt) -> list[int]:
        payload = await asyncio.to_thread(lambda: self._render_job(chat).encode())
        text = await self.sandbox.render_encoded(payload)
        if len(text) > INLINE_PROMPT_CHARS:
            ids = await asyncio.to_thread(self.tokenizer.encode_plain, text)
        else:
            ids = self.tokenizer.encode_plain(text)
        if not ids:
            raise ValueError("the prompt is empty")
        return self.check_vocab(ids, "prompt")

    def _render_job(self, chat: router_pb2.ChatPrompt) -> RenderJob:
        """What the sandbox renders a chat with its own template from: the same checks as
        chat_ids, save compiling the template, which the child does (a template may be
        costly to compile too)."""
        msgs, options = self._chat_parts(chat)
        template = self._request_template(chat, compile_here=False)
        prepared = prepared_chat(self.tokenizer, msgs, template, options)
        return RenderJob(prepared.template, [m.as_dict() for m in prepared.messages],
                         dict(self.tokenizer.special_tokens_map), options.tools,
                         options.generation_prompt, options.continue_final_message,
                         dict(options.chat_template_kwargs))

    def prompt_ids(self, msg: router_pb2.GenerateRequest | router_pb2.TokenizeRequest) -> list[int]:
        """The prompt's token ids; ValueError (INVALID_ARGUMENT) when empty or outside the
        vocabulary, RouterRejectError FAILED_PRECONDITION for a chat the server's template
        cannot render (none, or one that does not parse)."""
        which = msg.WhichOneof("prompt")
        if which == "text":
            if not msg.text:
                raise ValueError("prompt text is empty")
            ids = self.tokenizer.encode(msg.text)
        elif which == "token_ids":
            ids = convert.check_token_ids(msg.token_ids.ids)
        elif which == "chat":
            ids = self.chat_ids(msg.chat)
        else:
            raise ValueError("the request has no prompt (set text, token_ids or chat)")
        if not ids:
            raise ValueError("the prompt is empty")
        return self.check_vocab(ids, "prompt")

    def truncated(self, ids: list[int], sampling: common_pb2.SamplingParams,
                  max_model_len: Callable[[], int]) -> list[int]:
        """``ids``, or their last ``sampling.truncate_prompt_tokens``; -1 (vLLM's "the model's
        length") keeps as many as leave room for one output token in ``max_model_len()`` (the
        workers'; 0 while none is known: kept whole, for the length check to judge)."""
        if not sampling.HasField("truncate_prompt_tokens"):
            return ids
        keep = sampling.truncate_prompt_tokens
        if keep == -1:
            limit = max_model_len()
            return ids[-(limit - 1):] if limit > 1 else ids
        if keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for the model's "
                             f"length, got {keep}")
        return ids[-keep:]

    def chat_ids(self, chat: router_pb2.ChatPrompt) -> list[int]:
        msgs, options = self._chat_parts(chat)
        theirs = self._request_template(chat)
        try:
            return chat_prompt_ids(self.tokenizer, msgs, options=options,
                                   chat_template=theirs if theirs is not None
                                   else self.chat_template)
        except ChatTemplateUnusable as e:
            if theirs is not None:  # the request's template: the client's to mend
                raise ValueError(str(e)) from None
            raise self._unusable(e) from None

    def _chat_parts(self, chat: router_pb2.ChatPrompt) -> tuple[list[ChatMessage], ChatOptions]:
        options = ChatOptions(
            add_generation_prompt=(chat.add_generation_prompt
                                   if chat.HasField("add_generation_prompt") else None),
            continue_final_message=chat.continue_final_message,
            chat_template_kwargs=template_kwargs(chat.chat_template_kwargs),
            chat_template_name=chat.chat_template_name or None,
            tools=[parse_json(t, f"tools[{i}]") for i, t in enumerate(chat.tools)] or None)
        return [_chat_message(m, i) for i, m in enumerate(chat.messages)], options

    def _unusable(self, e: ChatTemplateUnusable) -> RouterRejectError:
        """The router's own template cannot render: FAILED_PRECONDITION, the operator's to
        mend."""
        if isinstance(e, ChatTemplateMissing):
            return RouterRejectError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model {self.name!r} has no chat template: start the router with "
                "--chat-template, or send text or token ids")
        return RouterRejectError(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def _request_template(self, chat: router_pb2.ChatPrompt, compile_here: bool = True
                          ) -> str | None:
        """The chat's own template (ChatPrompt.chat_template), checked (and compiled, unless
        ``compile_here`` is False); None for none."""
        text = chat.chat_template
        if not text:
            return None
        if not self.trust_request_chat_template:
            raise RouterRejectError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this router renders chats with its own template only: a request's "
                "chat_template needs a router started with --trust-request-chat-template")
        if chat.chat_template_name:
            raise ValueError("give chat_template or chat_template_name, not both: the "
                             "request's template replaces the model's named ones")
        if len(text) > MAX_REQUEST_CHAT_TEMPLATE_CHARS:
            raise ValueError(f"chat_template has {len(text)} characters, over "
                             f"{MAX_REQUEST_CHAT_TEMPLATE_CHARS}")
        if compile_here:
            try:
                check_chat_template(text, "the request's chat_template")
            except ChatTemplateUnusable as e:
                raise ValueError(str(e)) from None
        return text

    def check_vocab(self, ids: list[int], what: str) -> list[int]:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{what} token id {bad[0]} is outside the vocabulary "
                             f"(size {self.vocab_size})")
        return ids

    def detokenize(self, msg: router_pb2.DetokenizeRequest) -> str:
        ids = self.check_vocab(convert.check_token_ids(msg.token_ids, "detokenize"), "detokenize")
        skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def info(self, max_model_len: int, block_size: int) -> router_pb2.ModelInfo:
        return router_pb2.ModelInfo(
            model=self.name, vocab_size=self.vocab_size, max_model_len=max_model_len,
            block_size=block_size, has_chat_template=self.has_chat_template,
            chat_template_names=self.chat_template_names,
            sampling_defaults=common_pb2.SamplingParams(**self.sampling_defaults),
            eos_token_ids=self.eos_token_ids, identity=self.identity,
            accepts_request_chat_template=self.trust_request_chat_template)


def load_served_model(model: str, generation_config: str, chat_template: str | None,
                      served_model_name: str = "", tokenizer: str | None = None,
                      trust_request_chat_template: bool = False) -> ServedModel:
    """Reads the model folder (a preset is generated first); blocking. ``served_model_name``
    is the name clients see ("": ``model``); ``tokenizer``: the folder of the tokenizer when
    not the model's (--tokenizer; the workers must be given the same one)."""
    from engine.config import EngineConfig
    from engine.generation_defaults import load_sampling_defaults
    from engine.model_config import ModelConfig
    from engine.model_fingerprint import model_fingerprint
    from engine.presets import resolve_model
    from engine.tokenizer import TOKENIZER_FILES, has_tokenizer_files, load_tokenizer
    from engine.tokenizer_choice import load_model_tokenizer, tokenizer_folder

    path = resolve_model(EngineConfig(model=model, tokenizer=tokenizer).model)
    if tokenizer is None:
        # The router needs a tokenizer even where the workers need none (token-id prompts).
        if path.is_dir() and not has_tokenizer_files(path):
            raise ValueError(f"no tokenizer files in {str(path)!r} (looked for "
                             f"{', '.join(TOKENIZER_FILES)}), which the router needs: pass "
                             "--tokenizer FOLDER, a folder with this model's tokenizer")
        tok = load_tokenizer(path)
        mc = ModelConfig.from_pretrained(path)
    else:
        mc = ModelConfig.from_pretrained(path)
        tok = load_model_tokenizer(path, tokenizer, mc.vocab_size)
    # The stop ids the workers use (engine/setup.py), the tokenizer's eos among them.
    mc = mc.with_tokenizer_eos(tok.eos_token_id)
    served = ServedModel(served_model_name or model, tok, mc.vocab_size,
                         list(mc.eos_token_ids),
                         load_sampling_defaults(generation_config, path, mc.vocab_size),
                         chat_template,
                         model_fingerprint(path, tokenizer_folder(path, tokenizer)),
                         trust_request_chat_template)
    if served.has_chat_template or trust_request_chat_template:
        chat_renderer()
    if served.has_chat_template:
        # Checked now: a template that does not parse would fail every chat, each blamed on
        # its request. The operator's was checked when read; the model's is checked here.
        if chat_template is None:
            named = served.tokenizer.chat_templates
            for name, text in (named.items() if named
                               else [(None, served.tokenizer.chat_template)]):
                what = "the chat template" + (f" {name!r}" if name else "")
                check_chat_template(text, f"{what} of model {model!r}",
                                    " (start the router with --chat-template to use another)")
    return served


# A Struct's numbers are doubles; integers beyond this do not survive the trip exactly, and
# below it a whole double is taken as the integer a JSON client wrote ({{ n }} renders "3",
# as transformers renders the int the same kwargs hold, not "3.0").
_EXACT_INT = 2 ** 53


def template_kwargs(struct) -> dict:
    """``ChatPrompt.chat_template_kwargs`` as Python values (ChatOptions checks the rest)."""
    return {k: _value(v, 1) for k, v in struct.fields.items()}


def _chat_message(m: router_pb2.ChatMessage, i: int) -> ChatMessage:
    try:
        calls = [parse_json(c, f"tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        return ChatMessage(m.role, m.content, m.name if m.HasField("name") else None,
                           calls or None,
                           m.tool_call_id if m.HasField("tool_call_id") else None)
    except ValueError as e:
        raise ValueError(f"chat message {i}: {e}") from None


def _value(v, depth: int):
    if depth > MAX_TEMPLATE_KWARGS_DEPTH:
        raise ValueError(f"chat_template_kwargs nest deeper than {MAX_TEMPLATE_KWARGS_DEPTH} "
                         "levels")
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        x = v.number_value
        return int(x) if x.is_integer() and abs(x) <= _EXACT_INT else x
    if kind == "struct_value":
        return {k: _value(f, depth + 1) for k, f in v.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(f, depth + 1) for f in v.list_value.values]
    if kind in ("string_value", "bool_value"):
        return getattr(v, kind)
    return None  # null_value, or a Value with no kind set (JSON's null either way)


def _large_prompt(msg: router_pb2.GenerateRequest | router_pb2.TokenizeRequest) -> bool:
    """Whether the prompt has more than INLINE_PROMPT_CHARS characters or ids; looks at no
    more of a chat than that takes (msg.ByteSize() would encode the whole request)."""
    which = msg.WhichOneof("prompt")
    if which == "text":
        return len(msg.text) > INLINE_PROMPT_CHARS
    if which == "token_ids":
        return len(msg.token_ids.ids) > INLINE_PROMPT_CHARS
    if which == "chat":
        if msg.chat.chat_template:
            # The request's own template is code: how long it runs is not its length's (two
            # nested loops of a line each can hold a thread for minutes), so never the loop.
            return True
        kwargs = msg.chat.chat_template_kwargs
        n = kwargs.ByteSize() if kwargs.fields else 0
        n += sum(map(len, msg.chat.tools))
        if n > INLINE_PROMPT_CHARS:  # with few messages or none, the loop below says nothing
            return True
        for m in msg.chat.messages:  # a message counts 1 at least: a million empty ones too
            n += 1 + len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
            n += sum(map(len, m.tool_calls))
            if n > INLINE_PROMPT_CHARS:
                return True
    return False
