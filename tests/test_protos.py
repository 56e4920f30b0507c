"""The committed generated code matches the .proto files."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from protos import common_pb2, router_pb2, worker_pb2
from protos.generate import PROTOS_DIR

# Lines that name the generator's version: a newer grpcio-tools may stamp them differently
# without the messages or services changing.
_VERSION_LINE = re.compile(r"(Protobuf Python Version|GRPC_GENERATED_VERSION|^\s*\d+,\s*$)")


def _normalized(path: pathlib.Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not _VERSION_LINE.search(line)]


def test_generated_code_is_current(tmp_path):
    # protoc runs in its own process: in-process it can crash once grpc and other protobuf
    # modules are loaded (seen as a segfault in the full suite).
    subprocess.run([sys.executable, "-m", "protos.generate", "--out", str(tmp_path)], check=True,
                   capture_output=True, cwd=PROTOS_DIR.parent)
    fresh = sorted((tmp_path / "protos").glob("*_pb2*.py*"))
    assert {p.name for p in fresh} == {p.name for p in PROTOS_DIR.glob("*_pb2*.py*")}
    for path in fresh:
        committed = PROTOS_DIR / path.name
        assert _normalized(path) == _normalized(committed), (
            f"{committed} is stale: run `python -m protos.generate`")


def test_messages_round_trip():
    req = router_pb2.GenerateRequest(
        request_id="r1", token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]))
    back = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "token_ids"
    assert list(back.token_ids.ids) == [1, 2, 3]
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")
    handle = common_pb2.KVHandle(worker_id="p0", rank_handles=[b"\x00\x01", b"\x02"],
                                 block_ids=[4, 5], num_tokens=20, block_size=16)
    dec = worker_pb2.DecodeRequest(request_id="r1", kv_handle=handle)
    assert worker_pb2.DecodeRequest.FromString(dec.SerializeToString()).kv_handle == handle
