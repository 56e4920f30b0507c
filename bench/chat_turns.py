"""``pdserve bench chat_turns``: a chat's next turn, prefilled where its reply's KV already is.

Two-turn chats through a disaggregated cluster (one prefill and one decode worker, as ``pdserve
up`` starts them): turn 1 is ``--prompt-len`` random tokens with a ``--reply-len`` greedy
reply; turn 2 is turn 1's prompt, the reply and ``--new-len`` new tokens. The decode worker
that streamed the reply holds its KV, so with ``--decode-prefix-reuse-min-tokens`` at its
default the router lets that worker prefill turn 2 from its cache; the peer is the same
cluster with that rule off (0), where the prefill worker recomputes the reply and sends the
whole prompt's KV. Each setting has a cluster of its own; they alternate round by round on
fresh chats, one chat at a time. Reported: turn-2 TTFT (median, mean) per setting, where turn 2
ran (``local_prefill``) and its cached tokens, and the ratio reuse / off of the medians.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.serve_runs import quiet_cluster
from bench.workloads import random_tokens

SETTINGS = {"reuse": None, "off": "0"}  # the router flag's value (None: its default)
TURN2_TOKENS = 4  # turn 2 is timed to its first token; a few more show it streams


@dataclass
class TurnRun:
    setting: str
    round: int
    ttft_ms: list[float] = field(default_factory=list)  # turn 2, one per chat
    local: int = 0  # turn 2 prefilled on the decode worker
    cached_tokens: list[int] = field(default_factory=list)


@dataclass
class ChatTurnsReport:
    prompt_len: int
    reply_len: int
    new_len: int
    runs: list[TurnRun]
    median_ttft_ms: dict[str, float]
    ratio: float  # reuse / off, medians over the pooled rounds


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--chats", type=int, default=8, help="chats per setting and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--reply-len", type=int, default=200)
    p.add_argument("--new-len", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check(args: argparse.Namespace) -> None:
    for name in ("chats", "rounds", "prompt_len", "reply_len", "new_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def _run(args, setting: str, rnd: int, vocab: int) -> TurnRun:
    from client import Client
    from router.launcher import ClusterSpec

    flag = SETTINGS[setting]
    rng = random.Random(f"{args.seed}-{rnd}")  # both settings of a round get the same chats
    spec = ClusterSpec(model=args.model,
                       router_args=[] if flag is None else
                       ["--decode-prefix-reuse-min-tokens", flag])
    run = TurnRun(setting, rnd)
    greedy = dict(temperature=0.0, ignore_eos=True)
    with quiet_cluster(spec) as cluster, Client(cluster.router_address, timeout=300) as c:
        for i in range(args.chats):
            prompt = random_tokens(rng, args.prompt_len, vocab)
            first = c.complete(prompt, max_tokens=args.reply_len, **greedy)
            new = random_tokens(rng, args.new_len, vocab)
            time.sleep(0.5)  # the reply's blocks reach the prefix index (workers publish per step)
            second = c.complete(prompt + first.token_ids + new, max_tokens=TURN2_TOKENS,
                                **greedy)
            u = second.usage
            run.ttft_ms.append(u.timings.ttft_s * 1e3)
            run.local += u.local_prefill
            run.cached_tokens.append(u.cached_tokens)
    return run


def main(args: argparse.Namespace) -> int:
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    _check(args)
    model = ModelConfig.from_pretrained(resolve_model(args.model))
    vocab, context = model.vocab_size, model.max_position_embeddings
    if args.prompt_len + args.reply_len + args.new_len + TURN2_TOKENS > context:
        raise ValueError(f"a chat's two turns ({args.prompt_len} + {args.reply_len} + "
                         f"{args.new_len} + {TURN2_TOKENS} tokens) must fit the model's "
                         f"{context}-token context")
    runs = []
    for rnd in range(args.rounds):
        for setting in SETTINGS:
            print(f"[bench chat_turns] round {rnd}: {setting}", file=sys.stderr, flush=True)
            runs.append(_run(args, setting, rnd, vocab))
    med = {s: statistics.median(t for r in runs if r.setting == s for t in r.ttft_ms)
           for s in SETTINGS}
    report = ChatTurnsReport(args.prompt_len, args.reply_len, args.new_len, runs, med,
                             med["reuse"] / med["off"])
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        _print(report)
    return 0


def _print(r: ChatTurnsReport) -> None:
    print(f"## A chat's next turn: turn 1 {r.prompt_len} tokens + {r.reply_len}-token reply, "
          f"turn 2 adds {r.new_len}")
    print("| setting | round | turn-2 TTFT median ms | mean ms | on the decode worker | "
          "cached tokens |")
    print("|---|---|---|---|---|---|")
    for run in r.runs:
        print(f"| {run.setting} | {run.round} | {statistics.median(run.ttft_ms):.1f} | "
              f"{statistics.fmean(run.ttft_ms):.1f} | {run.local}/{len(run.ttft_ms)} | "
              f"{min(run.cached_tokens)}-{max(run.cached_tokens)} |")
    print(f"\nturn-2 TTFT median, reuse / off: {r.median_ttft_ms['reuse']:.1f} / "
          f"{r.median_ttft_ms['off']:.1f} ms = **{r.ratio:.2f}**")
