"""Chat through a cluster whose router renders with the operator's template (``pdserve up
--chat-template``), and ``pdserve chat --router`` keeping a conversation, against the
in-process engine on the same rendered prompts."""
from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time

import pytest

from client import Chat, Client, InvalidArgumentError
from engine import SamplingParams
from engine.chat_template import load_chat_template
from router.launcher import Cluster, ClusterSpec
from tests.chat_models import model_with_template
from tests.chat_option_templates import NAMED_WITHOUT_DEFAULT, TOOLS_TEMPLATE, TURNS_TEMPLATE
from tests.hf_oracle import hf_tokenizer
from tests.serving_helpers import WORKER_ARGS

TEMPLATE = TURNS_TEMPLATE
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "turns.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def cluster(template_file):
    # The tests' router renders with the operator's template, given to it alone: a router a
    # test adds renders with its own model's (or has none).
    spec = ClusterSpec(num_prefill=0, worker_args=WORKER_ARGS)
    with Cluster(spec) as c:
        c.start_router(extra=["--chat-template", template_file])  # c.router_address: this one
        c.wait_routable(0, 1)
        yield c


def _reply(reference, history, max_tokens, **kw):
    ids = reference.chat_prompt(history, chat_template=load_chat_template(TEMPLATE))
    return reference.generate([ids], SamplingParams(max_tokens=max_tokens, **kw))[0]


def test_the_operators_template_renders_the_prompt(cluster, reference):
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    want = _reply(reference, chat, 10, **GREEDY)
    assert reference.tokenizer.decode(want.prompt_token_ids) == \
        "<user> What is a KV cache?\n<assistant> "
    assert want.token_ids != reference.chat(chat, SamplingParams(max_tokens=10, **GREEDY)).token_ids
    with Client(cluster.router_address, timeout=60) as c:
        res = c.complete(chat, max_tokens=10, **GREEDY)
    assert res.token_ids == want.token_ids
    assert res.usage.prompt_tokens == len(want.prompt_token_ids)


def test_pdserve_chat_through_the_router_keeps_the_conversation(cluster, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", "--router", cluster.router_address,
         "--system", "Be brief.", "--max-tokens", "8"],
        input="Hello\n\nAnd then?\n/exit\nnever sent\n", capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = _reply(reference, history, 8, temperature=0.0).text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = _reply(reference, history, 8, temperature=0.0)
    assert proc.stdout == f"{first}\n{second.text}\n"
    assert proc.stderr.count("tokens, TTFT") == 2
    assert f"{len(second.prompt_token_ids)} prompt tokens" in proc.stderr


def test_pdserve_chat_reports_a_refused_turn_and_goes_on(cluster):
    # A turn the router refuses (too long for the workers' max_model_len, 1024), then one it
    # serves. (A bad sampling flag is refused before any call: tests/test_cli.py.)
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", "--router", cluster.router_address,
         "--max-tokens", "4"],
        input="word " * 2000 + "\nHello\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1  # piped turns: a script learns that one failed
    assert "INVALID_ARGUMENT" in proc.stderr and "max_model_len" in proc.stderr
    assert "/reset" not in proc.stderr  # no conversation yet to start over
    assert proc.stdout.strip()  # the second turn's reply


def test_pdserve_chat_points_to_reset_when_a_conversation_outgrows_the_context(cluster):
    # Every turn carries the whole history: past max_model_len, each later one fails alike.
    proc = _chat(cluster.router_address, "Hello\n" + "word " * 2000 + "\n", "--max-tokens",
                 "4")
    assert proc.returncode == 1
    assert "max_model_len" in proc.stderr and "/reset starts a new one" in proc.stderr


def _chat(address: str, turns: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--router", address,
                           *flags], input=turns, capture_output=True, text=True, timeout=120)


def _router_of(cluster, folder: str, *flags: str):
    """Another router, on ``folder``'s copy of the workers' model (another template)."""
    address = cluster.router_address
    try:
        return cluster.start_router(extra=["--model", folder, *flags])
    finally:
        cluster.router_address = address  # the other tests' router


def test_pdserve_chat_refuses_a_router_without_a_chat_template(cluster, preset_path, tmp_path):
    """Said before any turn is read, with what the router needs: every turn failed instead,
    each with FAILED_PRECONDITION after it was typed."""
    folder = model_with_template(preset_path("tiny-llama"), tmp_path / "none", None)
    router = _router_of(cluster, folder)
    proc = _chat(router.address, "Hello\nAgain\n", "--max-tokens", "2")
    assert proc.returncode == 2, proc.stderr
    assert "has no chat template: start the router with --chat-template FILE" in proc.stderr
    assert "FAILED_PRECONDITION" not in proc.stderr and proc.stdout == ""


def test_piped_turns_written_on_windows_are_the_same_turns(cluster):
    """Lines ending in CR LF: the CR went into each turn, a token more in every prompt."""
    lf = _chat(cluster.router_address, "Hello\nAnd then?\n", "--max-tokens", "4")
    crlf = _chat(cluster.router_address, "Hello\r\nAnd then?\r\n", "--max-tokens", "4")
    assert lf.returncode == crlf.returncode == 0, crlf.stderr
    prompts = [re.findall(r"(\d+) prompt tokens", p.stderr) for p in (lf, crlf)]
    assert len(prompts[0]) == 2 and prompts[1] == prompts[0]
    assert crlf.stdout == lf.stdout


def test_pdserve_chat_on_a_terminal_edits_the_line(cluster):
    """On a terminal a turn is read with line editing: the left arrow went into the turn as
    its escape code, so a mistyped "/exit" corrected with it was sent to the model."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "chat", "--router",
                             cluster.router_address, "--max-tokens", "2"],
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen = bytearray()

    def prompts(n: int) -> bool:
        """Reads the terminal until the n-th prompt (True) or the program's exit (False)."""
        while seen.count(b"you> ") < n:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the program ended, and with it its side of the terminal
                return False
            if not chunk:
                return False
            seen.extend(chunk)
        return True

    try:
        assert prompts(1), seen
        os.write(master, b"/ext\x1b[Di\r")  # "/ext", left arrow, "i", Enter
        if prompts(2):  # the line went to the model as a turn: end the chat
            os.write(master, b"\x04")
            prompts(3)
        assert proc.wait(timeout=60) == 0, seen
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"tokens, TTFT" not in seen, seen


OPTIONS_CHAT = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "Hello", "name": "bot"},
                {"role": "user", "content": "Think?"}]


@pytest.fixture(scope="module")
def named(cluster, preset_path, tmp_path_factory):
    """(A copy of the workers' model with named templates and no "default", a router on it
    that takes a chat's own template): one router for the tests of vLLM's options, of tool
    use and of a request's template."""
    folder = model_with_template(preset_path("tiny-llama"), tmp_path_factory.mktemp("named") / "m",
                                 NAMED_WITHOUT_DEFAULT + [{"name": "tools",
                                                           "template": TOOLS_TEMPLATE}])
    return folder, _router_of(cluster, folder, "--trust-request-chat-template",
                              "--request-chat-template-timeout-s", "3")


def test_vllms_chat_options_through_the_router_render_as_hugging_faces(named, reference):
    """A model with named templates and no "default" (it counted as having no template), a
    message's name, add_generation_prompt, continue_final_message and chat_template_kwargs:
    the router's prompt is HF's apply_chat_template's with the same arguments; bad options
    are the client's INVALID_ARGUMENT."""
    folder, router = named
    hf = hf_tokenizer(folder)
    kwargs = {"enable_thinking": False, "budget": 3,
              "persona": {"style": "terse ", "tags": ["a", "b"]}}
    begun = OPTIONS_CHAT + [{"role": "assistant", "content": "Let me"}]
    cases = [(Chat(OPTIONS_CHAT, chat_template_name="thinking", chat_template_kwargs=kwargs),
              dict(chat_template="thinking", add_generation_prompt=True, **kwargs)),
             (Chat(OPTIONS_CHAT, chat_template_name="thinking", add_generation_prompt=False),
              dict(chat_template="thinking", add_generation_prompt=False)),
             (Chat(begun, chat_template_name="thinking", continue_final_message=True,
                   add_generation_prompt=False),
              dict(chat_template="thinking", continue_final_message=True)),
             (Chat(OPTIONS_CHAT, chat_template_name="qa"),
              dict(chat_template="qa", add_generation_prompt=True))]
    with Client(router.address, timeout=60) as c:
        info = c.model_info()
        assert info.has_chat_template and \
            info.chat_template_names == ["qa", "thinking", "tools"]
        for chat, hf_args in cases:
            want = hf.apply_chat_template(chat.messages, tokenize=True, return_dict=False,
                                          **hf_args)
            assert c.tokenize(chat).token_ids == want, hf_args
        res = c.complete(cases[0][0], max_tokens=6, **GREEDY)
        for bad, match in [
                (Chat(OPTIONS_CHAT), "none named 'default': choose one with chat_template_name "
                                     "('qa', 'thinking', 'tools')"),
                (Chat(OPTIONS_CHAT, chat_template_name="rag"), "no chat template named 'rag'"),
                (Chat(begun, chat_template_name="qa", continue_final_message=True,
                      add_generation_prompt=True), "cannot both be true"),
                (Chat(OPTIONS_CHAT, chat_template_name="qa",
                      chat_template_kwargs={"add_generation_prompt": True}),
                 "may not set 'add_generation_prompt'"),
                (Chat(OPTIONS_CHAT, chat_template_name="qa",
                      chat_template_kwargs={"x": "y" * 70000}), "bytes of JSON")]:
            with pytest.raises(InvalidArgumentError, match=re.escape(match)):
                c.complete(bad, max_tokens=2)
    prompt = hf.apply_chat_template(OPTIONS_CHAT, tokenize=True, return_dict=False,
                                    **cases[0][1])
    want = reference.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert res.token_ids == want.token_ids
    assert res.usage.prompt_tokens == len(prompt)
    # pdserve chat picks the template and passes the kwargs.
    proc = _chat(router.address, "Hi\n", "--max-tokens", "4", "--chat-template-name",
                 "thinking", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert proc.returncode == 0, proc.stderr
    turn = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                  return_dict=False, chat_template="thinking",
                                  add_generation_prompt=True, enable_thinking=False)
    assert f"{len(turn)} prompt tokens" in proc.stderr


def test_tools_and_tool_calls_through_the_router_render_as_hugging_faces(named, reference):
    """The SDK's tools and tool-use messages (OpenAI's form: arguments as JSON text, no
    content beside the calls) reach the template as HF's apply_chat_template gets them, in
    the order their keys were written; the reply is the in-process engine's on that prompt."""
    from tests.test_chat_tools import CALLED, TOOLS, _as_openai_sends_it

    folder, router = named
    prompt = hf_tokenizer(folder).apply_chat_template(
        CALLED, tools=TOOLS, chat_template="tools", tokenize=True, return_dict=False,
        add_generation_prompt=True)
    chat = Chat(_as_openai_sends_it(CALLED), tools=TOOLS, chat_template_name="tools")
    with Client(router.address, timeout=60) as c:
        assert c.tokenize(chat).token_ids == prompt
        res = c.complete(chat, max_tokens=6, **GREEDY)
        bad = _as_openai_sends_it(CALLED)
        bad[1]["tool_calls"][0]["function"]["arguments"] = "{city: Oslo}"
        with pytest.raises(InvalidArgumentError, match=re.escape(
                "chat message 1: tool_calls[0]'s arguments is not JSON")):
            c.complete(Chat(bad, tools=TOOLS, chat_template_name="tools"), max_tokens=2)
    want = reference.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert res.token_ids == want.token_ids and res.usage.prompt_tokens == len(prompt)


def test_a_chats_own_template_renders_on_a_router_that_trusts_it(named, cluster, reference,
                                                                 template_file):
    """vLLM's chat_template request field, behind --trust-request-chat-template: the prompt
    is HF's with that template; a stream's continuation expects the router's model, not its
    template, which did not render the prompt; a router without the flag refuses, and
    pdserve chat says so before any turn."""
    import dataclasses

    from client import FailedPreconditionError

    folder, router = named
    chat = Chat(OPTIONS_CHAT[:2], chat_template=TEMPLATE)
    prompt = hf_tokenizer(folder).apply_chat_template(
        OPTIONS_CHAT[:2], chat_template=TEMPLATE, tokenize=True, return_dict=False,
        add_generation_prompt=True)
    with Client(router.address, timeout=60) as c:
        info = c.model_info()
        assert info.accepts_request_chat_template
        assert c.tokenize(chat).token_ids == prompt
        # As the SDK's failover sends a continuation: another template digest than this
        # router's counts for its own templates' chats, not for this one.
        elsewhere = dataclasses.replace(info.identity, chat_template="another")
        res = c.complete(chat, max_tokens=6, expect_model=elsewhere, **GREEDY)
        with pytest.raises(FailedPreconditionError, match="chat templates differ"):
            c.complete(Chat(OPTIONS_CHAT, chat_template_name="qa"), max_tokens=2,
                       expect_model=elsewhere)
    want = reference.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert res.token_ids == want.token_ids and res.usage.prompt_tokens == len(prompt)
    with Client(cluster.router_address, timeout=60) as c:
        assert not c.model_info().accepts_request_chat_template
        with pytest.raises(FailedPreconditionError, match="--trust-request-chat-template"):
            c.complete(chat, max_tokens=2)
    proc = _chat(router.address, "Hi\n", "--max-tokens", "4", "--chat-template", template_file)
    assert proc.returncode == 0, proc.stderr
    turn = hf_tokenizer(folder).apply_chat_template(
        [{"role": "user", "content": "Hi"}], chat_template=TEMPLATE, tokenize=True,
        return_dict=False, add_generation_prompt=True)
    assert f"{len(turn)} prompt tokens" in proc.stderr
    proc = _chat(cluster.router_address, "Hi\n", "--chat-template", template_file)
    assert proc.returncode == 2 and "start it with --trust-request-chat-template" in proc.stderr


def _template_processes(router) -> set[int]:
    """The router's children rendering requests' templates (router/template_sandbox.py)."""
    found = subprocess.run(["pgrep", "-P", str(router.popen.pid), "-f", "template_child"],
                           capture_output=True, text=True)
    return {int(p) for p in found.stdout.split()}


def test_a_chats_own_template_that_runs_too_long_is_stopped(named):
    """Two loops of 100000: hours of a router thread once. Now INVALID_ARGUMENT at the
    router's --request-chat-template-timeout-s, the process running it killed and replaced,
    and the next chat with its own template rendered."""
    folder, router = named
    before = _template_processes(router)
    assert len(before) == 2  # --request-chat-template-workers' default
    looping = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
               "{% endfor %}")
    with Client(router.address, timeout=60) as c:
        with pytest.raises(InvalidArgumentError, match=r"ran past 3 s"):
            c.complete(Chat(OPTIONS_CHAT[:2], chat_template=looping), max_tokens=2)
        chat = Chat(OPTIONS_CHAT[:2], chat_template=TEMPLATE)
        assert c.tokenize(chat).token_ids == hf_tokenizer(folder).apply_chat_template(
            OPTIONS_CHAT[:2], chat_template=TEMPLATE, tokenize=True, return_dict=False,
            add_generation_prompt=True)
    end = time.monotonic() + 60
    while len(after := _template_processes(router)) != 2 and time.monotonic() < end:
        time.sleep(0.1)
    assert len(after) == 2 and len(after & before) == 1, (before, after)
