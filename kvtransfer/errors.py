"""What can go wrong moving KV blocks, as types callers can tell apart."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed (peer gone, backend error); the destination blocks hold garbage."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within its timeout."""


class PeerGoneError(TransferError, ConnectionError):
    """The other side of a transfer is unreachable or died during it."""


class LayoutMismatchError(ValueError):
    """Two caches cannot exchange blocks; raised before any byte moves."""
