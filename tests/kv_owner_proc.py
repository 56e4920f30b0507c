"""KV-cache owners in their own processes (tests).

``python -m tests.kv_owner_proc LAYOUT_JSON SEED [BACKEND [DEVICE]]``: registers a seeded random
cache (on DEVICE, the CPU by default) with an agent, prints its handle as hex, then echoes
release notifications until stdin closes.

``python -m tests.kv_owner_proc engine CONFIG_JSON``: a prefill-role LLMEngine with a KV
transfer backend. It prints its ranks' handles, then answers one JSON command per stdin line:
``{"op": "prefill", "id", "prompt"}`` -> ``LEASE {...}`` once the first token is out, and
``{"op": "stats"}`` -> ``STATS {...}`` (with, over torch, the reader connections of rank 0). Releases arrive through the engine's own agent.

``python -m tests.kv_owner_proc standby [engine]``: the imports either mode needs done ahead,
then one JSON line on stdin, ``{"argv": [...], "env": {...}}``, and on as if started with
those arguments in that environment (``Standby`` keeps such processes ready, so a test's owner
does not wait seconds for torch, NIXL and the engine to import).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import make_agent
from tests.proc_signals import reap


def pull_concurrently(agent, handles: list, jobs: list[tuple[list[int], list[int]]],
                      tag: str, timeout_s: float) -> list[BaseException]:
    """Runs each (remote ids, local ids) pull of ``jobs`` on its own thread, each with its own
    release notification; closes ``agent`` after; the errors raised, if any."""
    errors: list[BaseException] = []

    def run(src: list[int], dst: list[int], i: int) -> None:
        try:
            agent.pull(handles, src, dst, timeout_s=timeout_s, notify=f"release:{tag}{i}".encode())
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s, d, i)) for i, (s, d) in enumerate(jobs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        agent.close()
    return errors


# The in-process agent tests' cache: 2 layers of 8 blocks of 4 tokens, quick to register.
SMALL_LAYOUT = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                             kv_head_start=0, total_num_kv_heads=2, head_size=8,
                             dtype="float32", tp_rank=0, tp_size=1)


def seeded_cache(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g, dtype=torch.float32)


def engine_main(config_json: str) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(**json.loads(config_json)))
    print("HANDLES", json.dumps([h.to_bytes().hex() for h in engine.kv_transfer_handles()]),
          flush=True)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            engine.add_request(cmd["id"], cmd["prompt"], params)
            lease = None
            while lease is None:
                lease = next((o for o in engine.step() if o.kv_lease is not None), None)
            print("LEASE", json.dumps({
                "id": lease.request_id, "block_ids": lease.kv_lease.block_ids,
                "first_token": lease.token_ids[0], "prompt": lease.prompt_token_ids}), flush=True)
        elif cmd["op"] == "stats":
            s = engine.get_stats()
            server = getattr(engine.kv_connector.agent, "_server", None)  # the torch backend's
            print("STATS", json.dumps({"free": s.num_free_blocks, "total": s.num_total_blocks,
                                       "leased": s.num_leased, "expired": s.num_expired_leases,
                                       "released": engine.kv_connector.num_released,
                                       "readers": server and server.num_readers}),
                  flush=True)
    engine.shutdown()


class Standby:
    """``size`` owner processes started ahead (``engine``: for the engine mode), their imports
    done or under way while the test before runs. ``start(argv)``: one of them, told its
    arguments and this process's environment as it is now, and another started in its
    place."""

    def __init__(self, engine: bool = False, size: int = 1) -> None:
        self.engine, self.size = engine, size
        self._procs: list[subprocess.Popen] = []
        self._fill()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.kv_owner_proc", "standby",
             *(["engine"] if self.engine else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _fill(self) -> None:
        self._procs = [p for p in self._procs if p.poll() is None]
        while len(self._procs) < self.size:
            self._procs.append(self._spawn())

    def start(self, argv: list[str]) -> subprocess.Popen:
        proc = self._procs.pop(0) if self._procs else self._spawn()
        if proc.poll() is not None:
            proc = self._spawn()
        proc.stdin.write(json.dumps({"argv": argv, "env": dict(os.environ)}) + "\n")
        proc.stdin.flush()
        self._fill()
        return proc

    def close(self) -> None:
        for proc in self._procs:  # never told to start: nothing of it to stop cleanly
            reap(proc)
        self._procs = []


def standby_main(engine: bool) -> None:
    import kvtransfer.nixl_agent  # noqa: F401
    import kvtransfer.torch_agent  # noqa: F401

    if engine:
        import transformers.models.auto.configuration_auto  # noqa: F401
        import transformers.models.auto.tokenization_auto  # noqa: F401

        import engine as _engine  # noqa: F401
    line = sys.stdin.readline()
    if not line:  # closed unused
        return
    started = json.loads(line)
    os.environ.clear()  # the caller's environment now (a test may have set UCX_TLS since)
    os.environ.update(started["env"])
    sys.argv = [sys.argv[0], *started["argv"]]
    main()


def main() -> None:
    if sys.argv[1] == "standby":
        standby_main(sys.argv[2:] == ["engine"])
        return
    if sys.argv[1] == "engine":
        engine_main(sys.argv[2])
        return
    layout = KVCacheLayout.from_json(sys.argv[1])
    seed = int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "nixl"
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    agent = make_agent(backend, seeded_cache(layout, seed).to(device), layout)
    print("HANDLE", agent.handle().to_bytes().hex(), flush=True)
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not done.is_set():
        for msg in agent.poll_notifications():
            print("NOTIFY", json.dumps({"notification": msg.decode()}), flush=True)
        time.sleep(0.005)
    agent.close()


if __name__ == "__main__":
    main()
