"""kvtransfer/handle_mac.py: a KV handle's MAC binds each field that names KV, the tokens the
KV is of and when the lease ends; the lease's remaining time, which the router lowers on the
way, it does not."""
from __future__ import annotations

import pytest

from kvtransfer import handle_mac
from protos import common_pb2

KEY = handle_mac.new_key()
TOKENS = [5, 6, 7, 8, 9]


def _handle() -> common_pb2.KVHandle:
    h = common_pb2.KVHandle(worker_id="prefill-1", worker_address="10.0.0.1:7001",
                            backend="nixl", rank_handles=[b'{"a":0}', b'{"a":1}'],
                            block_ids=[3, 4], num_tokens=5, block_size=4, lease_timeout_s=20.0,
                            lease_id="req-1", lease_expires_unix_s=1_800_000_020.25)
    h.mac = handle_mac.sign(KEY, h, TOKENS)
    return h


def test_a_signed_handle_verifies_after_the_router_lowers_its_lease_time():
    h = _handle()
    assert len(KEY) == handle_mac.KEY_BYTES and len(h.mac) == 32
    h.lease_timeout_s = 3.5
    assert handle_mac.verify(KEY, h, TOKENS)


@pytest.mark.parametrize("change", [
    lambda h: setattr(h, "worker_id", "prefill-2"),
    lambda h: setattr(h, "worker_address", "10.0.0.2:7001"),
    lambda h: setattr(h, "backend", "torch"),
    lambda h: setattr(h, "lease_id", "req-2"),
    lambda h: setattr(h, "num_tokens", 6),
    lambda h: setattr(h, "block_size", 8),
    # A replayed handle's lease made to end later, or never (0: a build before it was signed).
    lambda h: setattr(h, "lease_expires_unix_s", h.lease_expires_unix_s + 3600),
    lambda h: setattr(h, "lease_expires_unix_s", 0.0),
    lambda h: h.block_ids.__setitem__(1, 9),  # the same lease, another block
    lambda h: h.block_ids.reverse(),  # the same blocks, in another order
    lambda h: h.rank_handles.__setitem__(1, b'{"a":2}'),
    lambda h: setattr(h, "mac", h.mac[:-1] + bytes([h.mac[-1] ^ 1])),
    lambda h: setattr(h, "mac", b""),
])
def test_a_changed_handle_does_not_verify(change):
    h = _handle()
    change(h)
    assert not handle_mac.verify(KEY, h, TOKENS)


def test_the_same_blocks_under_other_tokens_or_another_key_do_not_verify():
    h = _handle()
    assert not handle_mac.verify(KEY, h, [5, 6, 7, 8, 10])
    assert not handle_mac.verify(KEY, h, TOKENS[:4])
    assert not handle_mac.verify(handle_mac.new_key(), h, TOKENS)


def test_fields_do_not_run_together():
    """Length-prefixed fields: moving a character from one string field to the next changes
    the MAC (plain concatenation would have signed both handles alike)."""
    a = common_pb2.KVHandle(worker_id="ab", worker_address="c")
    b = common_pb2.KVHandle(worker_id="a", worker_address="bc")
    assert handle_mac.sign(KEY, a, TOKENS) != handle_mac.sign(KEY, b, TOKENS)
