"""Work queued on an idle engine while another thread briefly holds its lock (the KV
connector's poller does, twice a second) is not lost: the next stats already show it."""
from __future__ import annotations

import threading

from engine import EngineConfig, LLMEngine, SamplingParams


def test_an_abort_that_misses_the_lock_shows_in_the_next_stats(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), role="decode",
                                    num_gpu_blocks=64))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        engine.add_prefilled_request("a", list(range(100, 140)), 5, params)
        engine.add_prefilled_request("q", list(range(200, 240)), 5, params)
        held, go = threading.Event(), threading.Event()

        def hold_the_lock() -> None:  # what reclaim_expired_leases does from the poller
            with engine._lock:
                held.set()
                go.wait()

        t = threading.Thread(target=hold_the_lock)
        t.start()
        held.wait()
        engine.abort("a")  # its try-lock fails: queued
        engine.quarantine_kv("q")
        go.set()
        t.join()
        s = engine.get_stats()
        assert s.num_quarantined == 1
        assert s.num_free_blocks == s.num_total_blocks - 3  # q's 3 blocks stay out of use
    finally:
        engine.shutdown()
