"""The router's conditional-disaggregation policy and its configuration."""
from __future__ import annotations

import argparse

import pytest

from engine.cli_serve import add_router_args
from router.config import RouterConfig
from router.local_prefill import (LocalPrefillConfig, should_prefill_locally,
                                  should_reuse_decode_cache)

CFG = LocalPrefillConfig(max_local_prefill_length=100, local_prefill_queue_threshold=2)


@pytest.mark.parametrize("prompt, cached, inflight, local", [
    (100, 0, 2, True),     # at both limits
    (101, 0, 2, False),    # one uncached token too many
    (300, 200, 2, True),   # long, but the prefill worker holds all but 100 tokens
    (300, 199, 5, False),
    (50, 0, 1, False),     # the prefill worker is not busy enough: it is the faster place
    (50, 0, 0, False),
    (50, 80, 3, True),     # a match longer than the prompt counts as the whole prompt
])
def test_policy_needs_a_short_uncached_prompt_and_a_busy_prefill_worker(prompt, cached,
                                                                         inflight, local):
    assert should_prefill_locally(CFG, prompt, cached, inflight, 0) is local


@pytest.mark.parametrize("inflight, decode_prefilling, local", [
    (2, 0, True), (2, 1, True), (2, 2, False), (5, 4, True), (5, 9, False)])
def test_the_decode_worker_takes_no_more_prompts_than_the_prefill_worker_has(
        inflight, decode_prefilling, local):
    # A burst must be shared between the two, not moved wholesale onto the decode worker.
    assert should_prefill_locally(CFG, 10, 0, inflight, decode_prefilling) is local


def test_threshold_zero_sends_every_short_prompt_local():
    cfg = LocalPrefillConfig(max_local_prefill_length=64, local_prefill_queue_threshold=0)
    assert should_prefill_locally(cfg, 64, 0, 0, 0)
    assert should_prefill_locally(cfg, 64, 0, 0, 50)  # no balancing asked for
    assert not should_prefill_locally(cfg, 65, 0, 0, 0)


def test_length_zero_turns_local_prefill_off():
    cfg = LocalPrefillConfig(max_local_prefill_length=0, local_prefill_queue_threshold=0)
    assert not cfg.enabled
    assert not should_prefill_locally(cfg, 1, 0, 100, 0)


def test_defaults_leave_the_feature_off():
    cfg = LocalPrefillConfig()
    assert not cfg.enabled and cfg.max_local_prefill_length == 0
    assert cfg.local_prefill_queue_threshold == 2
    assert not should_prefill_locally(cfg, 1, 0, 100, 0)


@pytest.mark.parametrize("prompt,decode_cached,prefill_cached,reuse", [
    (190, 176, 80, True),    # a chat's next turn: the reply's blocks on the decode worker
    (190, 176, 112, True),   # a lead of exactly the minimum
    (190, 176, 113, False),  # one token short of it
    (400, 176, 80, False),   # more left to compute (224) than the lead (96)
    (272, 176, 80, True),    # left to compute (96) equal to the lead
    (190, 0, 0, False),      # nothing cached anywhere
    (100, 300, 0, True),     # counts clipped to the prompt: lead 100, nothing left
])
def test_a_decode_worker_holding_more_of_the_prompt_prefills_it(prompt, decode_cached,
                                                                 prefill_cached, reuse):
    cfg = LocalPrefillConfig()  # local prefill for load stays off: this is a separate reason
    assert cfg.decode_prefix_reuse_min_tokens == 64 and not cfg.enabled
    assert should_reuse_decode_cache(cfg, prompt, decode_cached, prefill_cached) is reuse


def test_a_decode_worker_busy_prefilling_needs_a_longer_lead():
    cfg = LocalPrefillConfig()
    # Lead 416: enough alone; less 256 per prompt it is prefilling: 160, then -96.
    assert should_reuse_decode_cache(cfg, 500, 496, 80, decode_prefilling=1)
    assert not should_reuse_decode_cache(cfg, 500, 496, 80, decode_prefilling=2)


def test_zero_turns_decode_cache_reuse_off():
    cfg = LocalPrefillConfig(decode_prefix_reuse_min_tokens=0)
    assert not should_reuse_decode_cache(cfg, 1000, 990, 0)


@pytest.mark.parametrize("kw", [
    {"decode_prefix_reuse_min_tokens": -1},
    {"decode_prefix_reuse_min_tokens": 2.0},
    {"max_local_prefill_length": -1},
    {"local_prefill_queue_threshold": -1},
    {"max_local_prefill_length": 1.5},
    {"local_prefill_queue_threshold": "2"},
    {"max_local_prefill_length": True},
])
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        LocalPrefillConfig(**kw)


def test_router_config_carries_the_policy():
    cfg = RouterConfig(model="tiny-llama", redis_url="redis://localhost:6379")
    assert cfg.local_prefill == LocalPrefillConfig()
    with pytest.raises(ValueError, match="local_prefill"):
        RouterConfig(model="tiny-llama", redis_url="redis://localhost:6379",
                     local_prefill={"max_local_prefill_length": 10})


def test_router_flags_default_to_the_config_defaults():
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--redis-url", "redis://x"])
    assert LocalPrefillConfig(args.max_local_prefill_length,
                              args.local_prefill_queue_threshold,
                              args.decode_prefix_reuse_min_tokens) == LocalPrefillConfig()
    args = p.parse_args(["--redis-url", "redis://x", "--max-local-prefill-length", "0",
                         "--local-prefill-queue-threshold", "7",
                         "--decode-prefix-reuse-min-tokens", "0"])
    assert (args.max_local_prefill_length, args.local_prefill_queue_threshold,
            args.decode_prefix_reuse_min_tokens) == (0, 7, 0)


def test_a_decode_workers_local_prefills_are_counted_until_they_end():
    from router.directory import WorkerHandle, prefilling

    w = WorkerHandle(info=None, channel=None, prefill_stub=None, decode_stub=None)
    with prefilling(w):
        with prefilling(w):
            assert w.prefilling == 2
        assert w.prefilling == 1
    with pytest.raises(RuntimeError), prefilling(w):
        raise RuntimeError("the stream failed before its first token")
    assert w.prefilling == 0


@pytest.mark.parametrize("limit", [-1, 1.5, True, "2"])
def test_a_bad_migration_limit_is_refused(limit):
    with pytest.raises(ValueError, match="migration_limit"):
        RouterConfig(model="tiny-llama", redis_url="redis://localhost:6379",
                     migration_limit=limit)


def test_the_migration_limit_flag_reaches_the_config():
    p = argparse.ArgumentParser()
    add_router_args(p)
    assert p.parse_args(["--redis-url", "redis://x"]).migration_limit == \
        RouterConfig(model="m", redis_url="redis://x").migration_limit
    assert p.parse_args(["--redis-url", "redis://x", "--migration-limit", "0"]).migration_limit == 0


def test_a_bad_decode_stream_is_refused_and_the_flag_matches_the_config():
    with pytest.raises(ValueError, match="decode_stream must be one of"):
        RouterConfig(model="m", redis_url="redis://x", decode_stream="shared")
    p = argparse.ArgumentParser()
    add_router_args(p)
    assert p.parse_args(["--redis-url", "redis://x"]).decode_stream == \
        RouterConfig(model="m", redis_url="redis://x").decode_stream == "multiplexed"
    for mode in ("multiplexed", "per-request"):
        args = p.parse_args(["--redis-url", "redis://x", "--decode-stream", mode])
        assert RouterConfig(model="m", redis_url="redis://x",
                            decode_stream=args.decode_stream).decode_stream == mode


@pytest.mark.parametrize("field, value", [("keepalive_time_s", 0), ("keepalive_timeout_s", -1.0),
                                          ("keepalive_time_s", True),
                                          ("keepalive_timeout_s", "5")])
def test_bad_keepalive_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(model="m", redis_url="redis://x", **{field: value})


def test_the_keepalive_flags_reach_the_config():
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--redis-url", "redis://x", "--keepalive-time-s", "2",
                         "--keepalive-timeout-s", "0.5"])
    assert (args.keepalive_time_s, args.keepalive_timeout_s) == (2.0, 0.5)
    default = p.parse_args(["--redis-url", "redis://x"])
    cfg = RouterConfig(model="m", redis_url="redis://x")
    assert (default.keepalive_time_s, default.keepalive_timeout_s) == \
        (cfg.keepalive_time_s, cfg.keepalive_timeout_s)


@pytest.mark.parametrize("value", [0, 1025, True, 2.0])
def test_a_bad_stream_interval_is_refused(value):
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig(model="m", redis_url="redis://x", stream_interval=value)


def test_the_stream_interval_flag_reaches_the_config():
    p = argparse.ArgumentParser()
    add_router_args(p)
    assert p.parse_args(["--redis-url", "redis://x"]).stream_interval == \
        RouterConfig(model="m", redis_url="redis://x").stream_interval == 1
    assert p.parse_args(["--redis-url", "redis://x", "--stream-interval", "8"]).stream_interval == 8
