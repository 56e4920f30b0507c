"""A request's own chat template renders in the router's child processes
(router/template_sandbox.py, router/template_child.py): the same prompt as rendering in the
router, the same refusals, and a template that loops, allocates without end, or outlives its
request costs a process that is killed and replaced, never the router's threads or memory.
Through a real router: tests/test_chat_serving.py."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from client import Chat
from client.types import tokenize_request
from engine.tokenizer import load_tokenizer
from router.errors import status_of
from router.prompts import ServedModel
from router.template_sandbox import RenderJob, TemplateSandbox, TemplateSandboxConfig
from tests.chat_models import model_with_template
from tests.chat_option_templates import OPTIONS_TEMPLATE, TOOLS_TEMPLATE, TURNS_TEMPLATE
from tests.hf_oracle import hf_tokenizer
from tests.test_chat_tools import CALLED, TOOLS

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Think?"}]
# Two loops of 100000 (Jinja's sandbox caps a range there): 10^10 steps, hours.
LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# 2 GB in one string.
ALLOCATING = "{{ ('x' * 2000000000) | length }}"
OK = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def folder(preset_path, tmp_path_factory):
    return model_with_template(preset_path("tiny-llama"),
                               tmp_path_factory.mktemp("sandbox") / "m", OPTIONS_TEMPLATE)


def _job(template: str) -> RenderJob:
    return RenderJob(template, [{"role": "user", "content": "hi"}], {"bos_token": "<s>"}, None,
                     True, False, {})


def _run(coro_fn, config: TemplateSandboxConfig):
    """coro_fn(sandbox) on a started sandbox, closed afterwards."""
    async def main():
        sandbox = TemplateSandbox(config)
        await sandbox.start()
        try:
            return await coro_fn(sandbox)
        finally:
            await sandbox.close()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def shared():
    """A run(coro_fn) on one sandbox (one process) for the module's plain renders: a loop in
    its own thread, which started the sandbox's processes and outlives them."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sandbox = TemplateSandbox(TemplateSandboxConfig(workers=1))
    asyncio.run_coroutine_threadsafe(sandbox.start(), loop).result(120)

    def run(coro_fn):
        return asyncio.run_coroutine_threadsafe(coro_fn(sandbox), loop).result(120)
    yield run
    asyncio.run_coroutine_threadsafe(sandbox.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("chat", [
    Chat(CHAT, chat_template=TURNS_TEMPLATE),
    Chat(CHAT, chat_template=OPTIONS_TEMPLATE,
         chat_template_kwargs={"enable_thinking": True, "budget": 3,
                               "persona": {"style": "terse ", "tags": ["a", "b"]}}),
    Chat(CHAT + [{"role": "assistant", "content": "Let me"}], chat_template=OPTIONS_TEMPLATE,
         continue_final_message=True, add_generation_prompt=False),
    Chat(CALLED, chat_template=TOOLS_TEMPLATE, tools=TOOLS),
])
def test_a_sandboxed_chat_is_the_prompt_rendered_in_the_router(folder, shared, chat):
    """Token for token what the router renders in its own thread, which the chat template
    tests hold to Hugging Face's apply_chat_template."""
    tok = load_tokenizer(folder)
    served = ServedModel("m", tok, tok.vocab_size, trust_request_chat_template=True)
    want = served.prompt_ids(tokenize_request(chat))

    async def sandboxed(sandbox):
        served.sandbox = sandbox
        return await served.prompt_ids_async(tokenize_request(chat))
    assert shared(sandboxed) == want
    assert len(set(want)) > 5


def test_the_turns_template_in_the_sandbox_is_hugging_faces(folder, shared):
    tok = load_tokenizer(folder)
    served = ServedModel("m", tok, tok.vocab_size, trust_request_chat_template=True)

    async def sandboxed(sandbox):
        served.sandbox = sandbox
        return await served.prompt_ids_async(tokenize_request(Chat(CHAT,
                                                                   chat_template=TURNS_TEMPLATE)))
    assert shared(sandboxed) == \
        hf_tokenizer(folder).apply_chat_template(CHAT, chat_template=TURNS_TEMPLATE,
                                                 tokenize=True, return_dict=False,
                                                 add_generation_prompt=True)


@pytest.mark.parametrize("template, match", [
    ("{% for m in messages %}", "does not parse"),
    ("{{ raise_exception('no system turns') }}", "no system turns"),
    ("{{ messages[0]['content'] + 1 }}", "failed on the conversation"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ '' }}", "the prompt is empty"),
    # Rendered in the router's own thread, this one takes 2 GB of its memory and succeeds.
    (ALLOCATING, "more than 1024 MB"),
    ("{{ 'x' * 67108865 }}", "rendered 67108865 characters, over 67108864"),
])
def test_a_bad_template_in_the_sandbox_is_the_clients_invalid_argument(folder, shared, template,
                                                                       match):
    tok = load_tokenizer(folder)
    served = ServedModel("m", tok, tok.vocab_size, trust_request_chat_template=True)
    req = tokenize_request(Chat(CHAT, chat_template=template))

    async def sandboxed(sandbox):
        served.sandbox = sandbox
        with pytest.raises(Exception) as err:
            await served.prompt_ids_async(req)
        return err.value, await sandbox.render(_job(OK))  # and the next one renders
    err, after = shared(sandboxed)
    code, message = status_of(err)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message
    assert after == "<s>user: hi\n"


def test_a_looping_template_is_stopped_and_its_process_replaced():
    async def go(sandbox):
        first = sandbox.pids
        with pytest.raises(ValueError, match=r"ran past 1 s \(--request-chat-template-timeout"):
            await sandbox.render(_job(LOOPING))
        text = await sandbox.render(_job(OK))
        return first, sandbox.pids, text
    first, after, text = _run(go, TemplateSandboxConfig(workers=1, timeout_s=1.0))
    assert text == "<s>user: hi\n"
    assert len(first) == 1 and _gone(first[0]) and after and after != first


def test_a_template_allocating_past_its_memory_fails_alone():
    async def go(sandbox):
        with pytest.raises(ValueError, match=r"more than 128 MB \(--request-chat-template-mem"):
            await sandbox.render(_job(ALLOCATING))
        return await sandbox.render(_job("{{ ('x' * 1000000) | length }}"))
    assert _run(go, TemplateSandboxConfig(workers=1, memory_mb=128)) == "1000000"


def test_a_request_that_leaves_kills_its_render():
    """A cancel or deadline while the template runs: the process is killed then, not at the
    render's timeout, and the slot serves the next request."""
    async def go(sandbox):
        pid = sandbox.pids[0]
        task = asyncio.ensure_future(sandbox.render(_job(LOOPING)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(_gone, pid)
        return await asyncio.wait_for(sandbox.render(_job(OK)), 60)
    assert _run(go, TemplateSandboxConfig(workers=1, timeout_s=600.0)) == "<s>user: hi\n"


def test_renders_wait_for_a_free_process():
    async def go(sandbox):
        jobs = [_job(OK.replace("{{ bos_token }}", str(i))) for i in range(6)]
        return await asyncio.gather(*(sandbox.render(j) for j in jobs))
    assert _run(go, TemplateSandboxConfig(workers=2)) == [f"{i}user: hi\n" for i in range(6)]


def test_the_processes_die_with_the_router(tmp_path):
    """A router that exits abruptly (SIGKILL, a crash) leaves no template looping on."""
    script = tmp_path / "a_router.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, os, sys
        from router.template_sandbox import RenderJob, TemplateSandbox, TemplateSandboxConfig

        async def main():
            sandbox = TemplateSandbox(TemplateSandboxConfig(workers=2, timeout_s=600.0))
            await sandbox.start()
            job = RenderJob({LOOPING!r}, [], {{}}, None, True, False, {{}})
            asyncio.ensure_future(sandbox.render(job))
            await asyncio.sleep(0.5)
            print(*sandbox.pids, flush=True)
            os._exit(0)
        asyncio.run(main())
    """))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    with open(tmp_path / "stderr", "w") as err:  # a file: the children hold it, not a pipe
        out = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=err, text=True, timeout=120, env=env)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, (tmp_path / "stderr").read_text()
    assert all(_gone(p) for p in pids)


@pytest.mark.parametrize("kwargs, match", [
    ({"workers": 0}, "workers must be an integer in"),
    ({"workers": 1.5}, "workers must be an integer in"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"memory_mb": 32}, "memory_mb must be an integer >= 64"),
    ({"memory_mb": True}, "memory_mb must be an integer >= 64"),
])
def test_the_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TemplateSandboxConfig(**kwargs)
