"""Typed exceptions, one per gRPC status the router answers with."""
from __future__ import annotations

import grpc


class PdserveError(Exception):
    """A failed call; ``code`` is the gRPC status, ``details`` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(PdserveError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(PdserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(PdserveError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(PdserveError):
    code = grpc.StatusCode.CANCELLED


# A call in flight when its client's close() (another thread or task) shut the channels.
CLIENT_CLOSED = "the call was cancelled: its client was closed"


class NotFoundError(PdserveError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(PdserveError):
    """The router cannot serve this kind of request as configured (a chat prompt for a model
    without a chat template)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExistsError(PdserveError):
    """A request with this request_id is already in flight on the router."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InternalError(PdserveError):
    code = grpc.StatusCode.INTERNAL


class UnimplementedError(PdserveError, NotImplementedError):
    """The server has no such method: not a pdserve router (a worker's port, another service),
    or a router older than this client's call."""

    code = grpc.StatusCode.UNIMPLEMENTED


class UnauthenticatedError(PdserveError, PermissionError):
    """The router wants an API key (``api_key=``) and got none, or another."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, ResourceExhaustedError,
                                      UnavailableError, DeadlineExceededError, CancelledError,
                                      NotFoundError, InternalError, UnauthenticatedError,
                                      FailedPreconditionError, AlreadyExistsError,
                                      UnimplementedError)}
# gRPC's own text for it ("Method not found!") names neither the method nor a likely cause.
_UNIMPLEMENTED_HINT = ("the server does not serve this call: is the address a pdserve router's "
                       "(not a worker's), and the router as new as this client?")


# What gRPC's server says when it stops with calls that arrived but that no handler took yet:
# it ends them CANCELLED, with this text and no metadata (grpc/grpc#41785), though the caller
# cancelled nothing and the server did none of the call.
_UNHANDLED_DETAILS = "CANCELLED"
_UNHANDLED_MESSAGE = "the server stopped before it took the call (none of it ran)"


def never_handled(e: BaseException) -> bool:
    """Whether a call's error is a stopping server's end of a call no handler took: no part
    of it ran, so it may go to another server as if the connection had failed."""
    code, details, trailing = (getattr(e, name, None)
                               for name in ("code", "details", "trailing_metadata"))
    if not isinstance(e, grpc.RpcError) or not callable(code) or not callable(details):
        return False
    return (code() == grpc.StatusCode.CANCELLED and details() == _UNHANDLED_DETAILS
            and not (trailing() if callable(trailing) else None))


def error_from_rpc(e: grpc.RpcError, note: str = "") -> PdserveError:
    """The typed exception of a failed call; ``note``, if any, follows the server's message."""
    if never_handled(e):  # the router stopped: a server fault, not the caller's cancel
        return UnavailableError(f"{_UNHANDLED_MESSAGE} ({note})" if note else _UNHANDLED_MESSAGE)
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(code)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        note = f"{_UNIMPLEMENTED_HINT}; {note}" if note else _UNIMPLEMENTED_HINT
    return _BY_CODE.get(code, PdserveError)(f"{details} ({note})" if note else details, code)
