"""decode_svc/kv_sources.py: which KV handles a decode worker with a registry reads. A handle
its prefill worker did not sign is refused as bad input (ValueError: INVALID_ARGUMENT); one
whose source cannot vouch for it (rank handles not registered, no key, Redis away for a worker
never met, no signed lease expiry) as its source's failure (PeerGoneError: UNAVAILABLE, the
request moves), and one past its signed lease expiry as an expired lease (TransferError:
UNAVAILABLE, the request moves).

The registry is a fake with Registry.kv_source's contract (tests/test_registry.py covers the
real one's reads), so that Redis can be made to stop answering between two pulls; the clock
is a fake, so that a lease ends when a test says."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_svc import kv_sources
from decode_svc.kv_sources import EXPIRY_CLOCK_SKEW_S, KVSources
from decode_svc.service import LEASE_READ_MARGIN_S
from engine.call_abort import KV_SOURCE_FAILED
from engine.worker_runtime import failure_marks, status_for
from kvtransfer import PeerGoneError, TransferError, handle_mac
from protos import common_pb2

NOW = 1_800_000_000.0  # the fake clock's start, in unix seconds
TOKENS = [11, 12, 13, 14, 15]
RANKS = [b'{"rank":0}', b'{"rank":1}']
NOT_SIGNED = "kv_handle mac does not verify with prefill worker 'prefill-1'"


class FakeRegistry:
    """router.registry.Registry's kv_source: (rank handles, key), ([], b"") for a worker
    with nothing registered; ``down`` makes it raise as a Redis not answering does."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[list[bytes], bytes]] = {}
        self.down = False
        self.hang = False
        self.reads = 0

    async def kv_source(self, worker_id: str) -> tuple[list[bytes], bytes]:
        self.reads += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.down:
            raise ConnectionError("Connection refused")
        return self.sources.get(worker_id, ([], b""))


class FakeClock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _handle(key: bytes, *, backend: str = "nixl", ranks=RANKS, blocks=(3, 4),
            tokens=TOKENS, expires: float = NOW + 20.0) -> common_pb2.KVHandle:
    """A handle as prefill worker prefill-1 signs it with ``key`` at NOW, its lease 20 s."""
    h = common_pb2.KVHandle(worker_id="prefill-1", worker_address="10.0.0.1:7001",
                            backend=backend, rank_handles=list(ranks), block_ids=list(blocks),
                            num_tokens=len(tokens), block_size=4, lease_timeout_s=20.0,
                            lease_id="req-1", lease_expires_unix_s=expires)
    h.mac = handle_mac.sign(key, h, tokens)
    return h


def _check(sources: KVSources, h: common_pb2.KVHandle, tokens=TOKENS) -> None:
    asyncio.run(sources.check(h, tokens))


@pytest.fixture
def registry() -> FakeRegistry:
    return FakeRegistry()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sources(registry, clock) -> KVSources:
    return KVSources(lambda: registry, clock)


def test_a_signed_handle_is_read_and_its_key_read_once(registry, sources):
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    h = _handle(key)
    _check(sources, h)
    h.lease_timeout_s = 3.0  # the router lowers it on the way: not signed
    _check(sources, h)
    _check(sources, _handle(key, blocks=(7, 8)))
    assert registry.reads == 1
    registry.down = True  # a worker met is checked with the key met
    _check(sources, _handle(key, blocks=(9,)))


def test_a_worker_pulled_from_keeps_its_key_past_other_workers_starts(
        registry, sources, monkeypatch):
    """The keys were dropped in the order they were first read, however often used: a prefill
    worker pulled from all along lost its key after MAX_REMEMBERED other starts (each one met
    ahead by engine/kv_peers.py), and its next pull while Redis was down was refused."""
    monkeypatch.setattr(kv_sources, "MAX_REMEMBERED", 2)
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    _check(sources, _handle(key))
    sources.remember("prefill-2", [b'{"rank":0,"p":2}'], handle_mac.new_key())
    _check(sources, _handle(key, blocks=(5,)))  # used since prefill-2 was met
    sources.remember("prefill-3", [b'{"rank":0,"p":3}'], handle_mac.new_key())
    registry.down = True
    _check(sources, _handle(key, blocks=(6,)))
    assert registry.reads == 1


@pytest.mark.parametrize("gone", ["redis_down", "worker_purged"])
def test_a_forged_handle_of_a_worker_met_is_bad_input_when_its_key_cannot_be_read_again(
        registry, sources, gone):
    """The remembered key fails the handle and the registry gives no newer one: the handle
    is judged by the key met. It was refused UNAVAILABLE, and the router prefilled the forged
    request again elsewhere, where README promises INVALID_ARGUMENT."""
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    _check(sources, _handle(key))
    if gone == "redis_down":
        registry.down = True
    else:
        del registry.sources["prefill-1"]
    other_blocks = _handle(key)
    other_blocks.block_ids[:] = [5, 6]
    with pytest.raises(ValueError, match=NOT_SIGNED):
        _check(sources, other_blocks)
    with pytest.raises(ValueError, match=NOT_SIGNED):  # the same blocks under another prompt
        _check(sources, _handle(key), [11, 12, 13, 14, 99])


def test_a_forged_handle_is_bad_input_while_redis_answers(registry, sources):
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    forged = _handle(handle_mac.new_key())
    with pytest.raises(ValueError, match=NOT_SIGNED):
        _check(sources, forged)
    _check(sources, _handle(key))
    with pytest.raises(ValueError, match=NOT_SIGNED):  # met, then re-read: the same key
        _check(sources, forged)
    assert registry.reads == 3


@pytest.mark.parametrize("how", ["refused", "no_answer"])
def test_redis_not_answering_refuses_a_worker_never_met_unavailable(
        registry, sources, monkeypatch, how):
    """Read unchecked, a handle of a worker never met would pass whoever timed an outage."""
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    if how == "refused":
        registry.down = True
    else:
        registry.hang = True
        monkeypatch.setattr(kv_sources, "REGISTRY_WAIT_S", 0.05)
    with pytest.raises(PeerGoneError, match="could not read prefill worker 'prefill-1'"):
        _check(sources, _handle(key))
    registry.down = registry.hang = False  # nothing was remembered from the failed read
    _check(sources, _handle(key))
    assert registry.reads == 2


def test_a_worker_that_registered_no_key_is_refused_unavailable(registry, sources):
    """A prefill worker of a build before handles were signed: its handles carry no MAC and
    the registry no key, so each is prefilled again elsewhere."""
    registry.sources["prefill-1"] = (RANKS, b"")
    unsigned = _handle(b"")
    unsigned.mac = b""
    with pytest.raises(PeerGoneError, match="registered no key"):
        _check(sources, unsigned)


def test_a_worker_restarted_under_its_id_with_a_new_key_is_read_after_a_re_read(
        registry, sources):
    """The same rank handles (a torch owner on the same port) and a new key: the key met
    fails the new handles, the key read again verifies them and is remembered in its place."""
    old, new = handle_mac.new_key(), handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, old)
    _check(sources, _handle(old))
    registry.sources["prefill-1"] = (RANKS, new)
    _check(sources, _handle(new, blocks=(1, 2)))
    _check(sources, _handle(new, blocks=(5,)))
    assert registry.reads == 2


@pytest.mark.parametrize("backend", ["torch", "nixl"])
def test_rank_handles_are_checked_against_those_registered(registry, sources, backend):
    """For both backends (the torch one was read unchecked): a handle whose rank handles the
    worker did not register, or of a worker with none registered, is its source's failure."""
    key = handle_mac.new_key()
    with pytest.raises(PeerGoneError, match="has no KV handles in the registry"):
        _check(sources, _handle(key, backend=backend))
    registry.sources["prefill-1"] = (RANKS, key)
    stale = _handle(key, backend=backend, ranks=[b'{"rank":0,"port":1}', RANKS[1]])
    with pytest.raises(PeerGoneError, match="differs from the KV handles prefill worker"):
        _check(sources, stale)
    _check(sources, _handle(key, backend=backend))


def test_without_a_registry_a_handle_is_read_as_given():
    unsigned = _handle(b"", expires=0.0)
    unsigned.mac = b""
    sources = KVSources(lambda: None)
    _check(sources, unsigned)
    assert sources.lease_left(unsigned) == 20.0  # lease_timeout_s alone bounds the read


def test_a_handle_past_its_signed_lease_expiry_is_refused_as_an_expired_lease(
        registry, sources, clock):
    """The prefill worker's key verifies its handles for the worker's whole life: one replayed
    after its lease ended, its blocks given to other prompts since, was read (and cached under
    the replayed prompt), whatever lease_timeout_s its caller claimed. Refused as the pull
    refuses a lease too near its end: the KV source's failure, UNAVAILABLE, so that the router
    prefills a legitimately late request again, as it did."""
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    h = _handle(key)
    h.lease_timeout_s = 86400.0  # not signed: raised by whoever replays it
    # This host's clock may run a little ahead of the prefill worker's.
    clock.now = NOW + 20.0 + EXPIRY_CLOCK_SKEW_S - 0.01
    _check(sources, h)
    clock.now = NOW + 20.0 + EXPIRY_CLOCK_SKEW_S + 0.01
    with pytest.raises(TransferError, match=r"ended 0\.51 s ago by its signed expiry") as err:
        _check(sources, h)
    assert status_for(err.value) == grpc.StatusCode.UNAVAILABLE
    assert failure_marks(err.value) == KV_SOURCE_FAILED
    forged = _handle(key)
    forged.lease_expires_unix_s += 3600.0  # its lease made to end later: the MAC fails it
    with pytest.raises(ValueError, match=NOT_SIGNED):
        _check(sources, forged)


def test_the_read_never_outlasts_the_signed_expiry(sources, clock):
    """lease_timeout_s is not signed (the router lowers it on the way): raised, it would have
    let the pull run past the lease's end, into blocks given to other prompts."""
    h = _handle(handle_mac.new_key(), expires=NOW + 5.0)
    h.lease_timeout_s = 3.0  # as the router lowered it
    assert sources.lease_left(h) == 3.0
    h.lease_timeout_s = 600.0
    assert sources.lease_left(h) == 5.0 + EXPIRY_CLOCK_SKEW_S
    clock.now = NOW + 4.0
    assert sources.lease_left(h) == 1.0 + EXPIRY_CLOCK_SKEW_S
    # The pull stops LEASE_READ_MARGIN_S before that: with clocks that agree, it ends by the
    # signed expiry.
    assert EXPIRY_CLOCK_SKEW_S <= LEASE_READ_MARGIN_S


def test_a_handle_without_a_signed_lease_expiry_is_refused_unavailable(registry, sources):
    """A prefill build before the expiry was signed: its handles could be replayed for the
    worker's whole life. Refused as an unsigned build's are, as its source's failure: the
    request is prefilled again (on an upgraded prefill worker: they are upgraded first)."""
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    with pytest.raises(PeerGoneError, match="has no signed lease expiry"):
        _check(sources, _handle(key, expires=0.0))


def test_clocks_apart_are_logged_once_a_minute_and_named_in_the_refusal(
        registry, sources, clock, caplog):
    """A decode host minutes ahead of its prefill workers refuses every handle as expired, each
    request prefilled again: the log and the refusal say the clocks may be why."""
    key = handle_mac.new_key()
    registry.sources["prefill-1"] = (RANKS, key)
    with caplog.at_level("WARNING", logger=kv_sources.__name__):
        _check(sources, _handle(key))  # lease_timeout_s 20 s, signed 20 s left: in step
        assert not caplog.records
        clock.now = NOW + 120.0  # this host two minutes ahead
        with pytest.raises(TransferError, match="this host's clock ahead"):
            _check(sources, _handle(key))
        with pytest.raises(TransferError):
            _check(sources, _handle(key))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # once, not per request
    assert "disagree by 120.0 s: this host's clock is ahead of" in warned[0]
    assert "or the handle reached this worker that late" in warned[0]  # not only skew
    assert "'prefill-1'" in warned[0]
