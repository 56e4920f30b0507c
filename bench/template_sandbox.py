"""What rendering a request's own chat template in a child process costs
(router/template_sandbox.py) against rendering it in a router thread, as the router did
before: the same template and chat, alternating in rounds, one render at a time.

    python -m bench.template_sandbox [--renders N] [--rounds N] [--turns N]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engine.chat_template import render_template
from router.template_sandbox import RenderJob, TemplateSandbox, TemplateSandboxConfig

# The shape of a model's tool-use template: a system turn listing the tools, then the turns.
TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}<|system|>You may call:\n{%- for t in tools -%}"
    "{{ t['function']['name'] }}: {{ t['function']['description'] }}\n{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] | trim }}"
    "{%- if m.get('tool_calls') -%}{%- for c in m['tool_calls'] -%}"
    "<call>{{ c['function'] | tojson }}</call>{%- endfor -%}{%- endif -%}{{ eos_token }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing.",
                                           "parameters": {"type": "object"}}}
         for i in range(4)]


def _job(turns: int) -> RenderJob:
    chat = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"Turn {i}: " + "words and more words " * 10} for i in range(turns)]
    return RenderJob(TEMPLATE, chat, {"bos_token": "<s>", "eos_token": "</s>"}, TOOLS, True,
                     False, {})


def _in_thread(job: RenderJob) -> str:
    return render_template(job.template, job.conversation, job.special_tokens, tools=job.tools,
                           add_generation_prompt=job.add_generation_prompt,
                           continue_final_message=job.continue_final_message,
                           kwargs=job.kwargs)


async def _run(renders: int, rounds: int, turns: int) -> None:
    job = _job(turns)
    sandbox = TemplateSandbox(TemplateSandboxConfig(workers=1))
    await sandbox.start()
    try:
        if await sandbox.render(job) != await asyncio.to_thread(_in_thread, job):
            raise SystemExit("the two renders differ")
        child, thread = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(renders):
                await sandbox.render(job)
            child.append((time.perf_counter() - t) / renders * 1e3)
            t = time.perf_counter()
            for _ in range(renders):
                await asyncio.to_thread(_in_thread, job)
            thread.append((time.perf_counter() - t) / renders * 1e3)
        with open(f"/proc/{sandbox.pids[0]}/status") as f:
            rss = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    finally:
        await sandbox.close()
    print(f"{turns} turns, {len(_in_thread(job))} characters rendered; ms a render, "
          f"{rounds} rounds of {renders}")
    print(f"child process: {' '.join(f'{x:.3f}' for x in child)}")
    print(f"router thread: {' '.join(f'{x:.3f}' for x in thread)}")
    print(f"median child / thread: {statistics.median(child) / statistics.median(thread):.2f}, "
          f"+{statistics.median(child) - statistics.median(thread):.3f} ms a render; "
          f"a child's RSS {int(rss) / 1024:.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--renders", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turns", type=int, default=8)
    args = p.parse_args(argv)
    asyncio.run(_run(args.renders, args.rounds, args.turns))


if __name__ == "__main__":
    main()
