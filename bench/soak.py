"""``pdserve bench soak``: a cluster under minutes of mixed traffic: wrong tokens, failed
requests, and each process's memory over time.

A cluster (``pdserve up``'s processes: ``--num-prefill`` prefill workers, one decode worker, the
router) serves ``--concurrency`` client loops for ``--duration`` seconds. Each request draws a
prompt from a pool and an output length; ``--cancel-fraction`` of them are cancelled
mid-stream. Prompts share prefixes of odd lengths, so whole- and partial-block prefix hits
happen on the workers, and cancels end requests at every stage. Every finished greedy output is
compared with the in-process engine's, computed with prefix caching off (each prompt's own
answer); the pool keeps only prompts whose every step is won by ``MIN_GREEDY_GAP``, so float
rounding cannot flip a token (bench/greedy.py). Each service's resident memory (VmRSS) is
sampled every ``--sample-every`` seconds: a leak shows as growth from the first sample after
warm-up to the last.

Exit status 1 when a token differed or a request failed; memory is reported, not judged.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field

from bench.greedy import greedy_is_decisive
from bench.workloads import random_tokens
from client import AsyncClient
from client.errors import PdserveError
from engine import LLM, SamplingParams
from engine.cli_serve import tokenizer_flags
from router.launcher import Cluster, ClusterSpec

# Shared prefixes (lengths drawn in PREFIX_LEN) each followed by an own suffix.
NUM_PREFIXES = 6
PREFIX_LEN = (10, 70)
SUFFIX_LEN = (1, 40)
# Candidates drawn for the pool; the decisive ones are kept.
POOL_CANDIDATES = 120


def add_traffic_args(p: argparse.ArgumentParser) -> None:
    """The traffic's flags, shared with bench/chaos.py."""
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="a tokenizer folder other than the model's (the engine's and the "
                        "cluster's)")
    p.add_argument("--max-tokens", type=int, default=40, help="the longest output drawn")
    p.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="share of requests cancelled after a random number of tokens")
    p.add_argument("--pool-candidates", type=int, default=POOL_CANDIDATES,
                   help="prompts drawn for the pool (the decisive ones are kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def check_traffic_args(args: argparse.Namespace) -> None:
    if args.concurrency < 1 or args.max_tokens < 1 or args.pool_candidates < 1:
        raise ValueError("--concurrency, --max-tokens and --pool-candidates must be >= 1")
    if not 0 <= args.cancel_fraction <= 1:
        raise ValueError("--cancel-fraction must be in [0, 1]")


def add_args(p: argparse.ArgumentParser) -> None:
    add_traffic_args(p)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=16, help="client loops")
    p.add_argument("--num-prefill", type=int, default=1,
                   help="prefill workers (0: the decode worker prefills every prompt)")
    p.add_argument("--sample-every", type=float, default=60.0,
                   help="seconds between memory samples")


def check_args(args: argparse.Namespace) -> None:
    if not args.duration > 0 or not args.sample_every > 0:
        raise ValueError("--duration and --sample-every must be > 0 seconds")
    if args.num_prefill < 0:
        raise ValueError("--num-prefill must be >= 0")
    check_traffic_args(args)


@dataclass
class MemorySample:
    at_s: float  # since the traffic began
    requests_done: int
    rss_mb: dict[str, int]  # service name -> VmRSS (MiB); -1 once it has exited


@dataclass
class SoakReport:
    duration_s: float
    pool_size: int
    finished: int = 0
    cancelled: int = 0
    wrong: int = 0  # finished requests whose tokens differ from the engine's
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, for the reader
    mismatches: list[str] = field(default_factory=list)
    samples: list[MemorySample] = field(default_factory=list)

    def growth_mb(self) -> dict[str, int]:
        """Per service: VmRSS at the last sample minus at the second (the first one after a
        sample-interval of traffic: caches and pools warmed up)."""
        if len(self.samples) < 3:
            return {}
        warm, last = self.samples[1].rss_mb, self.samples[-1].rss_mb
        return {name: last[name] - warm[name] for name in last if name in warm}


def vm_rss_mb(pid: int) -> int:
    """A process's resident memory in MiB (-1: gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return -1


def make_pool(model: str, rng: random.Random, candidates: int, max_tokens: int,
              tokenizer: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt, the engine's greedy output of max_tokens) for the decisive candidates."""
    with LLM(model, tokenizer=tokenizer, enable_prefix_caching=False) as llm:
        vocab = llm.engine.model_config.vocab_size
        prefixes = [random_tokens(rng, rng.randint(*PREFIX_LEN), vocab)
                    for _ in range(NUM_PREFIXES)]
        prompts = [rng.choice(prefixes) + random_tokens(rng, rng.randint(*SUFFIX_LEN), vocab)
                   for _ in range(candidates)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True, logprobs=2))
    return [(p, o.token_ids) for p, o in zip(prompts, outs)
            if greedy_is_decisive(o, max_tokens)]


class Traffic:
    """Client loops of mixed requests, each checked against the pool's answer into a
    SoakReport (bench/chaos.py drives the same traffic)."""

    def __init__(self, args: argparse.Namespace, pool, report: SoakReport) -> None:
        self.args, self.pool, self.report = args, pool, report
        self.rng = random.Random(args.seed + 1)

    async def one(self, client: AsyncClient) -> None:
        prompt, want = self.rng.choice(self.pool)
        n = self.rng.randint(1, self.args.max_tokens)
        cut = (self.rng.randint(1, n) if self.rng.random() < self.args.cancel_fraction
               else None)
        got: list[int] = []
        r = self.report
        try:
            stream = client.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
            async with contextlib.aclosing(stream):  # closing it cancels the call at once
                async for chunk in stream:
                    got.extend(chunk.token_ids)
                    if cut is not None and len(got) >= cut:
                        r.cancelled += 1
                        return
        except PdserveError as e:
            r.failed += 1
            if len(r.errors) < 5:
                r.errors.append(f"{type(e).__name__}: {e}")
            return
        r.finished += 1
        if got != want[:n]:
            r.wrong += 1
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), n))
            if len(r.mismatches) < 5:
                r.mismatches.append(f"prompt of {len(prompt)} tokens, {n} asked: token {k} "
                                    f"differs ({len(got)} received)")

    async def loop(self, client: AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            await self.one(client)


async def _soak(cluster: Cluster, args: argparse.Namespace, traffic: Traffic) -> None:
    report = traffic.report
    t0 = time.monotonic()
    end = t0 + args.duration

    def sample() -> None:
        report.samples.append(MemorySample(
            round(time.monotonic() - t0, 1), report.finished + report.cancelled + report.failed,
            {p.name: vm_rss_mb(p.popen.pid) for p in cluster.procs}))

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(args.sample_every)

    watch = asyncio.ensure_future(sampler())
    try:
        async with AsyncClient(cluster.router_address, timeout=600) as client:
            await asyncio.gather(*(traffic.loop(client, end) for _ in range(args.concurrency)))
    finally:
        watch.cancel()
    sample()


def main(args: argparse.Namespace) -> int:
    check_args(args)
    pool = make_pool(args.model, random.Random(args.seed), args.pool_candidates, args.max_tokens,
                     args.tokenizer)
    if not pool:
        raise ValueError(f"none of {args.pool_candidates} prompts is decisive over "
                         f"{args.max_tokens} tokens: ask for fewer --max-tokens")
    report = SoakReport(args.duration, len(pool))
    tok = tokenizer_flags(args.tokenizer)
    spec = ClusterSpec(model=args.model, num_prefill=args.num_prefill, num_decode=1,
                       worker_args=tok, router_args=tok)
    with Cluster(spec) as cluster:
        asyncio.run(_soak(cluster, args, Traffic(args, pool, report)))
    if args.json:
        print(json.dumps({**asdict(report), "growth_mb": report.growth_mb()}, indent=2))
    else:
        print(format_report(report))
    return 1 if report.wrong or report.failed else 0


def format_report(r: SoakReport) -> str:
    lines = [f"soak: {r.duration_s:g} s, a pool of {r.pool_size} decisive prompts",
             f"requests: {r.finished} finished ({r.wrong} with a wrong token), {r.cancelled} "
             f"cancelled, {r.failed} failed"]
    lines += [f"  wrong: {m}" for m in r.mismatches] + [f"  failed: {e}" for e in r.errors]
    names = list(r.samples[-1].rss_mb) if r.samples else []
    lines.append("VmRSS (MiB) at " + ", ".join(names))
    for s in r.samples:
        lines.append(f"  {s.at_s:8.1f} s  {s.requests_done:7d} requests  "
                     + "  ".join(f"{s.rss_mb.get(n, -1):6d}" for n in names))
    growth = r.growth_mb()
    if growth:
        lines.append("growth since the second sample (MiB): "
                     + ", ".join(f"{n} {g:+d}" for n, g in growth.items()))
    return "\n".join(lines)
