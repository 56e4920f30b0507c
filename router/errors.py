"""The router's own refusals: a gRPC status and the message its caller reads."""
from __future__ import annotations

import grpc


class RouterRejectError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
