"""``pdserve chat``: a conversation on the terminal, through a running router (``--router``)
or the in-process engine. Each line read is a user turn; the reply streams back and joins
the history, which the model's chat template renders into every next prompt.
``/reset`` starts over (the system message stays), ``/exit`` or end of input quits."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from collections.abc import Callable, Iterator

# A reply in progress: text deltas, then the usage line for stderr.
Replier = Callable[[list[dict]], Iterator[tuple[str, str | None]]]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message to open the conversation")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="render with this Jinja template instead of the model's (with "
                        "--router: sent with each turn, for a router started with "
                        "--trust-request-chat-template)")
    p.add_argument("--chat-template-kwargs", default=None, type=_json_object, metavar="JSON",
                   help="extra variables for the template, as a JSON object (vLLM's "
                        "chat_template_kwargs), e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--chat-template-name", default=None, metavar="NAME",
                   help="which of the model's named chat templates renders (default: its "
                        "'default')")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object ({\"name\": value, ...})")
    from engine.chat_options import check_template_kwargs

    # Checked now, not at the first turn: through a router the SDK's TypeError for a NaN
    # (json.loads takes one) ended the chat with a traceback, and a reserved name failed
    # every turn.
    try:
        return check_template_kwargs(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_kwargs_travel(kwargs: dict) -> None:
    """Through a router the kwargs travel as a protobuf Struct, which holds what the engine
    takes except ints past 2**53 (doubles): refused before the first turn, not at every one."""
    from client.chat import Chat, chat_prompt

    try:
        chat_prompt(Chat([], chat_template_kwargs=kwargs), lambda text, _where: text)
    except TypeError as e:
        raise ValueError(f"--chat-template-kwargs: {e}") from None


def cmd_chat(args: argparse.Namespace) -> int:
    from client import PdserveError

    if args.router is not None:
        from engine.cli import refuse_engine_flags

        refuse_engine_flags(args, "a router's workers run with their own")
        if args.chat_template_kwargs:
            _check_kwargs_travel(args.chat_template_kwargs)
    if args.chat_template and args.chat_template_name:
        raise ValueError("--chat-template-name selects one of the model's named templates; "
                         "--chat-template replaces them")
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise ValueError("chat reads its turns from stdin, which is closed")
    if hasattr(sys.stdin, "reconfigure"):
        # A line that is not valid text fails its own turn (the SDK says why), not the read
        # ahead of every line with it.
        sys.stdin.reconfigure(errors="surrogateescape")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    interactive = sys.stdin.isatty()
    try:
        replier = _replier(args)
        reply = replier.open()
    except PdserveError as e:  # no router to talk to (down, wrong address, refused key)
        print(f"pdserve: error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    failed = 0
    read_turn = _terminal_reader() if interactive else _piped_line
    with contextlib.closing(replier):
        while True:
            text = read_turn()
            if text is None or text.strip() in ("/exit", "/quit"):
                # A script piping turns in learns that some failed; a person saw each error.
                return 1 if failed and not interactive else 0
            if text.strip() == "/reset":
                history = list(system)
                print("(conversation cleared)", flush=True)
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            parts = []
            try:
                for delta, usage in reply(history):
                    parts.append(delta)
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    if usage is not None:
                        print(f"\n[{usage}]", file=sys.stderr, flush=True)
            except (PdserveError, ValueError) as e:
                history.pop()  # the turn failed: the next one starts from before it
                failed += 1
                code = getattr(e, "code", None)
                # The history grows by every turn: once over the context, every later turn
                # fails the same way until the user starts over.
                hint = ("\n(each turn's prompt holds the whole conversation: /reset starts "
                        "a new one)") if "max_model_len" in str(e) \
                    and any(m["role"] == "assistant" for m in history) else ""
                print(f"\npdserve: error: {f'{code.name}: ' if code else ''}{e}{hint}",
                      file=sys.stderr, flush=True)
                continue
            print(flush=True)
            history.append({"role": "assistant", "content": "".join(parts)})


def _piped_line() -> str | None:
    """The next line of piped turns without its line ending, or None at end of input. A file
    written on Windows ends its lines with CR LF: the CR went into the turn (one more token)."""
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def _terminal_reader() -> Callable[[], str | None]:
    """Turns typed on a terminal, read by ``input`` with line editing: without it, arrow keys
    went into the turn as escape codes (a mistyped "/exit" corrected with the left arrow was
    sent to the model), and up recalls earlier turns."""
    with contextlib.suppress(ImportError):  # not built into every Python
        importlib.import_module("readline")  # importing it gives input() line editing

    def read() -> str | None:
        try:
            return input("you> ")
        except EOFError:  # Ctrl-D: the shell's prompt starts on a line of its own
            print(flush=True)
            return None
    return read


class _replier:
    """The reply function for args' mode, and what it holds open (a client or an engine)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._close = lambda: None

    def open(self) -> Replier:
        return self._remote() if self.args.router is not None else self._local()

    def close(self) -> None:
        self._close()

    def _remote(self) -> Replier:
        from client import Chat, Client
        from engine.chat_template import load_chat_template
        from engine.cli import check_sampling_flags, sampling_kwargs
        from engine.cli_admin import connection_kwargs

        check_sampling_flags(self.args)
        template = load_chat_template(self.args.chat_template)  # read once, sent each turn
        client = Client([a.strip() for a in self.args.router.split(",") if a.strip()],
                        **connection_kwargs(self.args))
        try:
            info = client.model_info()
            if template is not None and not info.accepts_request_chat_template:
                raise ValueError("the router renders chats with its own template only: start "
                                 "it with --trust-request-chat-template to take --chat-template "
                                 "from here")
            if template is None and not info.has_chat_template:
                # Refused now, not as each turn's FAILED_PRECONDITION after it was typed.
                raise ValueError(f"the router's model {info.model!r} has no chat template: "
                                 "start the router with --chat-template FILE to chat with it")
            sampling = sampling_kwargs(self.args, info.sampling_defaults)
        except BaseException:
            client.close()
            raise
        self._close = client.close

        def reply(history: list[dict]):
            t0 = time.perf_counter()
            # Every turn with the model (and chat template) of the first, whichever router
            # each reaches: a conversation does not change models midway.
            chat = Chat(history, chat_template_kwargs=self.args.chat_template_kwargs,
                        chat_template_name=self.args.chat_template_name,
                        chat_template=template)
            for chunk in client.generate(chat, expect_model=info.identity, **sampling):
                u = chunk.usage
                yield chunk.text, None if u is None else (
                    f"{u.completion_tokens} tokens, TTFT {u.timings.ttft_s * 1e3:.1f} ms, total "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms, {u.prompt_tokens} prompt tokens, "
                    f"{u.cached_tokens} cached")
        return reply

    def _local(self) -> Replier:
        from engine import LLM, SamplingParams
        from engine.chat_template import load_chat_template
        from engine.cli import check_sampling_flags, engine_kwargs, sampling_kwargs

        template = load_chat_template(self.args.chat_template)
        check_sampling_flags(self.args)
        if template is None:
            _check_model_template(self.args.model, self.args.chat_template_name,
                                  self.args.tokenizer)
        llm = LLM(self.args.model, **engine_kwargs(self.args))
        self._close = llm.shutdown
        defaults = llm.sampling_defaults
        params = SamplingParams(**{**defaults, **sampling_kwargs(self.args, defaults)})

        def reply(history: list[dict]):
            t0 = time.perf_counter()
            ids = llm.chat_prompt(history, chat_template=template,
                                  chat_template_kwargs=self.args.chat_template_kwargs,
                                  chat_template_name=self.args.chat_template_name)
            n = 0
            first = None
            for out in llm.stream(ids, params):
                n += len(out.new_token_ids)
                first = first or time.perf_counter() - t0
                yield out.text_delta, None if not out.finished else (
                    f"{n} tokens, TTFT {first * 1e3:.1f} ms, total "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms, {len(ids)} prompt tokens")
        return reply


def _check_model_template(model: str, name: str | None, tokenizer: str | None = None) -> None:
    """ValueError when the model has no chat template (or no tokenizer): said before its
    engine loads (minutes for a large model), not as every turn's error after it did, which
    also told the user to start a router with --chat-template. ``tokenizer``: --tokenizer."""
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model
    from engine.tokenizer_choice import load_model_tokenizer

    path = resolve_model(EngineConfig(model=model, tokenizer=tokenizer).model)
    tok = load_model_tokenizer(path, tokenizer, ModelConfig.from_pretrained(path).vocab_size)
    if tok is None:
        raise ValueError(f"model {model!r} has no tokenizer, so no chat template to chat with "
                         "(--tokenizer names a folder with one)")
    if not tok.chat_template and not tok.chat_templates:
        raise ValueError(f"model {model!r} has no chat template: pass --chat-template FILE "
                         "(a Jinja chat template) to chat with it")
    if (name is None and not tok.chat_template) or (name is not None
                                                    and name not in tok.chat_templates):
        names = ", ".join(sorted(tok.chat_templates)) or "none"
        raise ValueError(f"model {model!r} has no chat template named "
                         f"{name or 'default'!r}: pass --chat-template-name (its named "
                         f"templates: {names})")
