"""A rank's KV cache as a remote reader sees it: a serializable handle (JSON bytes, no pickle)."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout

_BACKENDS = ("nixl",)


@dataclass(frozen=True)
class KVAgentHandle:
    backend: str
    # The owner's agent name, unique per process and rank.
    agent_name: str
    # Backend connection info (NIXL: the agent's metadata blob, with its memory registrations).
    metadata: bytes
    # The registered cache tensor: start address, size in bytes, device id, "DRAM" or "VRAM".
    base_addr: int
    num_bytes: int
    device_id: int
    mem_type: str
    layout: KVCacheLayout

    def to_bytes(self) -> bytes:
        return json.dumps({
            "backend": self.backend, "agent_name": self.agent_name,
            "metadata": base64.b64encode(self.metadata).decode(), "base_addr": self.base_addr,
            "num_bytes": self.num_bytes, "device_id": self.device_id, "mem_type": self.mem_type,
            "layout": json.loads(self.layout.to_json())}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVAgentHandle:
        try:
            d = json.loads(raw)
            handle = cls(backend=str(d["backend"]), agent_name=str(d["agent_name"]),
                         metadata=base64.b64decode(d["metadata"], validate=True),
                         base_addr=int(d["base_addr"]), num_bytes=int(d["num_bytes"]),
                         device_id=int(d["device_id"]), mem_type=str(d["mem_type"]),
                         layout=KVCacheLayout(**d["layout"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not a KV agent handle: {type(e).__name__}: {e}") from None
        handle.validate()
        return handle

    def validate(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"unknown KV transfer backend {self.backend!r}")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"unknown memory type {self.mem_type!r}")
        lay = self.layout
        need = (lay.num_layers * 2 * lay.num_blocks * lay.block_size * lay.num_kv_heads
                * lay.head_size * lay.element_size)
        if self.num_bytes != need or self.base_addr <= 0:
            raise ValueError(f"handle of {self.agent_name!r} describes {self.num_bytes} bytes at "
                             f"{self.base_addr:#x}; its layout needs {need}")
