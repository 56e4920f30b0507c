"""``python3 -m bench.gpu_step_profile`` on CPU: both profiles come back per batch and name the
engine's own code and the torch ops it ran; bad options raise ValueError."""
from __future__ import annotations

import pytest

from bench.gpu_step_profile import StepProfileConfig, main, run


def test_cpu_run_profiles_every_batch():
    cfg = StepProfileConfig(model="tiny-llama", device="cpu", dtype="float32", batches=(1, 3),
                            prompt_len=8, output_len=4, top=40)
    profiles = run(cfg)
    assert [p.batch for p in profiles] == [1, 3]
    for p in profiles:
        assert p.ms_per_step > 0
        # cProfile saw the engine's step loop; torch.profiler saw the torch ops it ran.
        assert "engine/" in p.host_table and "Ordered by: internal time" in p.host_table
        assert "Self CPU" in p.kernel_table and "aten::" in p.kernel_table


def test_cli_prints_one_section_per_batch(capsys):
    main(["--model", "tiny-llama", "--device", "cpu", "--batches", "2", "--prompt-len", "8",
          "--output-len", "3", "--top", "5"])
    out = capsys.readouterr().out
    assert out.count("== batch ") == 1 and "== batch 2:" in out


@pytest.mark.parametrize("kw", [{"batches": ()}, {"batches": (0,)}, {"output_len": 1},
                                {"prompt_len": 0}, {"top": 0}])
def test_bad_options_raise_value_error(kw):
    with pytest.raises(ValueError):
        StepProfileConfig(**kw)
