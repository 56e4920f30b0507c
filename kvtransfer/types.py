"""Plain records agents hand back: what one transfer moved, and running totals."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferStats:
    """One pull (or push): the blocks, bytes and descriptors (NIXL) or messages (torch)."""

    num_blocks: int
    num_bytes: int
    num_descriptors: int
    seconds: float


@dataclass
class TransferCounters:
    """Running totals of one agent (a snapshot when returned by ``counters()``)."""

    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    timeouts: int = 0
    notifications_sent: int = 0
    notifications_received: int = 0
