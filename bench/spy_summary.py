"""What a py-spy raw profile says, in a few lines: each thread's samples and, with the
recording's length and rate, the share of the time it was running; then, for the threads asked
about, the functions its samples were in (inclusive) and the innermost frames (self).

    python3 -m bench.spy_summary FILE.spy [--thread NAME_REGEX] [--top 12] [--seconds S --rate HZ]

``bench/gpu_check.sh`` prints this for every file it records, so a lease's log holds the answer
even where the device tool brings back fewer files than were written. It records without
py-spy's --idle, so a sample is a moment the thread was running (py-spy leaves out threads the
OS has asleep), and samples / (seconds x rate) is the share of the time it ran. Frames every
sample of a thread shares (its thread's entry, the event loop's run) are left out of the
inclusive list: they say nothing.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
# An inclusive share at least this high is a frame the thread's samples all go through.
_SHARED = 0.97


@dataclass
class ThreadProfile:
    name: str
    samples: int = 0
    # Function ("name (file)") -> samples under it, each sample counted once per function.
    inclusive: Counter = field(default_factory=Counter)
    own: Counter = field(default_factory=Counter)  # innermost frame ("name (file:line)")


def parse(text: str) -> dict[str, ThreadProfile]:
    """Thread label ("thread (tid): name") -> its profile. Malformed lines raise ValueError."""
    threads: dict[str, ThreadProfile] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {n} is not a py-spy raw sample: {line[:80]!r}")
        label, *frames = stack.split(";")
        t = threads.setdefault(label, ThreadProfile(label))
        samples = int(count)
        t.samples += samples
        t.own[frames[-1] if frames else "(no Python frame)"] += samples
        for func in {_function(f) for f in frames}:
            t.inclusive[func] += samples
    return threads


def _function(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m['func']} ({m['file']})" if m else frame


def summary(threads: dict[str, ThreadProfile], thread_filter: str | None = None,
            top: int = 12, expected: int | None = None) -> str:
    """``expected``: the samples of a thread that ran the whole time (seconds x rate)."""
    lines = [f"{'thread':<48} {'samples':>8}" + (f" {'running':>8}" if expected else "")]
    ordered = sorted(threads.values(), key=lambda t: -t.samples)
    for t in ordered:
        lines.append(f"{t.name[:48]:<48} {t.samples:>8}"
                     + (f" {_pct(t.samples, expected):>8}" if expected else ""))
    pattern = re.compile(thread_filter) if thread_filter else None
    for t in ordered:
        if pattern is not None and not pattern.search(t.name):
            continue
        lines.append(f"\n{t.name}, {t.samples} samples; inclusive:")
        said = [(f, n) for f, n in t.inclusive.most_common() if n < _SHARED * t.samples]
        lines += [f"  {_pct(n, t.samples):>6}  {f}" for f, n in said[:top]]
        lines.append("  self:")
        lines += [f"  {_pct(n, t.samples):>6}  {f}" for f, n in t.own.most_common(top)]
    return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.spy_summary",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--thread", default=None,
                   help="regex of the threads whose functions to list (default: every thread)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--seconds", type=float, default=None, help="the recording's length")
    p.add_argument("--rate", type=float, default=None, help="its samples a second")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error("--top must be at least 1")
    if (args.seconds is None) != (args.rate is None) or (
            args.seconds is not None and (args.seconds <= 0 or args.rate <= 0)):
        p.error("--seconds and --rate go together, both positive")
    expected = round(args.seconds * args.rate) if args.seconds else None
    try:
        with open(args.file, encoding="utf-8", errors="replace") as f:
            threads = parse(f.read())
    except (OSError, ValueError) as e:
        print(f"spy_summary: {args.file}: {e}", file=sys.stderr)
        return 1
    print(summary(threads, args.thread, args.top, expected))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
