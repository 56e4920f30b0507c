"""A KV-cache owner in its own process (tests): registers a seeded random cache with NIXL,
prints its handle as hex, then echoes release notifications until stdin closes."""
from __future__ import annotations

import json
import sys
import threading
import time

import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import make_agent


def seeded_cache(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g, dtype=torch.float32)


def main() -> None:
    layout = KVCacheLayout.from_json(sys.argv[1])
    seed = int(sys.argv[2])
    agent = make_agent("nixl", seeded_cache(layout, seed), layout)
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
