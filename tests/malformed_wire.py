"""Requests that are not their method's message, sent as raw bytes to every method of a
service: what a client without protobuf's checks (or a broken proxy) can send."""
from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor, ServiceDescriptor

# A tag byte whose varint never ends: no message parses it.
GARBAGE = b"\xff\xff\xff\xff"


def bad_utf8(message_descriptor) -> bytes | None:
    """The message with its first string field set to bytes that are not UTF-8 (None when it
    has no string field)."""
    for field in message_descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            return bytes([(field.number << 3) | 2, 3]) + b"\xffab"
    return None


def malformed_payloads(service: ServiceDescriptor):
    """(method path, client streaming, server streaming, what, payload) for every method."""
    for method in service.methods:
        path = f"/{service.full_name}/{method.name}"
        payloads = [("garbage", GARBAGE)]
        utf8 = bad_utf8(method.input_type)
        if utf8 is not None:
            payloads.append(("bad utf-8", utf8))
        for what, payload in payloads:
            yield path, method.client_streaming, method.server_streaming, what, payload


def send_raw(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
             payload: bytes, metadata=(), timeout: float = 30.0) -> grpc.RpcError | None:
    """The call's error, or None when it ended OK."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kind[(client_streaming, server_streaming)](path)  # no serializers: raw bytes
    request = iter([payload]) if client_streaming else payload
    try:
        result = call(request, timeout=timeout, metadata=metadata)
        if server_streaming:
            list(result)
    except grpc.RpcError as e:
        return e
    return None


def assert_every_method_refuses_malformed(channel: grpc.Channel, service: ServiceDescriptor,
                                          metadata=()) -> int:
    """Each malformed payload ends INVALID_ARGUMENT naming the parse; the count of calls."""
    n = 0
    for path, cs, ss, what, payload in malformed_payloads(service):
        err = send_raw(channel, path, cs, ss, payload, metadata)
        assert err is not None, (path, what, "ended OK")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, what, err.code(),
                                                                 err.details())
        assert err.details().startswith("the request message does not parse: "), \
            (path, what, err.details())
        n += 1
    return n


def four_kinds_handler(service: str, servicer, request_type, response_type
                       ) -> grpc.GenericRpcHandler:
    """``service``'s methods UnaryUnary, UnaryStream, StreamUnary and StreamStream, served by
    ``servicer``'s unary_unary, unary_stream, stream_unary and stream_stream."""
    kw = dict(request_deserializer=request_type.FromString,
              response_serializer=response_type.SerializeToString)
    return grpc.method_handlers_generic_handler(service, {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(servicer.unary_unary, **kw),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(servicer.unary_stream, **kw),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(servicer.stream_unary, **kw),
        "StreamStream": grpc.stream_stream_rpc_method_handler(servicer.stream_stream, **kw),
    })
