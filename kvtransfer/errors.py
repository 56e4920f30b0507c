"""What can go wrong moving KV blocks, as types callers can tell apart."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed (peer gone, backend error); the destination blocks hold garbage.

    ``writes_may_land``: a one-sided READ was still in flight when the pull gave up, and the
    backend cannot prove it was cancelled, so bytes may still arrive in the destination blocks
    for a while. Their owner must not hand them to anyone else until that window has passed.
    """

    writes_may_land = False

    def __init__(self, *args, writes_may_land: bool = False) -> None:
        super().__init__(*args)
        self.writes_may_land = writes_may_land


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within its timeout."""


class PeerGoneError(TransferError, ConnectionError):
    """The other side of a transfer is unreachable or died during it."""


class LayoutMismatchError(ValueError):
    """Two caches cannot exchange blocks; raised before any byte moves."""
