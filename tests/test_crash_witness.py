"""`make test`'s report of a pytest that a native abort killed (tests/crash_witness.py)."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTS = textwrap.dedent("""
    import os
    import threading


    def test_fine():
        pass


    def helper_that_aborts():
        os.abort()


    def test_dies_in_a_thread():
        t = threading.Thread(target=helper_that_aborts)
        t.start()
        t.join()


    def test_never_reached():
        pass
""")


def run_pytest(tmp_path, body, select):
    (tmp_path / "test_victim.py").write_text(body)
    log = tmp_path / "crash"
    env = dict(os.environ, PDSERVE_CRASH_LOG=str(log))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.crash_witness", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), f"{tmp_path / 'test_victim.py'}{select}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    status = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # as a shell has it
    report = subprocess.run([sys.executable, str(ROOT / "tests" / "crash_report.py"), str(log),
                             str(status)], capture_output=True, text=True, timeout=60)
    return proc, report


def test_a_pytest_killed_by_an_abort_is_reported_with_its_test_and_our_frames(tmp_path):
    proc, report = run_pytest(tmp_path, TESTS, "")
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert "pytest died by signal 6" in out
    assert "while running: " in out and "test_victim.py::test_dies_in_a_thread" in out
    # The aborting thread's own frame, and the test's, not pytest's or threading's.
    assert "helper_that_aborts" in out and "test_dies_in_a_thread" in out
    assert "site-packages" not in out and "threading.py" not in out


def test_an_abort_while_the_interpreter_exits_is_reported_too(tmp_path):
    body = textwrap.dedent("""
        import atexit
        import os


        def abort_at_exit():
            os.abort()


        def test_leaves_an_abort_for_the_exit():
            atexit.register(abort_at_exit)
    """)
    proc, report = run_pytest(tmp_path, body, "")
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert "1 passed" in proc.stdout
    assert "the interpreter was exiting" in report.stdout
    assert "abort_at_exit" in report.stdout


def test_a_session_that_ends_on_its_own_reports_nothing(tmp_path):
    body = "def test_fails():\n    assert 1 == 2\n"
    proc, report = run_pytest(tmp_path, body, "")
    assert proc.returncode == 1
    assert report.returncode == 0 and report.stdout == ""
