"""A prefill worker's ReleaseKV for a request whose lease does not exist yet: the router cut its
Prefill call and released at once. The servicer in process over a scripted engine, so the
release lands at a chosen moment of the call (tests/test_transfer_ledger.py has a release
that comes before the call, on a real worker)."""
from __future__ import annotations

import asyncio
import contextlib
import time
import types

from engine.outputs import KVLease, RequestOutput
from prefill_svc.service import PrefillServicer
from protos import worker_pb2


class _Engine:
    """Answers each prefill with a lease once ``go`` is set; records releases."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.released: list[str] = []

    async def generate(self, rid, ids, params, resume):
        await self.go.wait()
        now = time.monotonic()
        yield RequestOutput(request_id=rid, prompt_token_ids=ids, token_ids=[1],
                            new_token_ids=[1], text="", text_delta="", finished=False,
                            finish_reason=None, stop_reason=None, logprobs=None,
                            prompt_logprobs=None, num_cached_tokens=0,
                            kv_lease=KVLease(rid, [0, 1], len(ids), 16, now + 60),
                            arrival_time=now, first_scheduled_time=None)

    def release_kv(self, rid: str) -> None:
        self.released.append(rid)


class _Context:
    async def abort(self, code, details):
        raise AssertionError(f"aborted {code}: {details}")


def _servicer(engine: _Engine) -> PrefillServicer:
    rt = types.SimpleNamespace(
        engine=engine, worker_id="w", address="127.0.0.1:1", kv_handle_bytes=[b"h"],
        kv_mac_key=b"k" * 32,
        config=types.SimpleNamespace(engine=types.SimpleNamespace(kv_transfer_backend="torch")),
        record_transfer=lambda ev: None, admit=contextlib.nullcontext)
    return PrefillServicer(rt)


def _release(svc: PrefillServicer, rid: str):
    return svc.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid), _Context())


def test_a_release_during_the_prefill_frees_its_lease_past_any_number_of_strays():
    """Releases of ids that never get a lease here (the router's after each failed prefill,
    a restarted router's reclaim) were remembered in one bounded list with the ones that
    matter: 1024 of them pushed out a running call's release, and its lease was then held,
    and handed to a caller that had gone, until it expired."""
    async def run():
        engine = _Engine()
        svc = _servicer(engine)
        call = asyncio.ensure_future(svc._prefill(worker_pb2.PrefillRequest(
            request_id="cut", prompt_token_ids=list(range(5, 25)))))
        await asyncio.sleep(0)  # the call is running, its lease not made
        await _release(svc, "cut")
        for i in range(3000):
            await _release(svc, f"stray-{i}")
        engine.go.set()
        assert await call is None  # answered CANCELLED by Prefill
        assert engine.released.count("cut") == 2  # the release's, then the lease's own
        assert "cut" not in svc._leases
        # Nothing of the call is left behind, and the strays stay bounded.
        assert not svc._prefilling and not svc._released_early
        assert len(svc._released_unseen) <= 1024
    asyncio.run(run())


def test_a_release_before_the_call_still_frees_the_lease_and_a_later_call_is_untouched():
    async def run():
        engine = _Engine()
        engine.go.set()
        svc = _servicer(engine)
        await _release(svc, "overtaken")  # the release overtook its call
        assert await svc._prefill(worker_pb2.PrefillRequest(
            request_id="overtaken", prompt_token_ids=list(range(5, 25)))) is None
        # Another call is not affected by that release.
        resp = await svc._prefill(worker_pb2.PrefillRequest(
            request_id="kept", prompt_token_ids=list(range(5, 25))))
        assert resp.HasField("kv_handle") and "kept" in svc._leases
    asyncio.run(run())
