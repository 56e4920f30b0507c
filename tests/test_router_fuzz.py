"""Anything a client can send the router, valid or not, against a real cluster (router, a
prefill and a decode worker, Redis): every request ends OK or with a status that names the
client's mistake, never INTERNAL, UNKNOWN, a hang or a dead worker, and afterwards every KV
block is free. Hypothesis draws the requests (fixed examples in CI, see conftest.py)."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import common_pb2, router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.fuzz_strategies import FIELDS, IDS, INT64, WORDS
from tests.malformed_wire import assert_every_method_refuses_malformed
from tests.serving_helpers import SERVING_MODEL, SHORT_CONTEXT_WORKER_ARGS, wait_all_blocks_free

MODEL = SERVING_MODEL

# The statuses that blame the request (or, for RESOURCE_EXHAUSTED, the load it adds).
CLIENT_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}

ROLES = st.sampled_from(["system", "user", "assistant"])
# Tools and tool calls travel as JSON text (router.proto): valid ones, and any text at all.
VALID_TOOL = st.just('{"type": "function", "function": {"name": "f", "parameters": {}}}')
VALID_CALL = st.just('{"id": "c1", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}')
TOOL_JSON = st.one_of(VALID_TOOL, VALID_CALL, st.text(max_size=30),
                      st.just('{"function": {"name": "f", "arguments": "[1]"}}'),
                      st.just("[" * 5000), st.just('{"x": NaN}'))
# A chat's own template (the router trusts them here): ones that render, render nothing, do
# not parse, fail on the chat, and any text.
VALID_TEMPLATE = st.sampled_from(["{% for m in messages %}{{ m['content'] }} {% endfor %}",
                                  "{{ messages | length }}"])
TEMPLATE = st.one_of(VALID_TEMPLATE, st.just("{{ '' }}"),
                     st.just("{% for m in messages %}"), st.just("{{ 1 // 0 }}"),
                     st.just("{{ messages[9].content }}"), st.just("{{ x.y.z }}"),
                     st.just("{{ raise_exception('no') }}"), st.text(max_size=30))


@st.composite
def requests(draw) -> router_pb2.GenerateRequest:
    """Mostly requests the router must serve, with odd but valid values; the rest differ
    from one of those in a single place, with anything the wire can carry there."""
    wild = draw(st.sampled_from([None, None, None, *FIELDS, "prompt", "resume", "request_id"]))
    sampling = {}
    for name, (valid, anything) in FIELDS.items():
        if name == wild or draw(st.integers(0, 3)) == 0:  # a field is set one time in four
            sampling[name] = draw(anything if name == wild else valid)
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    kind = draw(st.sampled_from(["text", "ids", "chat"] + (["none"] if wild == "prompt" else [])))
    if kind == "text":
        req.text = draw(st.text(max_size=40) if wild == "prompt" else WORDS)
    elif kind == "ids":
        ids = (st.lists(st.one_of(st.integers(0, 8300), INT64), max_size=40)
               if wild == "prompt" else st.lists(IDS, min_size=1, max_size=40))
        req.token_ids.ids.extend(draw(ids))
    elif kind == "chat":
        role = st.sampled_from(["system", "user", "assistant", "tool", "", "bot"])
        for _ in range(draw(st.integers(0 if wild == "prompt" else 1, 3))):
            msg = req.chat.messages.add(role=draw(role if wild == "prompt" else ROLES),
                                        content=draw(st.text(max_size=20)))
            msg.tool_calls.extend(draw(st.lists(TOOL_JSON if wild == "prompt" else VALID_CALL,
                                                max_size=2)))
        req.chat.continue_final_message = draw(st.booleans()) and wild == "prompt"
        req.chat.tools.extend(draw(st.lists(TOOL_JSON if wild == "prompt" else VALID_TOOL,
                                            max_size=2)))
        if draw(st.booleans()):
            req.chat.chat_template = draw(TEMPLATE if wild == "prompt" else VALID_TEMPLATE)
    if wild == "resume":
        req.resume_token_ids.extend(draw(st.lists(st.one_of(st.integers(-3, 8300), INT64),
                                                  max_size=5)))
    if wild == "request_id":
        req.request_id = draw(st.text(max_size=8))
    return req


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterSpec(model=MODEL, worker_args=SHORT_CONTEXT_WORKER_ARGS,
                             router_args=["--trust-request-chat-template"])) as c:
        with grpc.insecure_channel(c.router_address) as channel:
            c.stub = router_pb2_grpc.RouterStub(channel)
            yield c


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(req=requests(), streamed=st.booleans())
def test_any_request_ends_ok_or_with_a_client_status(cluster, req, streamed):
    try:
        if streamed:
            chunks = list(cluster.stub.Generate(req, timeout=60))
            assert chunks and chunks[-1].finish_reason
        else:
            assert cluster.stub.Complete(req, timeout=60).finish_reason
    except grpc.RpcError as e:
        assert e.code() in CLIENT_STATUSES, (e.code(), e.details(), req)
        assert e.details() and "Traceback" not in e.details()


def test_bytes_that_are_no_request_get_invalid_argument_from_every_router_method(cluster):
    """Not protobuf's UNKNOWN "Unexpected <class 'DecodeError'>" (engine/malformed_requests.py)."""
    with grpc.insecure_channel(cluster.router_address) as channel:
        for name in ("Router", "RouterAdmin"):
            service = router_pb2.DESCRIPTOR.services_by_name[name]
            assert assert_every_method_refuses_malformed(channel, service) > len(service.methods)


def test_the_cluster_is_whole_afterwards(cluster):
    assert all(p.popen.poll() is None for p in cluster.procs)
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"])
