"""The loader's timed choice between packed GEMMs: what it picks, and that a host measures once."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import engine.linear_tuning as tuning
from kernels.cpu_linear import onednn_available
from kernels.cpu_mkl_linear import mkl_available
from kernels.cpu_small_linear import small_linear_usable

pytestmark = pytest.mark.skipif(not (onednn_available() and mkl_available()),
                                reason="needs both oneDNN and oneMKL")
KERNELS = ["onednn", "mkl"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(96, 64, generator=g), torch.randn(64, 160, generator=g)]


def test_a_measured_choice_is_cached_for_the_host(cache, monkeypatch):
    first = tuning.choose_linear_kernels(_weights(), KERNELS)
    assert first.kernel in KERNELS
    assert {f"{k}@32" for k in KERNELS} <= set(first.timings_ms)
    assert all(t > 0 for t in first.timings_ms.values())

    def no_second_measurement(*_):
        raise AssertionError("measured again although the host's answer was cached")

    monkeypatch.setattr(tuning, "_measure", no_second_measurement)
    assert tuning.choose_linear_kernels(_weights(), KERNELS) == first
    # Other shapes, other thread counts are other questions.
    with pytest.raises(AssertionError, match="measured again"):
        tuning.choose_linear_kernels(_weights()[:1], KERNELS)


def test_an_unreadable_cache_entry_is_measured_again(cache, monkeypatch):
    measured = []
    real = tuning._measure

    def counted(*args):
        measured.append(1)
        return real(*args)

    monkeypatch.setattr(tuning, "_measure", counted)
    first = tuning.choose_linear_kernels(_weights(), KERNELS)
    (entry,) = (cache / "linear-choice").glob("*.json")
    entry.write_text("{not json")
    # Measured afresh (real timings: the kernel it picks may differ on a loaded host), and the
    # entry written again.
    again = tuning.choose_linear_kernels(_weights(), KERNELS)
    assert len(measured) == 2 and again.kernel in KERNELS and first.kernel in KERNELS
    assert entry.read_text().startswith("{\"kernel\"")
    assert tuning.choose_linear_kernels(_weights(), KERNELS) == again  # cached once more
    assert len(measured) == 2


@pytest.mark.parametrize("mkl_share, few_rows_ms, want_kernel, want_few", [
    (0.5, 9.0, "mkl", False),  # clearly faster: taken; the few-rows kernel is slower
    (0.99, 0.1, "onednn", True),  # within the noise margin: the default stays
])
def test_the_choice_follows_the_timings(monkeypatch, mkl_share, few_rows_ms, want_kernel,
                                        want_few):
    calls = []

    def fake_time(fn, x):
        calls.append(fn)
        n = len(calls)
        # Order of measurement: onednn@32, onednn@256, mkl@32, mkl@256, best@4, few-rows@4.
        return {1: 1.0, 2: 8.0, 3: mkl_share, 4: 8.0 * mkl_share, 5: 1.0}.get(n, few_rows_ms)

    monkeypatch.setattr(tuning, "_time", fake_time)
    choice = tuning._measure(_weights(), KERNELS)
    assert choice.kernel == want_kernel
    assert choice.few_rows_kernel == (want_few and small_linear_usable(_weights()[0]))


@pytest.mark.parametrize("onednn_speedup, want_kernel", [
    (1.3, "mkl"),  # faster, but not enough to give up the compiled step
    (2.0, "onednn"),  # much faster: taken all the same
])
def test_a_preferred_kernel_keeps_its_place_unless_another_is_much_faster(
        cache, monkeypatch, onednn_speedup, want_kernel):
    measured = []

    def fake_measure(weights, candidates, threads, margin):
        measured.append((candidates, margin))
        # The score rule of _measure on fixed timings: the first candidate is the default.
        times = {"mkl": 1.0, "onednn": 1.0 / onednn_speedup}
        best = min(candidates, key=times.get)
        if times[best] > margin * times[candidates[0]]:
            best = candidates[0]
        return tuning.LinearChoice(best, False, {})

    monkeypatch.setattr(tuning, "_measure", fake_measure)
    choice = tuning.choose_linear_kernels(_weights(), KERNELS, prefer="mkl")
    assert choice.kernel == want_kernel
    assert measured == [(["mkl", "onednn"], tuning._PREFERRED_MARGIN)]
    # Without a preference the plain margin decides, and it is another cached question.
    assert tuning.choose_linear_kernels(_weights(), KERNELS).kernel == "onednn"
    assert measured[1] == (KERNELS, tuning._MARGIN)
    assert len(list((cache / "linear-choice").glob("*.json"))) == 2


def test_the_real_score_rule_honours_the_margin(monkeypatch):
    """_measure itself: oneDNN 1.3x faster at both row counts loses to a preferred oneMKL."""
    def fake_time(fn, x):
        fake_time.n += 1
        # Order: mkl@32, mkl@256, onednn@32, onednn@256, then the few-rows pair.
        return {1: 1.0, 2: 8.0, 3: 1.0 / 1.3, 4: 8.0 / 1.3}.get(fake_time.n, 1.0)
    fake_time.n = 0
    monkeypatch.setattr(tuning, "_time", fake_time)
    assert tuning._measure(_weights(), ["mkl", "onednn"], None,
                           tuning._PREFERRED_MARGIN).kernel == "mkl"
    fake_time.n = 0
    assert tuning._measure(_weights(), ["mkl", "onednn"], None).kernel == "onednn"


_RACER = textwrap.dedent("""
    import sys, time, torch
    import engine.linear_tuning as tuning
    real = tuning._measure
    def measure(*args):
        open(sys.argv[1] + "/measured-" + sys.argv[2], "w").close()
        time.sleep(1.0)  # long enough for the other process to reach the lock
        return real(*args)
    tuning._measure = measure
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(96, 64, generator=g), torch.randn(64, 160, generator=g)]
    print(tuning.choose_linear_kernels(w, ["onednn", "mkl"]).kernel)
""")


def test_processes_starting_together_measure_once(cache, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(marks), str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    answers = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(list(marks.iterdir())) == 1  # one measured, the other read its answer
    assert answers[0] == answers[1] and answers[0] in KERNELS


def test_the_engine_packs_with_the_hosts_choice(cache, preset_path):
    from engine import LLM

    with LLM(str(preset_path("tiny-llama")), max_model_len=128, linear_backend="auto") as llm:
        model = llm.engine.executor.runner.model
        (entry,) = (cache / "linear-choice").glob("*.json")
        choice = tuning._read(entry)
        for m in (model.model.layers[0].mlp.down_proj, model.lm_head):
            assert m.packed_weight.kernel == choice.kernel
            assert m.use_small_linear == choice.few_rows_kernel


@pytest.mark.parametrize("eager", [False, True])
def test_the_engine_prefers_the_compiled_steps_gemm_where_that_step_runs(cache, preset_path,
                                                                          monkeypatch, eager):
    import engine.loader
    from engine import LLM

    asked = []
    real = engine.loader.choose_linear_kernels

    def spy(weights, candidates, threads=None, prefer=None):
        asked.append(prefer)
        return real(weights, candidates, threads, prefer)

    monkeypatch.setattr(engine.loader, "choose_linear_kernels", spy)
    with LLM(str(preset_path("tiny-llama")), max_model_len=128, linear_backend="auto",
             enforce_eager=eager):
        pass
    assert asked == [None if eager else "mkl"]


def test_an_unwritable_cache_still_gives_a_choice(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(not_a_dir))  # mkdir under a file fails
    choice = tuning.choose_linear_kernels(_weights(), KERNELS)
    assert choice.kernel in KERNELS and choice.timings_ms


def test_a_failed_cache_write_leaves_no_temp_file(cache, monkeypatch):
    """A full disk fails the write at every start: each must not leave a file behind."""
    def no_space(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuning.json, "dump", no_space)
    choice = tuning.choose_linear_kernels(_weights(), KERNELS)
    assert choice.kernel in KERNELS
    assert [p.name for p in (cache / "linear-choice").iterdir() if not p.name.endswith(".lock")] \
        == []
