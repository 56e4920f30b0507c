"""bench/spy_summary.py on py-spy's raw format: a real recording of a process with one busy
thread and one asleep where py-spy is installed, else the format as py-spy writes it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from bench.spy_summary import main, parse, summary

_RAW = """\
thread (11): MainThread;run (uvloop/__init__.py:96);Runner.run (asyncio/runners.py:118) 40
thread (12): pdserve-engine;run (thread_names.py:43);LLMEngine.step (llm_engine.py:258);prepare_input (model_runner.py:236) 30
thread (12): pdserve-engine;run (thread_names.py:43);LLMEngine.step (llm_engine.py:260);ModelRunner.run (model_runner.py:113) 50
thread (12): pdserve-engine;run (thread_names.py:43);Event.wait (threading.py:655) 20
"""


def test_each_thread_s_share_and_where_its_samples_were():
    threads = parse(_RAW)
    engine = threads["thread (12): pdserve-engine"]
    assert (engine.samples, threads["thread (11): MainThread"].samples) == (100, 40)
    assert engine.inclusive["LLMEngine.step (llm_engine.py)"] == 80  # two lines, one function
    assert engine.own["Event.wait (threading.py:655)"] == 20
    text = summary(threads, "engine", top=5, expected=200)
    table, engine_part = text.split("\n\n")
    assert table.splitlines()[1:] == [
        f"{'thread (12): pdserve-engine':<48} {100:>8} {'50.0%':>8}",
        f"{'thread (11): MainThread':<48} {40:>8} {'20.0%':>8}"]
    lines = engine_part.splitlines()
    assert lines[0] == "thread (12): pdserve-engine, 100 samples; inclusive:"
    assert "   80.0%  LLMEngine.step (llm_engine.py)" in lines
    # Every sample went through the thread's entry: it says nothing, so it is left out.
    assert not [line for line in lines[:lines.index("  self:")] if "thread_names" in line]
    assert lines[lines.index("  self:") + 1] == "   50.0%  ModelRunner.run (model_runner.py:113)"
    assert "MainThread," not in text  # only the threads asked about get their functions


def test_a_file_that_is_not_a_raw_profile_is_refused(tmp_path, capsys):
    bad = tmp_path / "x.spy"
    bad.write_text("this is an svg\n")
    assert main([str(bad)]) == 1
    assert "line 1 is not a py-spy raw sample" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.spy")]) == 1
    with pytest.raises(SystemExit):
        main([str(bad), "--seconds", "8"])  # without --rate


_BUSY = """
import threading, time
def spin():
    while True:
        sum(range(1000))
threading.Thread(target=spin, name="spinner", daemon=True).start()
print("spinning", flush=True)
time.sleep(60)
"""


def test_a_real_recording(tmp_path, capsys):
    # Installed with the dev extras beside this interpreter, which need not be on PATH.
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        pytest.skip("py-spy is not installed (bench/gpu_carry.sh carries it to GPU machines)")
    proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE, text=True)
    try:
        # Recorded from its start, the main thread was caught once before its sleep (0.5% of
        # the samples, on CI): the recording begins once only the spinner runs.
        assert proc.stdout.readline() == "spinning\n"
        out = tmp_path / "p.spy"
        rec = subprocess.run([spy, "record", "-p", str(proc.pid), "-d", "2", "-r", "100", "-f",
                              "raw", "--threads", "-o", str(out), "--nonblocking"],
                             capture_output=True, text=True, timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    if rec.returncode != 0 and "ermission denied" in rec.stderr + rec.stdout:
        pytest.skip("py-spy may not attach here (ptrace: run as root, or ptrace_scope 0)")
    assert rec.returncode == 0, rec.stderr
    assert main([str(out), "--seconds", "2", "--rate", "100", "--thread", "spinner"]) == 0
    text = capsys.readouterr().out
    assert "spinner" in text and "spin (<string>:5)" in text
    assert "MainThread" not in text  # asleep the whole time: not sampled without --idle
