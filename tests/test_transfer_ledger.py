"""The transfer ledger across real processes: prefill workers open and close entries, decode
workers mark their pulls, the router lists them (``pdserve admin transfers``), and a router
killed and started again releases at once the leases its previous incarnation left."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal

import grpc
import pytest
import redis

from client import Client
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.proc_signals import stop_process, wait_until
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, live_workers, random_prompts,
                                   wait_all_blocks_free, worker_info)

MODEL = SERVING_MODEL

GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=1, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _proc(cluster, role):
    (p,) = [p for p in cluster.procs if p.role == role and p.popen.poll() is None]
    return p


def _transfers(cluster, limit=0):
    with grpc.insecure_channel(cluster.router_address) as ch:
        return router_pb2_grpc.RouterAdminStub(ch).ListTransfers(
            router_pb2.ListTransfersRequest(limit=limit), timeout=10)


def _prefill(address: str, rid: str, prompt, **ids) -> worker_pb2.PrefillResponse:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, **ids), timeout=60)


def _release(address: str, rid: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.PrefillWorkerStub(ch).ReleaseKV(
            worker_pb2.ReleaseKVRequest(request_id=rid), timeout=10).released


def test_a_lease_is_listed_while_held_and_gone_once_released(cluster, capsys):
    from engine.cli import main as cli_main

    prefill = _proc(cluster, "prefill")
    prompt = random_prompts(1, seed=31, lo=40, hi=40)[0]
    resp = _prefill(prefill.address, "held~1", prompt, router_id="ops")
    assert resp.HasField("kv_handle")
    assert wait_until(lambda: len(_transfers(cluster).transfers) == 1, 10)
    (t,) = _transfers(cluster).transfers
    assert (t.transfer_id, t.prefill_worker_id, t.prefill_address, t.state) == (
        "held~1", prefill.name, prefill.address, "leased")
    assert (t.num_blocks, t.num_tokens) == (3, 40)
    assert t.router_id == "ops" and not t.router_live  # no router beats under that name
    assert 0 <= t.age_s < 15 and 5 < t.expires_in_s <= 20  # the workers' 20 s leases
    assert cli_main(["admin", "--router", cluster.router_address, "transfers"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["transfer", "state"]
    assert table[1].split()[:3] == ["held~1", "leased", prefill.name]
    assert cli_main(["admin", "--router", cluster.router_address, "transfers", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["transfers"]
    assert listed["transfer_id"] == "held~1" and listed["num_blocks"] == 3
    for bad in (-1, 10_001):
        with pytest.raises(grpc.RpcError) as err:
            _transfers(cluster, limit=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(SystemExit):  # refused by the CLI before any call
        cli_main(["admin", "--router", cluster.router_address, "transfers",
                  "--limit", "2147483648"])
    assert "must be in [0, 10000]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["admin", "--router", cluster.router_address, "transfers", "--limit", "ten"])
    assert "--limit: must be an integer, got 'ten'" in capsys.readouterr().err
    assert _release(prefill.address, "held~1")
    assert wait_until(lambda: not _transfers(cluster).transfers, 10)
    for bad in (dict(router_id="a\nforged line"), dict(router_incarnation="x" * 257)):
        with pytest.raises(grpc.RpcError) as err:
            _prefill(prefill.address, "bad~1", prompt, **bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert worker_info(prefill.address).num_leased == 0


def test_a_release_that_comes_before_its_prefill_ends_frees_the_lease(cluster):
    """A router that cut its Prefill call releases at once; where the release reaches the
    worker before the lease exists, the lease is freed as soon as it is made."""
    prefill = _proc(cluster, "prefill")
    prompt = random_prompts(1, seed=35, lo=40, hi=40)[0]
    assert not _release(prefill.address, "early~1")
    with pytest.raises(grpc.RpcError) as err:
        _prefill(prefill.address, "early~1", prompt, router_id="ops")
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert worker_info(prefill.address).num_leased == 0
    assert not _transfers(cluster).transfers
    wait_all_blocks_free([prefill.address])


def test_release_kv_says_whether_it_ended_the_lease(cluster):
    """``released`` is true only for a lease the call ended: not for one a decode worker's
    pull already released (nor is that call taken for one that came before its lease)."""
    prefill, decode = _proc(cluster, "prefill"), _proc(cluster, "decode")
    prompt = random_prompts(1, seed=36, lo=30, hi=30)[0]
    resp = _prefill(prefill.address, "rel~1", prompt, router_id="ops")
    with grpc.insecure_channel(decode.address) as ch:
        chunks = list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(worker_pb2.DecodeRequest(
            request_id="rel~1", prompt_token_ids=prompt, first_token_id=resp.first_token_id,
            sampling=GREEDY, kv_handle=resp.kv_handle), timeout=60))
    assert chunks[-1].finish_reason
    # The lease's end reaches the servicer with the engine's events, as it reaches the ledger.
    assert wait_until(lambda: not _transfers(cluster).transfers, 10)
    assert not _release(prefill.address, "rel~1")
    # The same id prefilled again gets a lease (that release was not held against it).
    assert _prefill(prefill.address, "rel~1", prompt, router_id="ops").HasField("kv_handle")
    assert _release(prefill.address, "rel~1")
    assert wait_until(lambda: not _transfers(cluster).transfers, 10)
    wait_all_blocks_free([prefill.address, decode.address])


def test_requests_through_the_router_leave_no_entry_behind(cluster):
    prompts = random_prompts(6, seed=32, lo=20, hi=90)
    with Client(cluster.router_address, timeout=60) as c:
        with cf.ThreadPoolExecutor(6) as pool:
            done = list(pool.map(lambda p: c.complete(p, max_tokens=6, temperature=0.0,
                                                      ignore_eos=True), prompts))
    assert all(len(r.token_ids) == 6 for r in done)
    wait_all_blocks_free(live_workers(cluster))
    assert wait_until(lambda: not _transfers(cluster).transfers, 10)


def test_a_decode_worker_marks_the_lease_it_pulls(cluster):
    prefill, decode = _proc(cluster, "prefill"), _proc(cluster, "decode")
    prompt = random_prompts(1, seed=33, lo=50, hi=50)[0]
    resp = _prefill(prefill.address, "pulled~1", prompt, router_id="ops")
    assert wait_until(lambda: len(_transfers(cluster).transfers) == 1, 10)
    # Stopped, the prefill worker cannot end the lease when the pull is done: the entry
    # stays, marked by the decode worker (which publishes before it pulls), until it runs.
    stop_process(prefill.popen)
    try:
        with grpc.insecure_channel(decode.address) as ch, cf.ThreadPoolExecutor(1) as pool:
            call = pool.submit(lambda: list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(
                # Under another id than the lease's: the mark and the release name the lease
                # (the handle's lease_id), whatever the caller calls the decode.
                worker_pb2.DecodeRequest(request_id="pulled~d", prompt_token_ids=prompt,
                                         first_token_id=resp.first_token_id, sampling=GREEDY,
                                         kv_handle=resp.kv_handle), timeout=60)))
            pulling = wait_until(lambda: [t.state for t in _transfers(cluster).transfers]
                                 == ["pulling"], 3)
            (t,) = _transfers(cluster).transfers
            os.kill(prefill.popen.pid, signal.SIGCONT)
            assert pulling and t.decode_worker_id == decode.name and t.pull_s >= 0
            chunks = call.result(timeout=60)
    finally:
        os.kill(prefill.popen.pid, signal.SIGCONT)
    assert sum(len(c.token_ids) for c in chunks) == 3  # max_tokens 4, the first from prefill
    assert wait_until(lambda: not _transfers(cluster).transfers, 10)
    assert worker_info(prefill.address).num_leased == 0


def test_a_killed_router_started_again_releases_the_leases_it_left(cluster):
    router, prefill = _proc(cluster, "router"), _proc(cluster, "prefill")
    router_id = router.args[router.args.index("--router-id") + 1]
    r = redis.Redis.from_url(cluster.redis_url)
    incarnation = r.get(f"pdserve:router:{router_id}").decode()
    assert f" {router.popen.pid} " in incarnation
    # Leases as that router would have left them had it died mid-request; one of another
    # router's, which must stay.
    prompts = random_prompts(3, seed=34, lo=30, hi=60)
    for i, p in enumerate(prompts[:2]):
        _prefill(prefill.address, f"orphan~{i}", p, router_id=router_id,
                 router_incarnation=incarnation)
    _prefill(prefill.address, "kept~0", prompts[2], router_id="another-router",
             router_incarnation=incarnation)
    assert wait_until(lambda: worker_info(prefill.address).num_leased == 3, 10)
    router.popen.kill()
    router.popen.wait(timeout=10)
    new = cluster.respawn(router)
    assert new.args[new.args.index("--router-id") + 1] == router_id
    # Released at once, well before the 20 s leases would expire.
    assert wait_until(lambda: worker_info(prefill.address).num_leased == 1, 8)
    (t,) = _transfers(cluster).transfers
    assert t.transfer_id == "kept~0"
    assert _release(prefill.address, "kept~0")
    with Client(cluster.router_address, timeout=60) as c:  # the new router serves
        assert len(c.complete(prompts[0], max_tokens=3, temperature=0.0).token_ids) >= 1
    live = r.get(f"pdserve:router:{router_id}").decode()
    assert live != incarnation
    # Alive: the incarnation that took the lease beats. Not alive: one under the same id that
    # ran elsewhere (its successor cannot prove it gone, so leaves its leases to expire).
    elsewhere = "0badc0de00000000 4242 other-boot-id/4026531836 otherhost"
    _prefill(prefill.address, "live~0", prompts[1], router_id=router_id, router_incarnation=live)
    _prefill(prefill.address, "dead~0", prompts[2], router_id=router_id,
             router_incarnation=elsewhere)
    assert wait_until(lambda: len(_transfers(cluster).transfers) == 2, 10)
    listed = {t.transfer_id: t for t in _transfers(cluster).transfers}
    assert listed["live~0"].router_id == router_id and listed["live~0"].router_live
    assert listed["dead~0"].router_id == router_id and not listed["dead~0"].router_live
    assert _release(prefill.address, "live~0") and _release(prefill.address, "dead~0")
