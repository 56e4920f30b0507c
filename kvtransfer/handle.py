"""A rank's KV cache as a remote reader sees it: a serializable handle (JSON bytes, no pickle)."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from engine.kv_layout import KVCacheLayout

BACKENDS = ("nixl", "torch")
# 2: the cache became block-major (engine/kv_layout.py); a version-1 peer's bytes are in
# another order.
_VERSION = 2


@dataclass(frozen=True)
class KVAgentHandle:
    backend: str
    # The owner's agent name, unique per process and rank.
    agent_name: str
    # Backend connection info: NIXL, the agent's metadata blob (with its memory registrations);
    # torch, JSON {"store_port": int} of the owner's rendezvous store.
    metadata: bytes
    # The registered cache tensor: start address, size in bytes, device id, "DRAM" or "VRAM".
    base_addr: int
    num_bytes: int
    device_id: int
    mem_type: str
    layout: KVCacheLayout
    # torch: "host:port" of the owner's control server ("" for NIXL, whose metadata says it).
    address: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps({
            "version": _VERSION, "backend": self.backend, "agent_name": self.agent_name,
            "metadata": base64.b64encode(self.metadata).decode(), "base_addr": self.base_addr,
            "num_bytes": self.num_bytes, "device_id": self.device_id, "mem_type": self.mem_type,
            "layout": json.loads(self.layout.to_json()), "address": self.address},
            sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVAgentHandle:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ValueError(f"a KV agent handle is bytes, got {type(raw).__name__}")
        try:
            d = json.loads(bytes(raw))
            if not isinstance(d, dict):
                raise TypeError("not a JSON object")
            if d.get("version") != _VERSION:
                raise ValueError(f"version {d.get('version')!r}, this build reads {_VERSION}")
            # No int() or str() coercion: int(Infinity) raised OverflowError (answered as
            # INTERNAL), and a float or "123" address slipped through as a number.
            handle = cls(backend=d["backend"], agent_name=d["agent_name"],
                         metadata=base64.b64decode(d["metadata"], validate=True),
                         base_addr=d["base_addr"], num_bytes=d["num_bytes"],
                         device_id=d["device_id"], mem_type=d["mem_type"],
                         layout=KVCacheLayout.from_dict(d["layout"]), address=d["address"])
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # deep JSON nesting
            raise ValueError(f"not a KV agent handle: {type(e).__name__}: {e}") from None
        handle.validate()
        return handle

    def validate(self) -> None:
        _check_types(self)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown KV transfer backend {self.backend!r}")
        if not self.agent_name:
            raise ValueError("a KV agent handle needs an agent name")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"unknown memory type {self.mem_type!r}")
        if self.backend == "torch" and not _is_host_port(self.address):
            raise ValueError(f"torch handle of {self.agent_name!r} has no host:port address, "
                             f"got {self.address!r}")
        if self.backend == "torch":
            torch_store_port(self)
        lay = self.layout
        ints = (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_size,
                lay.total_num_kv_heads, lay.tp_size)
        if any(not isinstance(v, int) or v < 1 for v in ints) or lay.dtype not in (
                "float32", "bfloat16", "float16") or not 0 <= lay.kv_head_start \
                <= lay.total_num_kv_heads - lay.num_kv_heads or not 0 <= lay.tp_rank < lay.tp_size:
            raise ValueError(f"handle of {self.agent_name!r} has an invalid layout {lay}")
        if not 0 <= self.device_id < 2**31:
            raise ValueError(f"handle of {self.agent_name!r} has device id {self.device_id}")
        need = lay.num_blocks * lay.bytes_per_block
        if self.num_bytes != need or not 0 < self.base_addr < 2**64 - need:
            raise ValueError(f"handle of {self.agent_name!r} describes {self.num_bytes} bytes at "
                             f"{self.base_addr:#x}; its layout needs {need}")


def torch_store_port(handle: KVAgentHandle) -> int:
    """The owner's rendezvous store port from a torch handle's metadata; ValueError if bad."""
    try:
        port = json.loads(handle.metadata)["store_port"]
    except (ValueError, KeyError, TypeError, RecursionError):
        port = None
    if not _is_int(port) or not 0 < port < 65536:
        raise ValueError(f"torch handle of {handle.agent_name!r} has bad metadata: no store "
                         f"port in (0, 65536) in {handle.metadata[:80]!r}")
    return port


def _check_types(h: KVAgentHandle) -> None:
    for name in ("backend", "agent_name", "mem_type", "address"):
        if not isinstance(getattr(h, name), str):
            raise ValueError(f"a KV agent handle's {name} is a string, got "
                             f"{getattr(h, name)!r}")
    for name in ("base_addr", "num_bytes", "device_id"):
        if not _is_int(getattr(h, name)):
            raise ValueError(f"a KV agent handle's {name} is an integer, got "
                             f"{getattr(h, name)!r}")
    if not isinstance(h.metadata, bytes) or not isinstance(h.layout, KVCacheLayout):
        raise ValueError("a KV agent handle needs metadata bytes and a KVCacheLayout")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    # isdigit alone let "99999999999999999999" through, which failed the connect with an
    # OverflowError (INTERNAL) instead of a refused handle.
    return bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536
