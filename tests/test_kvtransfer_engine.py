"""The engine's prefill and decode roles joined by kvtransfer across OS processes: TP 1->1,
2->1, 2->2 and 1->2 over NIXL and torch.distributed, decode tokens equal to one engine's
greedy tokens, releases and lease expiry on the owner, and a prefill worker that dies."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kvtransfer import KVAgentHandle, LayoutMismatchError, TransferError
from tests.kv_owner_proc import Standby
from tests.proc_signals import reap, stop_process

MAX_NEW = 8
pytestmark = pytest.mark.timeout(240)


_STANDBY: list[Standby] = []  # the module's pool of prefill processes, while it runs


@pytest.fixture(scope="module", autouse=True)
def _standby():
    """A prefill process kept ready, its imports (torch, NIXL, the engine) done while the test
    before runs: each test's PrefillProc then only builds its engine."""
    pool = Standby(engine=True)
    _STANDBY.append(pool)
    yield
    _STANDBY.remove(pool)
    pool.close()


@pytest.fixture(scope="module")
def model(preset_path):
    return str(preset_path("tiny-llama"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    shared = [rng.randint(5, 7000) for _ in range(32)]
    lengths = [5, 16, 23, 40, 57]
    out = [[rng.randint(5, 7000) for _ in range(n)] for n in lengths]
    # Two prompts that share 2 full blocks with the third: the decoder skips what it holds.
    out += [shared + [rng.randint(5, 7000) for _ in range(n)] for n in (3, 19)]
    return out


@pytest.fixture(scope="module")
def expected(model, prompts):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(model) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


class PrefillProc:
    """A prefill-role engine in its own process (tests/kv_owner_proc.py, engine mode).

    ``wait=False``: started, its handles read by ``wait_ready``, so that the caller builds its
    decode engine while this one starts (each takes seconds)."""

    def __init__(self, model: str, tp: int, backend: str, wait: bool = True, **extra) -> None:
        cfg = dict(model=model, role="prefill", tensor_parallel_size=tp, num_gpu_blocks=64,
                   kv_transfer_backend=backend, max_num_batched_tokens=32, **extra)
        argv = ["engine", json.dumps(cfg)]
        if _STANDBY:
            self.proc = _STANDBY[0].start(argv)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.kv_owner_proc", *argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "PrefillProc":
        try:
            self.handles = [KVAgentHandle.from_bytes(bytes.fromhex(h))
                            for h in json.loads(self._expect("HANDLES"))]
        except BaseException:
            self.close()
            raise
        return self

    def _expect(self, tag: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the prefill process exited (waiting for {tag})"
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]

    def _send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def prefill(self, rid: str, prompt: list[int]) -> dict:
        self._send({"op": "prefill", "id": rid, "prompt": prompt})
        return json.loads(self._expect("LEASE"))

    def stats(self) -> dict:
        self._send({"op": "stats"})
        return json.loads(self._expect("STATS"))

    def wait_stats(self, pred, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if pred(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        reap(self.proc)


def _decode_engine(model: str, tp: int, backend: str, **extra) -> LLMEngine:
    return LLMEngine(EngineConfig(model, role="decode", tensor_parallel_size=tp,
                                  num_gpu_blocks=64, kv_transfer_backend=backend, **extra))


def _started_side_by_side(prefill: PrefillProc, *builders):
    """The engines of ``builders``, built in turn while ``prefill`` (started with wait=False)
    starts; then ``prefill`` ready. One engine, or a tuple of them. A failure shuts down the
    engines already built and closes ``prefill``."""
    built = []
    try:
        for build in builders:
            built.append(build())
        prefill.wait_ready()
    except BaseException:
        for engine in built:
            engine.shutdown()
        prefill.close()
        raise
    return built[0] if len(built) == 1 else tuple(built)


def _all_free(engine: LLMEngine) -> bool:
    s = engine.get_stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_running == 0


def _disaggregate(prefill: PrefillProc, decode: LLMEngine, prompts, concurrent: bool):
    """Prefill every prompt over there, pull its blocks here, decode here; tokens per prompt.

    ``concurrent``: the pulls run in threads while this thread keeps stepping the decode
    engine (earlier requests decode while later ones transfer)."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    leases = [prefill.prefill(f"r{i}", p) for i, p in enumerate(prompts)]
    errors: list[BaseException] = []
    cached: dict[str, int] = {}

    def handoff(lease: dict) -> None:
        try:
            alloc = decode.add_prefilled_request(lease["id"], lease["prompt"],
                                                 lease["first_token"], params)
            cached[lease["id"]] = alloc.num_cached_tokens
            try:
                stats = decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 60.0)
            except BaseException:
                decode.abort(lease["id"])
                raise
            assert stats.num_blocks == len(alloc.block_ids_to_fill)
            decode.commit_prefilled(lease["id"])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = []
    results: dict[str, list[int]] = {}
    for lease in leases:
        if concurrent:
            threads.append(threading.Thread(target=handoff, args=(lease,)))
            threads[-1].start()
            for o in decode.step():  # decode keeps stepping while pulls run
                if o.finished:
                    results[o.request_id] = o.token_ids
        else:
            handoff(lease)
    for t in threads:
        t.join(120)
    assert errors == []
    deadline = time.monotonic() + 120
    while len(results) < len(prompts) and time.monotonic() < deadline:
        for o in decode.step():
            if o.finished:
                results[o.request_id] = o.token_ids
    return [results.get(f"r{i}") for i in range(len(prompts))], cached


@pytest.mark.parametrize("prefill_tp,decode_tp,backend,concurrent", [
    (1, 1, "nixl", True),
    # TP2 prefill into TP1 decode over NIXL also runs, as a cluster, in
    # tests/test_serving_cluster.py (test_tp2_prefill_worker_matches_the_in_process_engine).
    pytest.param(2, 1, "nixl", False, marks=pytest.mark.slow),
    (2, 2, "nixl", True),
    (1, 1, "torch", False),
    pytest.param(2, 1, "torch", True, marks=pytest.mark.slow),
    # TP1 prefill into TP2 decode over torch, in order: every prompt, with the same checks, in
    # test_a_decode_engine_lets_go_of_a_prefill_engine_on_every_rank, on the same engines.
])
def test_disaggregated_tokens_match_one_engine(model, prompts, expected, prefill_tp, decode_tp,
                                               backend, concurrent):
    prefill = PrefillProc(model, prefill_tp, backend, wait=False)
    decode = _started_side_by_side(prefill, lambda: _decode_engine(model, decode_tp, backend))
    try:
        got, cached = _disaggregate(prefill, decode, prompts, concurrent)
        assert got == expected
        if not concurrent:  # in order, the last two prompts find the shared prefix here
            assert cached["r6"] >= 32
        _assert_every_lease_released(prefill, decode, len(prompts))
    finally:
        decode.shutdown()
        prefill.close()


def _assert_every_lease_released(prefill, decode, num_prompts: int) -> None:
    """Each prompt's lease released by its pull, none expired, every block free on both
    sides, and one transfer a prompt without a failure."""
    s = prefill.wait_stats(lambda s: s["leased"] == 0)
    assert (s["free"], s["leased"], s["released"], s["expired"]) == (
        s["total"], 0, num_prompts, 0)
    assert _all_free(decode)
    counters = decode.kv_transfer_counters()
    assert counters.transfers == num_prompts and counters.failures == 0


def test_a_decode_engine_lets_go_of_a_prefill_engine_on_every_rank(model, prompts, expected):
    """A decode worker drops the connections to a prefill worker that left (engine/kv_peers.py):
    both TP ranks here, rank 1 through the TP KV channel; a later pull connects again. And,
    with the checks test_disaggregated_tokens_match_one_engine makes of the other pairs, TP1
    prefill into TP2 decode over torch, in order (one start-up for both: each took ~4 s)."""
    prefill = PrefillProc(model, 1, "torch", wait=False)
    decode = _started_side_by_side(prefill, lambda: _decode_engine(model, 2, "torch"))
    try:
        assert _disaggregate(prefill, decode, prompts[:1], concurrent=False)[0] == expected[:1]
        names = [h.agent_name for h in prefill.handles]
        assert decode.kv_peer_names() == names
        assert prefill.stats()["readers"] == 2  # one connection from each decode rank
        assert decode.forget_kv_peers(names) == []
        assert decode.kv_peer_names() == []
        assert prefill.wait_stats(lambda s: s["readers"] == 0)["readers"] == 0
        got, cached = _disaggregate(prefill, decode, prompts[1:], concurrent=False)
        assert got == expected[1:]
        assert prefill.stats()["readers"] == 2
        assert cached["r5"] >= 32  # prompts[6], after prompts[5]: the shared prefix is here
        _assert_every_lease_released(prefill, decode, len(prompts))
    finally:
        decode.shutdown()
        prefill.close()


def test_lease_expiry_frees_an_idle_owners_blocks(model):
    prefill = PrefillProc(model, 1, "nixl", kv_lease_timeout_s=1.0)
    try:
        lease = prefill.prefill("lost", list(range(100, 150)))
        held = prefill.stats()
        assert held["leased"] == 1 and held["free"] <= held["total"] - len(lease["block_ids"])
        # Nobody pulls and the engine never steps again: the connector's poller reclaims.
        s = prefill.wait_stats(lambda s: s["leased"] == 0, timeout=15)
        assert (s["free"], s["leased"], s["expired"], s["released"]) == (s["total"], 0, 1, 0)
    finally:
        prefill.close()


@pytest.mark.parametrize("backend", ["nixl", "torch"])
def test_a_reader_cut_before_its_pull_frees_the_owners_lease_without_reading(model, backend):
    """decode_svc's word that a lease will not be read (its request was cut before the pull):
    the owner, told by the router that a read might still come, frees the blocks then, not
    at the lease's expiry (60 s here)."""
    prefill = PrefillProc(model, 1, backend, wait=False)
    decode = _started_side_by_side(prefill, lambda: _decode_engine(model, 1, backend))
    try:
        prefill.prefill("cut", list(range(100, 150)))
        decode.release_unread_kv(prefill.handles, "cut")
        s = prefill.wait_stats(lambda s: s["leased"] == 0, timeout=15)
        assert (s["free"], s["leased"], s["expired"], s["released"]) == (s["total"], 0, 0, 1)
        assert decode.kv_transfer_counters().transfers == 0  # nothing was read
    finally:
        decode.shutdown()
        prefill.close()


def test_layout_mismatch_and_dead_prefill_leave_no_blocks(model, preset_path):
    prefill = PrefillProc(model, 1, "torch", wait=False)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    other, decode = _started_side_by_side(
        prefill,
        lambda: LLMEngine(EngineConfig(str(preset_path("tiny-qwen3")), role="decode",
                                       num_gpu_blocks=32, kv_transfer_backend="torch")),
        lambda: _decode_engine(model, 1, "torch"))
    try:
        lease = prefill.prefill("a", list(range(200, 240)))
        alloc = other.add_prefilled_request("a", lease["prompt"], lease["first_token"], params)
        with pytest.raises(LayoutMismatchError, match="head_size"):
            other.pull_kv(alloc, prefill.handles, lease["block_ids"], 10.0)
        other.abort("a")
        assert _all_free(other) and other.kv_transfer_counters().transfers == 0
        with pytest.raises(ValueError, match="needs"):
            decode.pull_kv(decode.add_prefilled_request("b", lease["prompt"],
                                                        lease["first_token"], params),
                           prefill.handles, lease["block_ids"][:-1], 10.0)
        decode.abort("b")
        # Neither reads the lease, and says so: the router, told INVALID_ARGUMENT, left the
        # lease to the reader's word (ReleaseKV may_be_read), else held until its expiry.
        s = prefill.wait_stats(lambda s: s["leased"] == 0, timeout=15)
        assert (s["free"], s["leased"], s["expired"]) == (s["total"], 0, 0)
        prefill.proc.kill()
        prefill.proc.wait()
        alloc = decode.add_prefilled_request("c", lease["prompt"], lease["first_token"], params)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 5.0)
        assert time.monotonic() - t0 < 20
        decode.abort("c")
        assert _all_free(decode) and decode.kv_transfer_counters().failures == 1
    finally:
        other.shutdown()
        decode.shutdown()
        prefill.close()


def _connected_over_tcp(model: str, kv_quarantine_s: float):
    """A prefill process and a decode engine over NIXL (UCX_TLS set by the caller), connected
    by one pull while the owner runs; and greedy sampling parameters."""
    prefill = PrefillProc(model, 1, "nixl", wait=False)
    decode = _started_side_by_side(
        prefill, lambda: _decode_engine(model, 1, "nixl", kv_quarantine_s=kv_quarantine_s))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        warm = prefill.prefill("warm", list(range(300, 340)))
        alloc = decode.add_prefilled_request("warm", warm["prompt"], warm["first_token"], params)
        decode.pull_kv(alloc, prefill.handles, warm["block_ids"], 30.0)
        decode.abort("warm")
    except BaseException:
        decode.shutdown()
        prefill.close()
        raise
    return prefill, decode, params


def test_a_read_left_in_flight_quarantines_its_blocks(model, monkeypatch):
    """Over UCX's TCP transport a READ from a stopped owner stays in flight past the timeout,
    and it does land once the owner resumes: the blocks it targets must not be reused until
    the quarantine ends, and then they all come back."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # shared-memory reads would finish without the owner
    prefill, decode, params = _connected_over_tcp(model, kv_quarantine_s=3.0)
    try:
        lease = prefill.prefill("q", list(range(400, 600)))
        stop_process(prefill.proc)  # stopped for sure: a live owner would serve the READ
        try:
            alloc = decode.add_prefilled_request("q", lease["prompt"], lease["first_token"],
                                                 params)
            with pytest.raises(TransferError) as err:
                decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 1.0)
            assert err.value.writes_may_land
            decode.abort("q")  # what the decode service does; the quarantine outranks it
            s = decode.get_stats()
            assert s.num_quarantined == 1
            assert s.num_free_blocks == s.num_total_blocks - len(alloc.block_ids)
            with pytest.raises(ValueError, match="already in the engine"):
                decode.add_prefilled_request("q", lease["prompt"], lease["first_token"], params)
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while decode.get_stats().num_quarantined and time.monotonic() < deadline:
            time.sleep(0.1)  # the connector's poller ends the quarantine on an idle engine
        assert _all_free(decode) and decode.get_stats().num_quarantined == 0
    finally:
        decode.shutdown()
        prefill.close()


def test_a_pull_cut_short_while_its_owner_serves_it_quarantines_nothing(model, monkeypatch):
    """A deadline that runs out mid-pull (a READ posted, the owner alive) fails the pull, but
    the READ then lands within the settle window: nothing may write into the blocks any more,
    so they are free at once instead of quarantined for kv_quarantine_s."""
    from kvtransfer import nixl_reader

    monkeypatch.setenv("UCX_TLS", "tcp")  # slower than shared memory: the READ is still posted
    prefill, decode, params = _connected_over_tcp(model, kv_quarantine_s=600.0)
    posted = []
    wait = nixl_reader.NixlReader._wait

    def cut_at_once(self, handles, deadline, names):  # the deadline ends as the READ is posted
        posted.append(len(handles))
        # The first look sees every READ in flight, as over a slow link: on a fast machine a
        # READ over loopback TCP was DONE at the first look, and a READ done is a pull done.
        real, looked = self.agent.check_xfer_state, set()

        def first_in_flight(h):
            if id(h) not in looked:
                looked.add(id(h))
                return "PROC"
            return real(h)

        self.agent.check_xfer_state = first_in_flight
        try:
            return wait(self, handles, time.monotonic() - 1.0, names)
        finally:
            del self.agent.check_xfer_state  # the class's own again

    monkeypatch.setattr(nixl_reader.NixlReader, "_wait", cut_at_once)
    try:
        lease = prefill.prefill("c", list(range(400, 900)))
        alloc = decode.add_prefilled_request("c", lease["prompt"], lease["first_token"], params)
        with pytest.raises(TransferError) as err:
            decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 30.0)
        assert posted and not err.value.writes_may_land
        decode.abort("c")
        s = decode.get_stats()
        assert s.num_quarantined == 0 and _all_free(decode)
    finally:
        decode.shutdown()
        prefill.close()


def test_a_failed_pulls_error_does_not_wait_for_its_release_to_reach_the_owner(model):
    """A failed pull tells its owner the read is over, without holding the error back for it:
    over torch it connects afresh, and an owner that does not answer (stopped here; a host
    gone off the network alike) held the pull's thread and its error for the notification's
    10 s, and then the owner, once back, was never told. The error comes while the owner is
    still stopped, and the owner, resumed, is told."""
    prefill = PrefillProc(model, 1, "torch", wait=False)
    decode = _started_side_by_side(prefill, lambda: _decode_engine(model, 1, "torch"))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        lease = prefill.prefill("late", list(range(400, 440)))
        alloc = decode.add_prefilled_request("late", lease["prompt"], lease["first_token"],
                                             params)
        stop_process(prefill.proc)
        try:
            with pytest.raises(TransferError, match="deadline passed"):
                decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 30.0,
                               deadline=time.monotonic() - 0.01)
            decode.abort("late")
            assert _all_free(decode)
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        s = prefill.wait_stats(lambda s: s["leased"] == 0, timeout=15)
        assert (s["free"], s["leased"], s["expired"], s["released"]) == (s["total"], 0, 0, 1)
    finally:
        decode.shutdown()
        prefill.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pull_whose_deadline_passed_before_it_started_posts_nothing(model, tp):
    """The decode service's deadline is absolute (the prefill lease's end): a pull that waited
    for a thread past it fails on every rank before any read is posted, however much of its
    timeout is left. Counted from its start, it read blocks the owner might have reused."""
    prefill = PrefillProc(model, 1, "nixl", wait=False)
    decode = _started_side_by_side(prefill, lambda: _decode_engine(model, tp, "nixl"))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        lease = prefill.prefill("late", list(range(400, 440)))
        alloc = decode.add_prefilled_request("late", lease["prompt"], lease["first_token"],
                                             params)
        before = decode.executor.read_blocks(tp - 1, alloc.block_ids_to_fill).clone() \
            if tp > 1 else decode.kv_cache[alloc.block_ids_to_fill].clone()
        with pytest.raises(TransferError) as err:
            decode.pull_kv(alloc, prefill.handles, lease["block_ids"], 30.0,
                           deadline=time.monotonic() - 0.01)
        assert not err.value.writes_may_land
        if tp > 1:  # the other ranks keep rank 0's deadline, not a timeout of their own
            remote_ids = lease["block_ids"][alloc.num_cached_blocks:]
            [rank1] = decode.executor.start_worker_pulls(
                prefill.handles, remote_ids, alloc.block_ids_to_fill, time.monotonic() - 0.01)
            with pytest.raises(TransferError, match="after its deadline") as err:
                rank1.result(timeout=30)
            assert not err.value.writes_may_land
        after = decode.executor.read_blocks(tp - 1, alloc.block_ids_to_fill) \
            if tp > 1 else decode.kv_cache[alloc.block_ids_to_fill]
        assert bool((after == before).all())
        decode.abort("late")
        assert _all_free(decode) and decode.get_stats().num_quarantined == 0
        # A failed pull commits nothing, so it tells the owner its read is over: a lease the
        # router left to this reader (ReleaseKV may_be_read) is freed now, not at its expiry.
        s = prefill.wait_stats(lambda s: s["leased"] == 0, timeout=15)
        assert (s["free"], s["leased"], s["expired"], s["released"]) == (s["total"], 0, 0, 1)
    finally:
        decode.shutdown()
        prefill.close()


def test_a_decode_engine_connects_to_a_prefill_engine_ahead_of_its_first_pull(model, expected,
                                                                              prompts):
    prefill = PrefillProc(model, 1, "nixl", wait=False)
    decode, other = _started_side_by_side(
        prefill, lambda: _decode_engine(model, 1, "nixl"),
        lambda: _decode_engine(model, 1, "torch"))
    try:
        assert decode.kv_peer_names() == []
        assert decode.preconnect_kv(prefill.handles) is True
        assert decode.kv_peer_names() == sorted(h.agent_name for h in prefill.handles)
        assert decode.preconnect_kv(prefill.handles) is True  # again: already known, no harm
        # The pull that follows uses that connection and moves the right bytes.
        assert _disaggregate(prefill, decode, prompts[:2], concurrent=False)[0] == expected[:2]
        # A handle of another backend is refused, as a pull from it would be.
        with pytest.raises(ValueError, match="backend"):
            other.preconnect_kv(prefill.handles)
    finally:
        other.shutdown()
        decode.shutdown()
        prefill.close()


def test_a_prefill_engines_owner_expects_reads_only_while_it_leases_blocks(model):
    """The owner's fast NIXL progress loop runs while a lease is out, and its slow one
    otherwise: a release notice alone no longer keeps it fast for a second."""
    from kvtransfer.nixl_agent import _OWNER_IDLE_PROGRESS_S, _OWNER_PROGRESS_S, progress_interval

    engine = LLMEngine(EngineConfig(model, role="prefill", num_gpu_blocks=64,
                                    kv_transfer_backend="nixl"))
    try:
        agent = engine.executor.kv_agent
        assert agent._reads_due_now() is False
        # The owner hears of each lease as it is made (then its reader never waits for an
        # idle poll to end: tests/test_kvtransfer.py), and finds it made when it looks.
        announced: list[int] = []
        real = agent.reads_due_soon
        agent.reads_due_soon = lambda: (announced.append(engine.num_leases), real())
        engine.add_request("r0", list(range(100, 140)),
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        [out] = engine.step()
        assert out.kv_lease is not None and agent._reads_due_now() is True
        assert announced == [1]
        engine.release_kv("r0")
        engine.step()
        assert engine.num_leases == 0 and agent._reads_due_now() is False
    finally:
        engine.shutdown()
    # A fresh notice with no read due: the idle interval; a lease out: the fast one.
    assert progress_interval(True, 0.0, reads_due=False) == _OWNER_IDLE_PROGRESS_S
    assert progress_interval(True, 10.0, reads_due=True) == _OWNER_PROGRESS_S


def test_a_prefill_tp_rank_tells_its_owner_after_each_step(monkeypatch):
    """Leases live on rank 0, so ranks 1.. take each step as the cue that a reader of their
    heads may follow; a decode rank (passed no owner) tells nobody."""
    from multiprocessing import Pipe

    from engine import tp_comm, tp_worker

    class Runner:
        def __init__(self) -> None:
            self.steps = 0

        def run(self, model_input) -> None:
            self.steps += 1

    class Owner:
        def __init__(self) -> None:
            self.cues = 0

        def reads_due_soon(self) -> None:
            self.cues += 1

    monkeypatch.setattr(tp_worker, "decode_model_input", lambda payload, device: payload)
    for owner in (Owner(), None):
        ours, theirs = Pipe()
        for _ in range(3):
            tp_comm.send(theirs, tp_comm.OP_STEP, b"step")
        tp_comm.send(theirs, tp_comm.OP_QUIT)
        runner = Runner()
        tp_worker._loop(runner, ours, "cpu", owner)
        assert runner.steps == 3
        if owner is not None:
            assert owner.cues == 3
