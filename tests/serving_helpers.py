"""Shared pieces of the end-to-end serving tests."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import re
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from bench.greedy import MIN_GREEDY_GAP
from protos import common_pb2
from router.worker_handle import worker_stub

# The model of the serving tests that check the path a request takes (routing, KV transfer,
# migration, stops, failures) rather than the model's numbers, which test_engine_parity,
# test_tensor_parallel and test_cpu_graph check on the tiny presets against Hugging Face. Its
# step costs ~1/5 of tiny-llama's on this CPU. A module opts in with ``MODEL = SERVING_MODEL``
# and ``ClusterSpec(model=MODEL, ...)``; conftest's ``reference`` follows the module's MODEL.
SERVING_MODEL = "micro-llama"
# Small caches keep the workers light; 128 blocks of 16 tokens hold every test's requests.
WORKER_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "1024",
               "--heartbeat-interval-s", "0.3", "--kv-lease-timeout-s", "20"]
# For fuzzing: a huge (valid) max_tokens then ends within a second or two.
SHORT_CONTEXT_WORKER_ARGS = [*WORKER_ARGS[:2], "--max-model-len", "96", *WORKER_ARGS[4:]]


def _draw(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(rng.randint(lo, hi))]


def cluster_stats(router_address: str):
    """The router's GetClusterStats answer (router_pb2.ClusterStats)."""
    from protos import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(router_address) as ch:
        return router_pb2_grpc.RouterAdminStub(ch).GetClusterStats(
            router_pb2.ClusterStatsRequest(), timeout=10)


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [_draw(rng, lo, hi) for _ in range(n)]


def decisive_prompts(reference, n: int, seed: int, max_tokens: int | list[int], lo: int = 5,
                     hi: int = 120) -> list[list[int]]:
    """``n`` prompts drawn as ``random_prompts`` draws them, skipping any whose greedy output on
    ``reference`` (an LLM) has a step decided by less than MIN_GREEDY_GAP: a parity test on
    these compares the serving path's tokens, not float rounding. ``max_tokens``: one count,
    or the i-th kept prompt's."""
    return decisive_outputs(reference, n, seed, max_tokens, lo, hi)[0]


def decisive_outputs(reference, n: int, seed: int, max_tokens: int | list[int], lo: int = 5,
                     hi: int = 120) -> tuple[list[list[int]], list]:
    """``decisive_prompts``, and the reference's greedy output (ignore_eos, logprobs=2) of
    each, ``max(max_tokens)`` tokens long: a test that wants those need not generate them
    again (a few seconds at hundreds of tokens).

    The first ``n`` drawn prompts that qualify, in the order drawn. A candidate stops at its
    first undecided step unless a later count could still take it: most fail early, and
    generating them to the end was most of the search's time (~3x as long at 320 tokens)."""
    from engine import SamplingParams

    counts = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    if len(counts) != n:
        raise ValueError(f"{len(counts)} max_tokens for {n} prompts")
    params = SamplingParams(max_tokens=max(counts), temperature=0.0, ignore_eos=True,
                            logprobs=2)
    engine, rng = reference.engine, random.Random(seed)
    cands: list[_Candidate] = []
    running: dict[str, _Candidate] = {}
    while (kept := _qualified(cands, counts)) is None:
        while len(running) < max(1, n + 2 - sum(c.passing for c in cands)):
            cand = _Candidate(f"decisive-{next(_decisive_ids)}", _draw(rng, lo, hi))
            engine.add_request(cand.request_id, cand.prompt, params)
            cands.append(cand)
            running[cand.request_id] = cand
        for out in engine.step():
            cand = running.get(out.request_id)
            if cand is None:
                continue
            cand.take(out)
            if out.finished or cand.first_undecided < min(counts):
                del running[out.request_id]
                if not out.finished:
                    engine.abort(out.request_id)
    for rid in running:
        engine.abort(rid)
    if running:
        engine.step()  # the aborts free their blocks
    return [c.prompt for c in kept], [c.out for c in kept]


_decisive_ids = itertools.count()
_NEVER = 1 << 30


@dataclasses.dataclass
class _Candidate:
    """A prompt decisive_outputs tries: the step its greedy output first won by less than
    MIN_GREEDY_GAP (_NEVER while none has), and its final output once finished."""
    request_id: str
    prompt: list[int]
    first_undecided: int = _NEVER
    out: object = None
    checked: int = 0

    def take(self, out) -> None:
        for i in range(self.checked, len(out.logprobs)):
            top = out.logprobs[i].top
            if top[0].logprob - top[1].logprob < MIN_GREEDY_GAP:
                self.first_undecided = min(self.first_undecided, i)
        self.checked = len(out.logprobs)
        if out.finished:
            self.out = out

    @property
    def passing(self) -> bool:
        """Finished, and decided at every step."""
        return self.out is not None and self.first_undecided == _NEVER


def _qualified(cands: list[_Candidate], counts: list[int]) -> list[_Candidate] | None:
    """The first len(counts) candidates whose first undecided step comes after their count
    (the i-th kept one's), once every candidate before the last of them is decided; None
    while some is not."""
    kept: list[_Candidate] = []
    for cand in cands:
        decided = cand.out is not None or cand.first_undecided < min(counts)
        if not decided:
            return None
        if cand.out is not None and cand.first_undecided >= counts[len(kept)]:
            kept.append(cand)
            if len(kept) == len(counts):
                return kept
    return None


def explain_greedy_mismatch(reference, prompt: list[int], got: list[int],
                            want: list[int]) -> str:
    """A parity assertion's message: where ``got`` leaves ``want`` (``reference``'s greedy
    tokens for ``prompt``) and what the reference's logits said there. A step won by float
    rounding's margin (~3e-5) went the other way by rounding; one won by far more did not:
    then the serving path computed something else."""
    from engine import SamplingParams

    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        return f"{len(got)} tokens against the reference's {len(want)}"
    out = reference.generate([prompt], SamplingParams(
        max_tokens=k + 1, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    top = out.logprobs[k].top
    mine = next((t.logprob for t in top if t.token_id == got[k]), None)
    margin = "beyond the top 5" if mine is None else f"{top[0].logprob - mine:.2e}"
    return (f"token {k} is {got[k]}, the reference's {want[k]}: the reference won that step "
            f"over {got[k]} by {margin} (top 5 {[(t.token_id, round(t.logprob, 5)) for t in top]})"
            f"; {_oracle_says(reference, prompt + got[:k], want[k], got[k])}")


def _oracle_says(reference, context: list[int], want: int, got: int) -> str:
    """Which of the two tokens Hugging Face's model picks after ``context``: the reference may
    be the one that went wrong (its rerun above reads its prefix cache, which the first run
    filled, so a fault in that run repeats in it)."""
    from tests.hf_oracle import hf_last_logprobs

    lp = hf_last_logprobs(str(reference.engine.model_path), context)
    a, b = float(lp[want]), float(lp[got])
    winner = "the reference's" if a > b else "the served"
    return f"transformers picks {winner} token by {abs(a - b):.2e} (argmax {int(lp.argmax())})"


def worker_info(address: str) -> common_pb2.WorkerInfo:
    """A worker's info over a fresh channel, whichever its role. For polling in a hot loop, keep
    one channel open and call ``worker_stub(channel, role).GetWorkerInfo``."""
    with grpc.insecure_channel(address) as ch:
        try:
            return worker_stub(ch, "prefill").GetWorkerInfo(common_pb2.WorkerInfoRequest(),
                                                            timeout=10)
        except grpc.RpcError:
            return worker_stub(ch, "decode").GetWorkerInfo(common_pb2.WorkerInfoRequest(),
                                                           timeout=10)


def heartbeat_info(worker_id: str, role: str = "prefill", *, address: str = "127.0.0.1:1",
                   block_size: int = 16, num_free_blocks: int = 100, num_total_blocks: int = 0,
                   max_model_len: int = 0, model: str = "", model_fingerprint: str = "",
                   draining: bool = False) -> common_pb2.WorkerInfo:
    """A worker's info as the registry and directory tests publish it, no worker behind it:
    room to be routed to unless told otherwise, the proto's defaults for the rest."""
    return common_pb2.WorkerInfo(worker_id=worker_id, role=role, address=address,
                                 block_size=block_size, num_free_blocks=num_free_blocks,
                                 num_total_blocks=num_total_blocks, max_model_len=max_model_len,
                                 model=model, model_fingerprint=model_fingerprint,
                                 draining=draining)


def live_workers(cluster) -> list[str]:
    """The addresses of a cluster's workers still running (the killed and stopped left out)."""
    return [p.address for p in cluster.procs if p.role != "router" and p.popen.poll() is None]


def wait_all_blocks_free(addresses: list[str], timeout_s: float = 30.0) -> None:
    """Every worker idle with every block back in the free pool (cached blocks count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [worker_info(a) for a in addresses]
        busy = [i for i in infos if i.num_free_blocks != i.num_total_blocks or i.num_leased
                or i.num_running or i.num_waiting or i.num_inflight]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {busy}")
        time.sleep(0.1)


def stream_greedy(router_address: str, prompts: list[list[int]], max_tokens: list[int]):
    """Every prompt streamed at once through the router, greedy with ignore_eos: per prompt,
    (all token ids, the final chunk)."""
    from client import AsyncClient

    async def one(client, prompt, m):
        toks, final = [], None
        async for chunk in client.generate(prompt, max_tokens=m, temperature=0.0,
                                           ignore_eos=True):
            toks += chunk.token_ids
            final = chunk
        return toks, final

    async def run_all():
        async with AsyncClient(router_address, timeout=120) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))

    return asyncio.run(run_all())


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus text exposition as {(name, frozenset of label pairs): value}. Fails on a
    line that is not a comment or a well-formed sample, or a sample whose family has no TYPE."""
    typed: set[str] = set()
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        name, labels, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or family in typed, f"no TYPE for {name}"
        pairs = _LABEL.findall(labels or "")
        assert ",".join(f'{k}="{v}"' for k, v in pairs) == (labels or ""), line
        out[(name, frozenset(pairs))] = float(value)
    return out


def scrape(port: int, path: str = "/metrics", host: str = "127.0.0.1") -> tuple[int, str, str]:
    """(status, content type, body) of GET http://host:port/path (an IPv6 host bracketed)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_logprobs(got, want, abs_tol: float = 1e-4) -> None:
    """SDK TokenLogprobs (or None) against the in-process engine's: same tokens and ranks,
    logprobs within ``abs_tol`` (other processes, other batches)."""
    assert len(got) == len(want)
    rank_slips = []
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert a.sampled.token_id == b.sampled.token_id
        if a.sampled.rank != b.sampled.rank:
            rank_slips.append(abs(a.sampled.rank - b.sampled.rank))
        assert a.sampled.logprob == pytest.approx(b.sampled.logprob, abs=abs_tol)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert [t.token for t in (a.sampled, *a.top)] == [
            t.decoded_token for t in (b.sampled, *b.top)]
        assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top],
                                                           abs=abs_tol)
    # A prompt token deep in the tail (rank ~7000 of 8192) has neighbours closer than the
    # float noise between two processes' GEMMs (~1e-6): one may pass it in one and not the
    # other. Such a slip is rare and by one or two places; a wrong rank rule shows everywhere.
    assert len(rank_slips) <= max(1, len(want) // 16) and all(d <= 2 for d in rank_slips), \
        rank_slips


def final_output(engine, request_id: str):
    """Steps an LLMEngine until it has nothing left; ``request_id``'s finished output."""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final
