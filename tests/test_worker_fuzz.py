"""The decode worker against KV handles a prefill worker never sent: a real handle from a real
Prefill, one field corrupted (the NIXL metadata blob, addresses, sizes, the layout, names, or
the whole thing replaced by junk), sent straight to DecodeWorker.Decode. Every one must end
INVALID_ARGUMENT (the handle is malformed) or UNAVAILABLE (NIXL refused the read), never
INTERNAL, UNKNOWN, a hang or a dead worker, and every block must come back on both workers."""
from __future__ import annotations

import asyncio
import base64
import json
import random
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from decode_svc.kv_sources import EXPIRY_CLOCK_SKEW_S
from engine.call_abort import MAX_STATUS_CHARS, kv_source_failed, was_refused
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.convert import MAX_WORKER_REQUEST_ID_CHARS
from router.launcher import Cluster, ClusterSpec
from tests.fuzz_strategies import FIELDS, INT64
from tests.malformed_wire import assert_every_method_refuses_malformed
from tests.serving_helpers import (SERVING_MODEL, SHORT_CONTEXT_WORKER_ARGS, wait_all_blocks_free,
                                   worker_info)

MODEL = SERVING_MODEL

EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
SAMPLING = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _wild(rng: random.Random):
    return rng.choice([0, -1, 1, 2**40, -2**63, 2**63 - 1, rng.randint(-10**9, 10**9), "x", "",
                       None, [], {}, 1.5, True, "nixl", "torch", "DRAM", "VRAM"])


def _corrupt(rng: random.Random, handle: dict) -> tuple[str, bytes]:
    d = json.loads(json.dumps(handle))
    kind = rng.choice(["field", "metadata", "layout", "addresses", "junk"])
    if kind == "field":
        d[rng.choice(sorted(d))] = _wild(rng)
    elif kind == "metadata":
        blob = bytearray(base64.b64decode(d["metadata"]))
        for _ in range(rng.randint(1, 20)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        if rng.random() < 0.3:
            blob = blob[:rng.randrange(len(blob))]
        d["metadata"] = base64.b64encode(bytes(blob)).decode()
        # A name the decode worker has not met, so that NIXL parses the blob (a known one's
        # metadata was loaded when first met, and is not read again).
        d["agent_name"] += f"-{rng.randrange(1 << 30)}"
    elif kind == "layout":
        d["layout"][rng.choice(sorted(d["layout"]))] = _wild(rng)
    elif kind == "addresses":
        d["base_addr"] += rng.choice([-(1 << 30), -4096, 1 << 30, 1 << 44])
        if rng.random() < 0.5:
            d["num_bytes"] = rng.choice([0, 1, d["num_bytes"] * 2, 2**62])
    else:
        return kind, bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    return kind, json.dumps(d).encode()


@pytest.fixture(scope="module")
def workers():
    with Cluster(ClusterSpec(model=MODEL, worker_args=SHORT_CONTEXT_WORKER_ARGS)) as c:
        addr = {p.role: p.address for p in c.procs if p.name != "router"}
        with grpc.insecure_channel(addr["prefill"]) as pch, \
                grpc.insecure_channel(addr["decode"]) as dch:
            yield c, worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)


def test_a_handle_whose_lease_is_about_to_end_is_not_read(workers):
    """A one-sided read after the lease ends could copy blocks the prefill worker has given
    to another prompt: the decode worker refuses one it could not finish in time, and frees
    what it allocated for it."""
    cluster, prefill, decode = workers
    prompt = list(range(300, 340))
    resp = prefill.Prefill(worker_pb2.PrefillRequest(request_id="lease-p", prompt_token_ids=prompt,
                                                     sampling=SAMPLING), timeout=30)
    assert resp.kv_handle.lease_timeout_s > 5  # the worker's lease: 20 s
    handle = common_pb2.KVHandle()
    handle.CopyFrom(resp.kv_handle)
    handle.lease_timeout_s = 0.3  # what the router says is left of it after a long wait
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Decode(worker_pb2.DecodeRequest(
            request_id="lease-d", prompt_token_ids=prompt, first_token_id=resp.first_token_id,
            sampling=SAMPLING, kv_handle=handle), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "lease" in err.value.details()
    # The KV's source failed, not this worker: the router moves the request off the former.
    assert kv_source_failed(err.value) and not was_refused(err.value)
    # With the lease's whole time the same handle is read and decoded, here under another id
    # than the Prefill's: the pull's release names the handle's lease_id, so the lease ends at
    # once (named by the Decode's id, it held the blocks until it expired, 20 s).
    assert resp.kv_handle.lease_id == "lease-p"
    chunks = list(decode.Decode(worker_pb2.DecodeRequest(
        request_id="lease-d2", prompt_token_ids=prompt, first_token_id=resp.first_token_id,
        sampling=SAMPLING, kv_handle=resp.kv_handle), timeout=30))
    assert chunks[-1].finish_reason
    prefill_address = next(p.address for p in cluster.procs if p.role == "prefill")
    deadline = time.monotonic() + 10  # half the lease: its expiry cannot be what ended it
    while worker_info(prefill_address).num_leased and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_info(prefill_address).num_leased == 0
    def refusal(rid: str) -> grpc.RpcError:
        """The status of a Decode of the prompt from ``handle`` as it now is: refused."""
        with pytest.raises(grpc.RpcError) as err:
            list(decode.Decode(worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                sampling=SAMPLING, kv_handle=handle), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return err.value

    # A lease that is not a finite number of seconds (NaN, inf) would lift that bound; one
    # past a day is no lease a worker gives (its Redis record's expiry failed the batch).
    for bad in (float("nan"), float("inf"), -1.0, 86401.0, 1e300):
        handle.lease_timeout_s = bad
        refusal("lease-bad")
    handle.lease_timeout_s = 10.0
    handle.lease_id = "x" * (MAX_WORKER_REQUEST_ID_CHARS + 1)  # released by a name too long
    assert "lease_id" in refusal("lease-long").details()
    handle.lease_id = "lease-p"
    handle.worker_id = "w" * (MAX_WORKER_REQUEST_ID_CHARS + 1)  # names the pull's Redis key
    assert "worker_id" in refusal("lease-long").details()
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], 60.0)


def test_corrupted_kv_handles_fail_cleanly(workers):
    cluster, prefill, decode = workers
    rng = random.Random(2026)
    seen = {}
    for i in range(60):
        prompt = [rng.randint(5, 8000) for _ in range(rng.randint(2, 60))]
        resp = prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=f"p{i}", prompt_token_ids=prompt, sampling=SAMPLING), timeout=30)
        kind, raw = _corrupt(rng, json.loads(resp.kv_handle.rank_handles[0]))
        handle = common_pb2.KVHandle()
        handle.CopyFrom(resp.kv_handle)
        handle.rank_handles[0] = raw
        try:
            list(decode.Decode(worker_pb2.DecodeRequest(
                request_id=f"d{i}", prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                sampling=SAMPLING, kv_handle=handle), timeout=30))
            code = grpc.StatusCode.OK  # a harmless corruption (a field NIXL's metadata repeats)
        except grpc.RpcError as e:
            code = e.code()
            assert code in EXPECTED, (kind, e.details(), raw[:300])
            assert "Traceback" not in e.details()
        seen.setdefault(kind, set()).add(code)
        prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=f"p{i}"), timeout=10)
        assert all(p.popen.poll() is None for p in cluster.procs), (kind, raw[:300])
    # Each kind of corruption was tried, and most are refused.
    assert set(seen) == {"field", "metadata", "layout", "addresses", "junk"}
    assert all(grpc.StatusCode.OK not in seen[k] for k in ("layout", "addresses", "junk"))
    # None of them spoiled the decode worker's view of the prefill worker's agent: its own
    # handle still reads (a corrupted one met first used to lock it out).
    prompt = [rng.randint(5, 8000) for _ in range(20)]
    resp = prefill.Prefill(worker_pb2.PrefillRequest(request_id="genuine", prompt_token_ids=prompt,
                                                     sampling=SAMPLING), timeout=30)
    chunks = list(decode.Decode(worker_pb2.DecodeRequest(
        request_id="genuine", prompt_token_ids=prompt, first_token_id=resp.first_token_id,
        sampling=SAMPLING, kv_handle=resp.kv_handle), timeout=30))
    assert chunks[-1].finish_reason
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], 60.0)


@st.composite
def _worker_requests(draw):
    """A Prefill, or a Decode that prefills locally, as the router would never send it."""
    wild = draw(st.sampled_from([None, None, None, *FIELDS, "prompt", "resume", "first"]))
    sampling = {name: draw(anything if name == wild else valid)
                for name, (valid, anything) in FIELDS.items()
                if name == wild or draw(st.integers(0, 3)) == 0}
    ids = st.lists(st.integers(0, 8191), min_size=1, max_size=40)
    common = dict(
        request_id=draw(st.text(min_size=1, max_size=8)),
        prompt_token_ids=draw(st.lists(st.one_of(st.integers(-5, 8300), INT64), max_size=40)
                              if wild == "prompt" else ids),
        resume_token_ids=draw(st.lists(st.one_of(st.integers(-5, 8300), INT64), max_size=4)
                              if wild == "resume" else st.just([])),
        sampling=common_pb2.SamplingParams(**sampling))
    if draw(st.booleans()):
        return worker_pb2.PrefillRequest(**common)
    return worker_pb2.DecodeRequest(
        **common, local_prefill=wild != "first" or draw(st.booleans()),
        first_token_id=draw(INT64) if wild == "first" else 0)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(req=_worker_requests())
def test_workers_take_any_request_cleanly(workers, req):
    cluster, prefill, decode = workers
    try:
        if isinstance(req, worker_pb2.PrefillRequest):
            resp = prefill.Prefill(req, timeout=30)
            if resp.HasField("kv_handle"):
                prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=req.request_id),
                                  timeout=10)
        else:
            assert list(decode.Decode(req, timeout=30))[-1].finish_reason
    except grpc.RpcError as e:
        assert e.code() in (EXPECTED | {grpc.StatusCode.RESOURCE_EXHAUSTED}), (e.details(), req)
        assert "Traceback" not in e.details()


def test_overlong_request_ids_are_refused_by_every_worker_call(workers):
    """A worker keeps a ReleaseKV's unknown id (it may precede its Prefill) and copies a
    request's id into every stream event and the transfer ledger: 40 ReleaseKVs with 8 MiB
    ids held 370 MiB. Ids past the bound are refused, as the router refuses a client's."""
    from decode_svc.mux import _DecodeMux
    from protos.convert import MAX_WORKER_REQUEST_ID_CHARS

    _, prefill, decode = workers
    long_id = "r" * (MAX_WORKER_REQUEST_ID_CHARS + 1)
    prompt = [5, 6, 7, 8]
    calls = [
        lambda: prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=long_id), timeout=10),
        lambda: prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=long_id, prompt_token_ids=prompt, sampling=SAMPLING), timeout=30),
        lambda: list(decode.Decode(worker_pb2.DecodeRequest(
            request_id=long_id, prompt_token_ids=prompt, sampling=SAMPLING), timeout=30)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most" in err.value.details()

    async def start_on_a_stream():  # DecodeMany: refused as an event of its own
        mux = _DecodeMux(servicer=None)
        mux._start(worker_pb2.DecodeStart(request=worker_pb2.DecodeRequest(request_id=long_id)))
        return list(mux.pending.events), dict(mux.tasks)

    [event], tasks = asyncio.run(start_on_a_stream())
    assert event.request_id == long_id and "at most" in event.error.message and not tasks


def test_a_handle_its_prefill_worker_did_not_register_is_never_parsed(workers):
    """NIXL metadata is parsed by UCX, whose assertions abort the process on some corrupted
    blobs (one in 70-260 random mutations): a decode worker with a registry reads only the
    handles its prefill workers registered, and refuses others before NIXL sees them."""
    cluster, prefill, decode = workers
    rng = random.Random(7)
    prompt = [rng.randint(5, 8000) for _ in range(20)]
    resp = prefill.Prefill(worker_pb2.PrefillRequest(
        request_id="unregistered", prompt_token_ids=prompt, sampling=SAMPLING), timeout=30)
    d = json.loads(resp.kv_handle.rank_handles[0])
    blob = bytearray(base64.b64decode(d["metadata"]))
    blob[len(blob) // 2] ^= 0xFF
    d["metadata"], d["agent_name"] = base64.b64encode(bytes(blob)).decode(), "never-met"

    def decode_with(handle: common_pb2.KVHandle) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            list(decode.Decode(worker_pb2.DecodeRequest(
                request_id="unregistered", prompt_token_ids=prompt,
                first_token_id=resp.first_token_id, sampling=SAMPLING, kv_handle=handle),
                timeout=30))
        return err.value

    corrupted = common_pb2.KVHandle()
    corrupted.CopyFrom(resp.kv_handle)
    corrupted.rank_handles[0] = json.dumps(d).encode()
    err = decode_with(corrupted)
    # Refused as a stale handle's would be (one from before its worker restarted): the
    # source's failure, so the router prefills the request again elsewhere.
    assert err.code() == grpc.StatusCode.UNAVAILABLE and kv_source_failed(err)
    assert "differs from the KV handles prefill worker" in err.details()
    stranger = common_pb2.KVHandle()
    stranger.CopyFrom(corrupted)
    stranger.worker_id = "prefill-nobody"
    err = decode_with(stranger)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and kv_source_failed(err)
    assert "has no KV handles in the registry" in err.details()
    prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="unregistered"), timeout=10)
    assert all(p.popen.poll() is None for p in cluster.procs)


def test_forged_kv_handles_are_refused_and_poison_no_prefix_cache(workers, reference):
    """A caller of the decode worker's port makes a handle up from real ones: a lease with
    another lease's blocks, a lease's blocks under another prompt, a bad MAC. Read as given,
    the decode worker cached the blocks it read under the prompt named, and later requests of
    that prompt decoded from another prompt's KV. Each is refused before a block is allocated
    (the prefill worker signs what it hands out: kvtransfer/handle_mac.py), and the genuine
    handles are read after, from nothing cached, decoding as the reference does."""
    cluster, prefill, decode = workers
    rng = random.Random(53)
    prompts = [[rng.randint(5, 8000) for _ in range(40)] for _ in range(2)]
    a, b = (prefill.Prefill(worker_pb2.PrefillRequest(
        request_id=f"signed-{i}", prompt_token_ids=p, sampling=SAMPLING), timeout=30)
        for i, p in enumerate(prompts))
    other_blocks = common_pb2.KVHandle()
    other_blocks.CopyFrom(a.kv_handle)
    other_blocks.block_ids[:] = b.kv_handle.block_ids
    bad_mac = common_pb2.KVHandle()
    bad_mac.CopyFrom(a.kv_handle)
    bad_mac.mac = bytes(x ^ 0xFF for x in bad_mac.mac)
    decode_address = next(p.address for p in cluster.procs if p.role == "decode")
    forged = [(prompts[0], other_blocks), (prompts[1], a.kv_handle), (prompts[0], bad_mac)]
    for i, (prompt, handle) in enumerate(forged):
        with pytest.raises(grpc.RpcError) as err:
            list(decode.Decode(worker_pb2.DecodeRequest(
                request_id=f"forged-{i}", prompt_token_ids=prompt,
                first_token_id=a.first_token_id, sampling=SAMPLING, kv_handle=handle),
                timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("kv_handle mac does not verify with prefill "
                                              "worker"), err.value.details()
        wait_all_blocks_free([decode_address], 10.0)
    want = reference.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0,
                                                      ignore_eos=True))
    for prompt, resp, w in zip(prompts, (a, b), want):
        chunks = list(decode.Decode(worker_pb2.DecodeRequest(
            request_id=resp.kv_handle.lease_id, prompt_token_ids=prompt,
            first_token_id=resp.first_token_id, sampling=SAMPLING, kv_handle=resp.kv_handle),
            timeout=30))
        assert chunks[0].num_cached_tokens == 0  # nothing was cached under it
        assert [resp.first_token_id, *(t for c in chunks for t in c.token_ids)] == w.token_ids
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], 60.0)


def test_a_handle_replayed_after_its_lease_ended_is_refused():
    """The prefill worker's key lives as long as the worker: a handle captured off the network
    and replayed after its lease ended, its blocks free for other prompts, lease_timeout_s
    raised (it is not signed), was read, and the blocks' KV cached under its prompt. The
    lease's expiry is signed: the handle is refused as an expired lease is, the KV source's
    failure (UNAVAILABLE), before a block is allocated."""
    args = list(SHORT_CONTEXT_WORKER_ARGS)
    args[args.index("--kv-lease-timeout-s") + 1] = "1"
    with Cluster(ClusterSpec(model=MODEL, worker_args=args)) as cluster:
        addr = {p.role: p.address for p in cluster.procs if p.name != "router"}
        prompt = list(range(500, 540))
        with grpc.insecure_channel(addr["prefill"]) as ch:
            resp = worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
                request_id="replayed", prompt_token_ids=prompt, sampling=SAMPLING), timeout=30)
        replayed = common_pb2.KVHandle()
        replayed.CopyFrom(resp.kv_handle)
        replayed.lease_timeout_s = 60.0
        wait_all_blocks_free([addr["prefill"]], 30.0)  # the lease expired
        # Past the expiry on this host's clock too, with the skew a decode worker allows.
        while time.time() <= replayed.lease_expires_unix_s + EXPIRY_CLOCK_SKEW_S:
            time.sleep(0.05)
        with grpc.insecure_channel(addr["decode"]) as ch, pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(worker_pb2.DecodeRequest(
                request_id="replayed", prompt_token_ids=prompt,
                first_token_id=resp.first_token_id, sampling=SAMPLING, kv_handle=replayed),
                timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "by its signed expiry" in err.value.details()
        assert kv_source_failed(err.value) and not was_refused(err.value)
        wait_all_blocks_free(list(addr.values()), 10.0)


def test_a_refusal_quoting_a_long_caller_string_keeps_its_status(workers):
    """A refusal quotes the caller's text (a handle's backend): 20,000 characters of it put
    the status message past gRPC's 16 KiB header limit, and the caller got RESOURCE_EXHAUSTED
    ("received metadata size exceeds hard limit"), which reads as a full worker."""
    _, _, decode = workers
    handle = common_pb2.KVHandle(backend="x" * 20_000, rank_handles=[b"{}"], block_size=16,
                                 num_tokens=3, block_ids=[1])
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Decode(worker_pb2.DecodeRequest(
            request_id="long-backend", prompt_token_ids=[5, 6, 7], first_token_id=9,
            sampling=SAMPLING, kv_handle=handle), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("kv_handle uses backend 'xxx")
    assert err.value.details().endswith("more characters)")
    assert len(err.value.details()) <= MAX_STATUS_CHARS


def test_an_empty_prompt_is_refused_by_both_workers(workers):
    """The prefill worker refused it; the decode worker decoded from a handle of no blocks,
    or from a resumed output alone, with no prompt at all."""
    _, prefill, decode = workers
    empty = common_pb2.KVHandle(backend="nixl", rank_handles=[b"{}"], block_size=16)
    calls = [
        lambda: prefill.Prefill(worker_pb2.PrefillRequest(
            request_id="empty-p", sampling=SAMPLING, resume_token_ids=[5, 6]), timeout=30),
        lambda: list(decode.Decode(worker_pb2.DecodeRequest(
            request_id="empty-d", first_token_id=9, sampling=SAMPLING, kv_handle=empty),
            timeout=30)),
        lambda: list(decode.Decode(worker_pb2.DecodeRequest(
            request_id="empty-l", local_prefill=True, sampling=SAMPLING,
            resume_token_ids=[5, 6, 7]), timeout=30)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "prompt_token_ids is empty"


def test_bytes_that_are_no_request_get_invalid_argument_from_every_worker_method(workers):
    cluster, _, _ = workers
    for proc in cluster.procs:
        if proc.name == "router":
            continue
        name = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}[proc.role]
        service = worker_pb2.DESCRIPTOR.services_by_name[name]
        with grpc.insecure_channel(proc.address) as channel:  # DecodeMany's stream too
            assert assert_every_method_refuses_malformed(channel, service) > len(service.methods)


def test_the_workers_are_whole_afterwards(workers):
    cluster, _, _ = workers
    assert all(p.popen.poll() is None for p in cluster.procs)
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], 60.0)
