"""The process a request's own chat template renders in (router/template_sandbox.py).

Jinja's sandbox bounds what a template reaches, not what it costs: two nested loops of a line
each run for minutes, and ``{{ "x" * 10**11 }}`` asks for 100 GB. Here that costs a process
the router kills (at --request-chat-template-timeout-s) or that fails its own allocation
(--request-chat-template-memory-mb), never the router's threads or memory.

Protocol, on stdin and stdout: frames of a 4-byte big-endian length and that many bytes of
UTF-8 JSON. The child writes ``{"ready": true}`` once it can render, then answers each job
(router/template_sandbox.py's RenderJob as a dict) with ``{"text": ...}`` or
``{"error": ..., "retire": bool}``; "retire" asks the router to replace it (after a
MemoryError its heap is not to be trusted). EOF on stdin ends it.
"""
from __future__ import annotations

import json
import math
import resource
import struct
import sys
import traceback
from typing import BinaryIO

from engine.process_exit import die_with_parent

HEADER = struct.Struct(">I")
# The rendered prompt must fit the model's context anyway (the workers check it in tokens);
# a template that writes more than this is refused here, before the text crosses the pipe.
MAX_RENDERED_CHARS = 64 * 1024 * 1024


def read_frame(stream: BinaryIO) -> dict | None:
    """The next frame's JSON; None at EOF."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    body = stream.read(HEADER.unpack(head)[0])
    return json.loads(body)


def write_frame(stream: BinaryIO, obj: dict) -> None:
    body = json.dumps(obj, ensure_ascii=False).encode()
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def _limit_memory(memory_mb: int) -> None:
    """Address space this process may still add: what is mapped now (the interpreter,
    transformers' renderer) plus ``memory_mb``."""
    try:
        with open("/proc/self/status") as f:
            mapped_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return
    limit = (mapped_kb * 1024) + memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(seconds: float) -> None:
    """A backstop for the router's wall-clock kill: the kernel ends this process once the job
    has used ``seconds`` more CPU (SIGXCPU), should the router not get to it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft = math.ceil(used + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def render(job: dict, memory_mb: int) -> dict:
    """One job's answer."""
    from engine.chat_template import render_template

    try:
        text = render_template(job["template"], job["conversation"], job["special_tokens"],
                               tools=job["tools"],
                               add_generation_prompt=job["add_generation_prompt"],
                               continue_final_message=job["continue_final_message"],
                               kwargs=job["kwargs"])
    except MemoryError:
        return _out_of_memory(memory_mb)
    except ValueError as e:  # ChatTemplateBroken among them
        if isinstance(e.__cause__, MemoryError):
            return _out_of_memory(memory_mb)
        return {"error": str(e), "retire": False}
    except RecursionError:
        return {"error": "the chat template recursed too deeply", "retire": True}
    if len(text) > MAX_RENDERED_CHARS:
        return {"error": f"the chat template rendered {len(text)} characters, over "
                         f"{MAX_RENDERED_CHARS}", "retire": False}
    return {"text": text}


def _out_of_memory(memory_mb: int) -> dict:
    return {"error": f"the chat template needed more than {memory_mb} MB "
                     "(--request-chat-template-memory-mb)", "retire": True}


def main(argv: list[str]) -> int:
    parent, memory_mb, cpu_s = int(argv[1]), int(argv[2]), float(argv[3])
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe carries frames only
    # SIGKILL when the router exits: a loop the router never got to kill must not outlive it
    # (Linux only; elsewhere the CPU limit still ends a runaway render).
    die_with_parent(parent)
    from engine.chat_template import chat_renderer

    chat_renderer()  # transformers' import (~1 s) before the memory limit and the first job
    _limit_memory(memory_mb)
    write_frame(out, {"ready": True})
    while (job := read_frame(sys.stdin.buffer)) is not None:
        _limit_cpu(cpu_s)
        try:
            answer = render(job, memory_mb)
        except Exception:  # a bug here, not the template's: said, and this process replaced
            answer = {"error": "rendering failed: " + traceback.format_exc(limit=-3),
                      "retire": True, "bug": True}
        write_frame(out, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
