"""Prints what tests/crash_witness.py left of a pytest process that died by a signal.

Usage: python tests/crash_report.py FOLDER STATUS, STATUS being pytest's exit status as the shell
gave it. Prints nothing unless a signal ended pytest (STATUS > 128).
"""
import sys
import sysconfig
from pathlib import Path

from crash_witness import CURRENT_FILE, FAULTS_FILE

MAX_LINES = 80


def our_frames(dump: str) -> list[str]:
    """The dump's headers and its frames outside installed packages and the standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    kept = []
    for line in dump.splitlines():
        text = line.strip()
        if not text.startswith("File "):
            kept.append(line)
        elif "site-packages" not in text and stdlib not in text and "<frozen" not in text:
            kept.append(line)
    return kept


def main(folder: str, status: int) -> int:
    path = Path(folder)
    current = path / CURRENT_FILE
    if status <= 128 or not current.exists():
        return 0
    faults = path / FAULTS_FILE
    dump = faults.read_text(errors="replace") if faults.exists() else ""
    print("=" * 25 + f" pytest died by signal {status - 128} " + "=" * 25)
    print(f"while running: {current.read_text(errors='replace') or '(no test had started)'}")
    lines = our_frames(dump)
    print("\n".join(lines[:MAX_LINES]) if lines else "faulthandler wrote nothing")
    if len(lines) > MAX_LINES:
        print(f"... {len(lines) - MAX_LINES} more lines in {faults}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
