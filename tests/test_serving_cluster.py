"""Cluster behaviour across real processes: prefix-aware routing, a TP=2 prefill worker,
workers joining and leaving, drain, and load shedding."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import shutil

import grpc
import pytest
import redis

from client import Client, ResourceExhaustedError
from engine import LLM, SamplingParams
from engine.block_hash import hash_request_tokens
from engine.presets import resolve_model
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.proc_signals import wait_until
from tests.serving_helpers import (WORKER_ARGS, live_workers, random_prompts, wait_all_blocks_free,
                                   worker_info)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    # Local prefill off: these tests check which prefill worker ran each prompt.
    spec = ClusterSpec(num_prefill=2, num_decode=1, worker_args=WORKER_ARGS,
                       router_args=["--max-inflight-requests", "6",
                                    "--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _admin(cluster):
    return router_pb2_grpc.RouterAdminStub(grpc.insecure_channel(cluster.router_address))


def _by_role(cluster, role):
    return sorted((p for p in cluster.procs if p.name.startswith(role)), key=lambda p: p.name)


def _drain(cluster, proc, undrain=False):
    _admin(cluster).DrainWorker(router_pb2.DrainWorkerRequest(
        worker_id=proc.name, undrain=undrain), timeout=10)


def test_shared_prefix_goes_to_the_worker_that_holds_it(cluster):
    prefills = _by_role(cluster, "prefill")
    # Not the worker the router takes when nothing is cached (its tie order comes from its
    # id): only the prefix index can pick the holder.
    with Client(cluster.router_address, timeout=60) as c:
        first = c.complete(random_prompts(1, seed=12, lo=40, hi=40)[0], max_tokens=1,
                           **GREEDY).usage.prefill_worker_id
    holder = next(p for p in prefills if p.name != first)
    prefix = random_prompts(1, seed=11, lo=96, hi=96)[0]
    with grpc.insecure_channel(holder.address) as ch:  # warm the holder's prefix cache
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        stub.Prefill(worker_pb2.PrefillRequest(
            request_id="warm", prompt_token_ids=prefix + [7, 8, 9],
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=60)
        stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="warm"), timeout=10)
    r = redis.Redis.from_url(cluster.redis_url)
    for h in hash_request_tokens(prefix, 16):
        assert holder.name.encode() in r.smembers(f"pdserve:block:{h.hex()}")
    hits_before = worker_info(holder.address).prefix_cache_hits
    with Client(cluster.router_address, timeout=60) as c:
        for tail in ([1, 2, 3], [4, 5, 6, 7]):
            res = c.complete(prefix + tail, max_tokens=4, **GREEDY)
            assert res.usage.prefill_worker_id == holder.name
            assert res.usage.cached_tokens == 96
    assert worker_info(holder.address).prefix_cache_hits > hits_before
    stats = _admin(cluster).GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=10)
    assert stats.prefix_tokens_matched >= 192


def test_a_prefix_that_ends_inside_a_block_is_reused_to_its_last_token(cluster, reference):
    # 100 shared tokens: 6 whole blocks, and 4 tokens of a seventh that the first request's
    # own 12 tokens fill; the second request copies those 4 (a partial-block hit) and the
    # decode worker pulls the copied block with the rest.
    prefix = random_prompts(1, seed=13, lo=100, hi=100)[0]
    first_tail, second_tail = list(range(20, 32)), [7, 9, 11]
    with Client(cluster.router_address, timeout=60) as c:
        first = c.complete(prefix + first_tail, max_tokens=4, **GREEDY)
        holder = next(p for p in cluster.procs if p.name == first.usage.prefill_worker_id)
        partial_before = worker_info(holder.address).prefix_cache_partial_hits
        second = c.complete(prefix + second_tail, max_tokens=6, **GREEDY)
    assert second.usage.prefill_worker_id == holder.name
    assert second.usage.cached_tokens == 100
    assert worker_info(holder.address).prefix_cache_partial_hits == partial_before + 4
    want = reference.generate([prefix + second_tail], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    assert second.token_ids == want and len(set(want)) > 1


def test_sampling_rules_carry_from_the_prefill_worker_to_the_decode_worker(cluster, reference):
    # On tiny-llama (micro-llama's greedy outputs repeat no token: a penalty would change
    # nothing there).
    from tests.test_sampling_rules import GREEDY, PROMPTS

    first = reference.generate(PROMPTS[:1], SamplingParams(**GREEDY))[0].token_ids[0]
    # Words the first output spells: the prefill worker bans the first, the decode worker
    # the others.
    plain0 = reference.generate(PROMPTS[:1], SamplingParams(**GREEDY))[0]
    words = [reference.tokenizer.decode([t]) for t in plain0.token_ids[:6]]
    penalties = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.0, presence_penalty=0.5)]
    rules = penalties + [
        dict(logit_bias={17: 3.0, 4321: 7.5}),
        dict(allowed_token_ids=[11, 500, 1234, 4321, 7000]),
        # The prefill worker samples the first token, the one the model wants to stop at.
        dict(min_tokens=6, stop_token_ids=[first]),
        dict(bad_words=[w for w in words if w.strip()]),
    ]
    with Client(cluster.router_address, timeout=60) as c:
        for prompt in PROMPTS:
            for kw in rules:
                want = reference.generate([prompt], SamplingParams(**kw, **GREEDY))[0]
                got = [t for ch in c.generate(prompt, **kw, **GREEDY) for t in ch.token_ids]
                assert got == want.token_ids, kw
    plain = reference.generate(PROMPTS, SamplingParams(**GREEDY))
    assert plain[0].token_ids != reference.generate(
        PROMPTS[:1], SamplingParams(**penalties[1], **GREEDY))[0].token_ids
    assert plain[0].token_ids[:6] != reference.generate(
        PROMPTS[:1], SamplingParams(**rules[-1], **GREEDY))[0].token_ids[:6]
    # Choices of several tokens: the prefill worker samples the first under the mask, the
    # decode worker the rest and the eos (no ignore_eos: it ends the output).
    from tests.test_guided_choice import CHOICES

    guided = dict(guided_choice=CHOICES, max_tokens=16, temperature=0.0)
    want = reference.generate(PROMPTS, SamplingParams(**guided))
    with Client(cluster.router_address, timeout=60) as c:
        got = [c.complete(prompt, **guided) for prompt in PROMPTS]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert {g.text for g in got} <= set(CHOICES) and len({g.text for g in got}) >= 2
    assert all(g.finish_reason == "stop" for g in got)
    # A pattern and a schema likewise: a multi-byte character may span the two workers'
    # tokens; the schema goes as a dict and arrives as its JSON text.
    from tests.test_guided_regex import PATTERNS, SCHEMA

    for guide in [dict(guided_regex=PATTERNS[0]), dict(guided_regex=PATTERNS[2]),
                  dict(guided_json=SCHEMA, guided_whitespace_pattern="[ \n]?"),
                  dict(guided_json=SCHEMA)]:
        guided = dict(guide, max_tokens=96, temperature=0.0)
        want = reference.generate(PROMPTS, SamplingParams(**guided))
        with Client(cluster.router_address, timeout=60) as c:
            got = [c.complete(prompt, **guided) for prompt in PROMPTS]
        assert [g.token_ids for g in got] == [w.token_ids for w in want], guide
        assert all(g.finish_reason == "stop" for g in got)
    assert all(isinstance(json.loads(g.text)["age"], int) for g in got)
    wait_all_blocks_free(live_workers(cluster))


def test_a_chats_next_turn_is_prefilled_on_the_decode_worker_holding_its_reply(cluster,
                                                                               reference):
    # Turn 1: 80 prompt tokens on a prefill worker, 100 reply tokens on the decode worker,
    # which caches (and publishes) 11 whole blocks of prompt and reply. Turn 2 goes on from the
    # reply: the prefill worker holds 80 of its tokens, the decode worker 176, a lead of 96
    # (>= the default 64) with 14 tokens left to compute; so the decode worker prefills it.
    first_prompt = random_prompts(1, seed=17, lo=80, hi=80)[0]
    decode = _by_role(cluster, "decode")[0]
    admin = _admin(cluster)
    before = admin.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=10)
    with Client(cluster.router_address, timeout=60) as c:
        first = c.complete(first_prompt, max_tokens=100, **GREEDY)
        assert first.usage.prefill_worker_id.startswith("prefill-")
        assert not first.usage.local_prefill
        reply_hashes = hash_request_tokens(first_prompt + first.token_ids, 16)[:11]
        assert wait_until(
            lambda: decode.name.encode() in _index_holders(cluster, reply_hashes[-1:]), 10)
        hits_before = worker_info(decode.address).prefix_cache_hits
        second_prompt = first_prompt + first.token_ids + list(range(40, 50))
        second = c.complete(second_prompt, max_tokens=12, **GREEDY)
    u = second.usage
    assert u.local_prefill and u.prefill_worker_id == u.decode_worker_id == decode.name
    assert u.cached_tokens >= 176 and u.timings.kv_transfer_s == 0.0
    assert worker_info(decode.address).prefix_cache_hits >= hits_before + 176
    after = admin.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=10)
    assert after.requests_prefilled_on_decode_cache == before.requests_prefilled_on_decode_cache + 1
    want = reference.generate([first_prompt, second_prompt], [
        SamplingParams(max_tokens=m, **GREEDY) for m in (100, 12)])
    assert first.token_ids == want[0].token_ids and second.token_ids == want[1].token_ids
    assert len(set(first.token_ids)) > 10


def _index_holders(cluster, hashes) -> set[bytes]:
    r = redis.Redis.from_url(cluster.redis_url)
    return set().union(*(r.smembers(f"pdserve:block:{h.hex()}") for h in hashes))


def test_resetting_prefix_caches_forgets_them_in_the_workers_and_the_index(cluster, capsys):
    from engine.cli import main as cli_main

    prefix = random_prompts(1, seed=12, lo=64, hi=64)[0]
    hashes = hash_request_tokens(prefix, 16)
    workers = [p.address for p in cluster.procs if p.name != "router"]
    with Client(cluster.router_address, timeout=60) as c:
        first = c.complete(prefix + [1, 2], max_tokens=4, **GREEDY)
        holder = first.usage.prefill_worker_id
        assert c.complete(prefix + [3, 4], max_tokens=4, **GREEDY).usage.cached_tokens == 64
        assert holder.encode() in _index_holders(cluster, hashes)
        wait_all_blocks_free(workers)
        admin = _admin(cluster)
        for bad, code in ((dict(role="router"), grpc.StatusCode.INVALID_ARGUMENT),
                          (dict(worker_id="nobody"), grpc.StatusCode.NOT_FOUND)):
            with pytest.raises(grpc.RpcError) as err:
                admin.ResetPrefixCache(router_pb2.ResetPrefixCacheRequest(**bad), timeout=10)
            assert err.value.code() == code
        resp = admin.ResetPrefixCache(router_pb2.ResetPrefixCacheRequest(worker_id=holder),
                                      timeout=60)
        (done,) = resp.workers
        assert done.worker_id == holder and done.role == "prefill" and done.reset
        assert done.num_blocks_evicted >= 4 and done.num_blocks_in_use == 0
        assert wait_until(lambda: holder.encode() not in _index_holders(cluster, hashes), 10)
        # The decode worker still holds the prefix it pulled, now 64 tokens more than any
        # prefill worker: it prefills the prompt from its own cache.
        again = c.complete(prefix + [5, 6], max_tokens=4, **GREEDY).usage
        assert again.local_prefill and again.decode_worker_id.startswith("decode-")
        assert again.cached_tokens == 64
        wait_all_blocks_free(workers)
        resp = admin.ResetPrefixCache(router_pb2.ResetPrefixCacheRequest(role="decode"),
                                      timeout=60)
        assert [w.reset for w in resp.workers] == [True]
        assert wait_until(lambda: not _index_holders(cluster, hashes), 10)
        gone = c.complete(prefix + [7, 8], max_tokens=4, **GREEDY).usage
        assert gone.cached_tokens == 0 and gone.prefill_worker_id.startswith("prefill-")
        # Every worker, from the command line.
        wait_all_blocks_free(workers)
        assert cli_main(["admin", "--router", cluster.router_address,
                         "reset-prefix-cache"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == len(workers) and all(": reset (" in ln for ln in lines)
        # A stream in flight holds its decode worker's blocks: that worker refuses.
        stream = c.generate(prefix, max_tokens=400, **GREEDY)
        try:
            for _ in range(3):  # past the prefill worker's first token: decoding now
                next(stream)
            assert cli_main(["admin", "--router", cluster.router_address,
                             "reset-prefix-cache", "--role", "decode", "--json"]) == 1
            (refused,) = json.loads(capsys.readouterr().out)
            assert refused["role"] == "decode" and not refused["reset"]
            assert refused["num_blocks_in_use"] >= 4 and not refused["error"]
        finally:
            stream.close()
    wait_all_blocks_free(workers)


@contextlib.contextmanager
def _sole_prefill_worker(cluster, extra):
    """A prefill worker started with ``extra`` flags, the others drained while it is in use;
    stopped (SIGTERM: drain and a clean exit) afterwards."""
    worker = cluster.add_worker("prefill", extra=extra)
    others = [p for p in _by_role(cluster, "prefill") if p is not worker]
    for p in others:
        _drain(cluster, p)
    try:
        cluster.wait_routable(3, 1)
        yield worker
        wait_all_blocks_free([worker.address] + [p.address for p in _by_role(cluster, "decode")])
    finally:
        for p in others:
            _drain(cluster, p, undrain=True)
        assert cluster.stop_proc(worker) == 0
    cluster.wait_routable(2, 1)


def _complete_all(cluster, prompts, max_tokens):
    """The in-process engine's greedy results, and the cluster's, for ``prompts``."""
    with LLM("tiny-llama", num_gpu_blocks=256) as ref:
        want = ref.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    with Client(cluster.router_address, timeout=120) as c, \
            cf.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: c.complete(p, max_tokens=max_tokens, **GREEDY), prompts))
    return want, got


def test_tp2_prefill_worker_matches_the_in_process_engine(cluster):
    with _sole_prefill_worker(cluster, ["--tensor-parallel-size", "2"]) as tp2:
        want, got = _complete_all(cluster, random_prompts(5, seed=21), 10)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert g.usage.prefill_worker_id == tp2.name


def test_prompts_longer_than_a_prefill_step_match_the_in_process_engine(cluster):
    """A prefill worker that takes a prompt in several chunked steps (as the 512-token steps
    pdserve up gives prefill workers on shared CPU cores do for longer prompts) hands over the
    same KV: greedy outputs equal the in-process engine's."""
    with _sole_prefill_worker(cluster, ["--max-num-batched-tokens", "256"]) as small:
        prompts = random_prompts(2, seed=23, lo=600, hi=900)  # 3-4 steps each
        want, got = _complete_all(cluster, prompts, 8)
        assert len({tuple(w.token_ids) for w in want}) == 2
        for g, w, p in zip(got, want, prompts):
            assert g.token_ids == w.token_ids
            assert g.usage.prefill_worker_id == small.name
            assert g.usage.prompt_tokens == len(p)


def test_a_decode_worker_joins_and_leaves(cluster):
    old = _by_role(cluster, "decode")[0]
    new = cluster.add_worker("decode")
    cluster.wait_routable(2, 2)
    # Before any request, the newcomer connected to both prefill workers' KV agents.
    assert wait_until(lambda: worker_info(new.address).kv_peers_connected == 2)
    _drain(cluster, old)
    prompt = random_prompts(1, seed=5)[0]
    with Client(cluster.router_address, timeout=60) as c:
        assert c.complete(prompt, max_tokens=6, **GREEDY).usage.decode_worker_id == new.name
        _drain(cluster, old, undrain=True)
        assert cluster.stop_proc(new) == 0
        cluster.wait_routable(2, 1)
        for _ in range(3):
            assert c.complete(prompt, max_tokens=6, **GREEDY).usage.decode_worker_id == old.name


def test_a_model_copied_under_another_name_serves_under_its_served_name(cluster, tmp_path):
    """Routers match workers by model name (the --model folder's name): a worker reading a
    copy of the model from a folder named otherwise gets requests once it registers under the
    router's name with --served-model-name."""
    copy = shutil.copytree(resolve_model("tiny-llama"), tmp_path / "llama-copy")
    old = _by_role(cluster, "decode")[0]
    new = cluster.add_worker("decode", extra=["--model", str(copy),
                                              "--served-model-name", "tiny-llama"])
    try:
        cluster.wait_routable(2, 2)
        assert worker_info(new.address).model == "tiny-llama"
        _drain(cluster, old)
        with Client(cluster.router_address, timeout=60) as c:
            res = c.complete(random_prompts(1, seed=6)[0], max_tokens=4, **GREEDY)
        assert res.usage.decode_worker_id == new.name
    finally:
        _drain(cluster, old, undrain=True)
        assert cluster.stop_proc(new) == 0
    cluster.wait_routable(2, 1)


def test_a_prefill_worker_stopping_waits_for_the_kv_it_leased(cluster, capfd):
    """A request whose Prefill answered is in flight until its KV is pulled: its client has
    the first token. A prefill worker told to stop (SIGTERM) drains until its leases end; it
    stopped at once, and the decode worker's pull failed."""
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    worker = cluster.add_worker("prefill")
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        stub.Prefill(worker_pb2.PrefillRequest(
            request_id="held", prompt_token_ids=random_prompts(1, seed=9)[0],
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=60)
        assert wait_until(lambda: worker_info(worker.address).num_leased == 1)
        worker.popen.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(ch)
        assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                          .status == health_pb2.HealthCheckResponse.NOT_SERVING)
        # Draining, it still serves the lease's release (here, as a decode worker's pull does).
        stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="held"), timeout=10)
    assert worker.popen.wait(timeout=60) == 0
    assert cluster.stop_proc(worker) == 0  # its bookkeeping; it exited already
    assert "stopping: draining 1 requests" in capfd.readouterr().err  # the lease counted
    cluster.wait_routable(2, 1)


def test_more_load_than_allowed_is_refused_not_queued(cluster):
    prompts = random_prompts(16, seed=9)
    with Client(cluster.router_address, timeout=120) as c, cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(c.complete, p, max_tokens=40, **GREEDY) for p in prompts]
        outcomes = [f.exception() or f.result() for f in futs]
    refused = [o for o in outcomes if isinstance(o, ResourceExhaustedError)]
    served = [o for o in outcomes if not isinstance(o, Exception)]
    assert refused and served and len(refused) + len(served) == 16
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"])


def _raw_complete_error(cluster, request: router_pb2.GenerateRequest) -> grpc.RpcError:
    """What the router answers ``request`` with, past the SDK's own checks."""
    with grpc.insecure_channel(cluster.router_address) as ch, \
            pytest.raises(grpc.RpcError) as refused:
        router_pb2_grpc.RouterStub(ch).Complete(request, timeout=10)
    return refused.value


def test_a_full_router_still_names_a_bad_request(cluster):
    # The router admits a request once it is valid: a bad one is INVALID_ARGUMENT however
    # full the router is (a client must not retry it), a good one RESOURCE_EXHAUSTED.
    prompts = random_prompts(6, seed=17, lo=8, hi=8)
    with Client(cluster.router_address, timeout=120) as c:
        streams = [c.generate(p, max_tokens=250, **GREEDY) for p in prompts]
        try:
            for s in streams:  # each one's first token: all 6 (the limit) are in flight
                next(s)
            stats = _admin(cluster).GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=10)
            assert stats.requests_in_flight == 6
            bad_sampling = _raw_complete_error(cluster, router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompts[0]),
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=-1.0)))
            too_long = _raw_complete_error(cluster, router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=[5] * 1100)))  # max_model_len is 1024
            for refused, what in ((bad_sampling, "temperature"), (too_long, "max_model_len")):
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert what in refused.details()
            with pytest.raises(ResourceExhaustedError, match="in flight"):
                c.complete(prompts[0], max_tokens=4, **GREEDY)
        finally:
            for s in streams:
                s.close()
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"])


def test_the_admin_command_lists_counts_and_drains(cluster, capsys):
    from engine.cli import main as cli_main

    addr = cluster.router_address
    names = sorted(p.name for p in cluster.procs if p.name != "router")
    # A worker of another model in the namespace: listed, and said to get no requests.
    foreign = common_pb2.WorkerInfo(worker_id="prefill-of-another-model", role="prefill",
                                    address="127.0.0.1:1", block_size=16, max_model_len=1024,
                                    model="other-model", model_fingerprint="f0:w0")
    with _registered(cluster, foreign):
        assert cli_main(["admin", "--router", addr, "workers"]) == 0
        table = capsys.readouterr().out
        assert cli_main(["admin", "--router", addr, "workers", "--role", "prefill",
                         "--json"]) == 0
        prefills = json.loads(capsys.readouterr().out)
    lines = table.splitlines()
    assert lines[0].startswith("worker") and lines[0].split()[-1] == "model"
    assert all(n in table for n in names)
    rows = {line.split()[0]: line for line in lines[1:2 + len(names)]}  # then why, below
    assert rows[foreign.worker_id].endswith("another")
    assert all(rows[n].endswith("the router's") for n in names)
    assert lines[-1] == (f"{foreign.worker_id} gets no requests: its model's config or tokenizer "
                         f"files differ from this router's (fingerprint f0:w0, the router's "
                         f"{_identity(cluster).fingerprint})")
    why = {w["worker_id"]: w["model_mismatch"] for w in prefills}
    assert "config or tokenizer files differ" in why.pop(foreign.worker_id)
    assert why == {n: "" for n in names if n.startswith("prefill")}
    # pdserve info: the model the router serves, as the router's own GetModelInfo says.
    assert cli_main(["info", "--router", f"{addr},{addr}", "--json"]) == 0
    infos = json.loads(capsys.readouterr().out)
    ident = _identity(cluster)
    assert [i["identity"]["fingerprint"] for i in infos] == [ident.fingerprint] * 2
    assert infos[0]["router"] == addr and infos[0]["block_size"] == 16
    assert cli_main(["info", "--router", addr]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"router {addr}: model ") and f"fingerprint {ident.fingerprint}" in text
    assert cli_main(["admin", "--router", addr, "workers", "--role", "decode", "--json"]) == 0
    decodes = json.loads(capsys.readouterr().out)
    assert [w["worker_id"] for w in decodes] == [n for n in names if n.startswith("decode")]
    assert cli_main(["admin", "--router", addr, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_prefill_workers"] == 2 and "requests_migrated" in stats
    victim = _by_role(cluster, "prefill")[0].name
    assert cli_main(["admin", "--router", addr, "drain", victim]) == 0
    assert capsys.readouterr().out.strip() == f"{victim}: draining"
    assert worker_info_of(cluster, victim).draining
    assert cli_main(["admin", "--router", addr, "undrain", victim]) == 0
    assert not worker_info_of(cluster, victim).draining
    assert cli_main(["admin", "--router", addr, "drain", "nobody"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


@contextlib.contextmanager
def _registered(cluster, info: common_pb2.WorkerInfo):
    """``info`` in the cluster's worker registry, as a worker's heartbeat puts it, until the
    block ends."""
    import asyncio

    from router.registry import Registry

    async def write(leave: bool) -> None:
        registry = Registry.from_url(cluster.redis_url, cluster.spec.namespace)
        try:
            await (registry.deregister(info.worker_id) if leave else registry.heartbeat(info))
        finally:
            await registry.r.aclose()

    asyncio.run(write(False))
    try:
        yield
    finally:
        asyncio.run(write(True))


def _identity(cluster) -> router_pb2.ModelIdentity:
    with grpc.insecure_channel(cluster.router_address) as ch:
        return router_pb2_grpc.RouterStub(ch).GetModelInfo(router_pb2.ModelInfoRequest(),
                                                           timeout=10).identity


def worker_info_of(cluster, worker_id):
    workers = _admin(cluster).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
    return next(w for w in workers if w.worker_id == worker_id)
