"""The TP step message: a model input survives the int64 round trip exactly; garbage is refused."""
import pytest
import torch

from engine.model_runner import prepare_input
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_codec import decode_model_input, encode_model_input


def _sched() -> SchedulerOutput:
    a = Request("a", list(range(5, 25)), SamplingParams())
    a.num_computed_tokens = 19  # one decode-sized step left of its prompt
    b = Request("b", list(range(100, 140)), SamplingParams())
    return SchedulerOutput([ScheduledRequest(a, 1, [3, 4]), ScheduledRequest(b, 17, [7, 1])])


def test_round_trip_is_exact():
    inp = prepare_input(_sched(), 16, torch.device("cpu"))
    got = decode_model_input(encode_model_input(inp), torch.device("cpu"))
    for name in ("input_ids", "positions", "sample_indices"):
        torch.testing.assert_close(getattr(got, name), getattr(inp, name), rtol=0, atol=0)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        want = getattr(inp.meta, name)
        assert getattr(got.meta, name).dtype == want.dtype
        torch.testing.assert_close(getattr(got.meta, name), want, rtol=0, atol=0)
    for name in ("query_lens_list", "seq_lens_list", "max_query_len", "max_seq_len",
                 "block_size", "num_decodes"):
        assert getattr(got.meta, name) == getattr(inp.meta, name), name
    assert got.sample_request_ids == []  # ids stay on rank 0


@pytest.mark.parametrize("data", [b"", b"\x01" * 7, b"\x00" * 48, b"\x05" + b"\x00" * 55])
def test_garbage_is_refused(data):
    with pytest.raises(ValueError):
        decode_model_input(data, torch.device("cpu"))
