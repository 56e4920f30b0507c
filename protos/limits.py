"""How large a gRPC message pdserve's services and SDK send and take.

``PDSERVE_MAX_MESSAGE_BYTES`` (default 64 MiB) sets it for every service a process starts and
every channel it opens; a cluster's processes inherit it from ``pdserve up``. The default holds
a 1M-token prompt's ids (8+ MB as int64s); what outgrows it is per-token data: a prefill's
answer with ``prompt_logprobs`` takes ~440 bytes a prompt token at 20 logprobs, so 64 MiB
covers ~150k-token prompts. Here, in ``protos``, because the SDK and the services both use it
and the SDK imports nothing of the engine.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "PDSERVE_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Below this a request's own prompt ids would not fit.
MIN_MESSAGE_BYTES = 64 * 1024
# gRPC takes the limit as a C int.
MAX_MESSAGE_BYTES_LIMIT = 2**31 - 1
# What a router adds to a worker's answer as it passes it on (its request id, usage with the
# workers' ids, the model's identity): a worker refuses an answer that leaves less room, or
# the router could not send on what the worker sent (its client got RESOURCE_EXHAUSTED).
ROUTER_ROOM_BYTES = 8 * 1024


def max_message_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """``$PDSERVE_MAX_MESSAGE_BYTES``, else the default; ValueError when it is not an integer
    in [MIN_MESSAGE_BYTES, 2**31 - 1]."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MESSAGE_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer number of bytes, got {raw!r}") from None
    if not MIN_MESSAGE_BYTES <= value <= MAX_MESSAGE_BYTES_LIMIT:
        raise ValueError(f"{ENV} must be in [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES_LIMIT}], "
                         f"got {value}")
    return value


def message_size_options(environ: Mapping[str, str] = os.environ) -> list[tuple[str, int]]:
    """gRPC channel and server options for the limit, both ways."""
    limit = max_message_bytes(environ)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
