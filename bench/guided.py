"""``pdserve bench guided``: guided decoding (guided_json / guided_regex) vs the same tokens
unguided, side by side in one engine.

The guided batch runs first on a fresh engine ("cold": every guide state it reaches walks the
vocabulary's trie once), then again ("warm": the allowed sets are cached per state, as for
the requests of a busy server that share a schema). The peer is the same prompts unguided,
each with ``max_tokens`` set to its guided output's length and ``ignore_eos``, so both batches
compute the same number of tokens with the same batch shapes; the ratio is guided tokens/s
over unguided.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from bench.workloads import random_tokens
from engine.presets import PRESETS

# A pydantic-style record: strings, bounded integers, an enum, an optional array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "role"],
}


@dataclass
class GuidedPoint:
    run: str  # "cold" or "warm"
    num_requests: int
    num_output_tokens: int
    guided_tok_s: float
    unguided_tok_s: float  # the peer: the same token counts, no guide
    ratio: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", choices=sorted(PRESETS))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--regex", default=None, help="guide by this pattern instead of the "
                   "built-in JSON schema")
    p.add_argument("--json", action="store_true")


def _timed(llm, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def run(args) -> list[GuidedPoint]:
    from engine import LLM, SamplingParams

    guide = {"guided_regex": args.regex} if args.regex else {"guided_json": SCHEMA}
    rng = random.Random(17)
    prompts = [random_tokens(rng, rng.randint(16, 96), 8000) for _ in range(args.num_requests)]
    guided = [SamplingParams(max_tokens=256, temperature=1.0, seed=i, **guide)
              for i in range(len(prompts))]
    points = []
    with LLM(args.model, num_gpu_blocks=1024) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm the model's paths
        for run_name in ("cold", "warm"):
            guided_s, outs = _timed(llm, prompts, guided)
            lengths = [len(o.token_ids) for o in outs]
            plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                     for i, n in enumerate(lengths)]
            plain_s, _ = _timed(llm, prompts, plain)
            total = sum(lengths)
            points.append(GuidedPoint(run_name, len(prompts), total, total / guided_s,
                                      total / plain_s, plain_s / guided_s))
    return points


def main(args) -> int:
    points = run(args)
    for p in points:
        if args.json:
            print(json.dumps(asdict(p)))
        else:
            print(f"{p.run}: {p.num_requests} requests, {p.num_output_tokens} tokens: guided "
                  f"{p.guided_tok_s:.0f} tok/s, unguided {p.unguided_tok_s:.0f} tok/s, "
                  f"ratio {p.ratio:.2f}")
    return 0
