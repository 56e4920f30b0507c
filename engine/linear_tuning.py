"""Which packed GEMM runs this model's linear layers fastest on this CPU, by timing them.

oneDNN's and oneMKL's packed GEMMs trade places between CPUs: oneDNN led on the AVX-512 Zen 4
VM; on the AVX2 Zen 2 VM oneMKL runs the same layers 1.3-1.6x faster, and even beats the
few-rows kernel at decode batch sizes. So with ``--linear-backend auto`` the loader times the
candidates on the model's own weight shapes (one decoder layer's linears) at a few row counts
before it packs anything. Where the compiled CPU step can run, its GEMM (oneMKL's) is
preferred: kept unless another is much faster (see _PREFERRED_MARGIN).

The answer is kept in the kernel cache, keyed by the CPU, torch, the dtype, the shapes, the
thread count and the preference, so every process on a host packs alike (TP ranks, workers
started together, a test and its in-process reference); a file lock makes processes that
start together wait for the one that measures instead of timing each other's noise.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.cpu_build import cache_dir, cpu_identity
from kernels.cpu_linear import pack_linear
from kernels.cpu_small_linear import small_linear, small_linear_usable
from kernels.mkl_vendor import enable_mkl_cpu_dispatch

logger = logging.getLogger(__name__)

# Row counts timed: a decode batch, a prefill chunk (capped by _FLOP_BUDGET for big layers).
_ROWS = (32, 256)
_FEW_ROWS = 4  # the few-rows kernel's case (it takes up to SMALL_LINEAR_MAX_ROWS): low-batch decode
# Floating-point operations one timed pass may take, so a 7B layer does not take seconds.
_FLOP_BUDGET = 4e9
_REPEATS = 5
# The first candidate (the default) keeps its place unless another beats it by this much:
# timing noise must not flip the choice.
_MARGIN = 0.97
# Only oneMKL's packs run in the compiled CPU step (engine/cpu_graph.py), which takes the
# per-layer Python off every step: where that step can run, its GEMM keeps its place unless
# another is 1.5x faster on the timed rows. Timing GEMMs alone cannot see this: on the Zen 4
# VM oneDNN's won some timings by up to 25%, and the worker that took it decoded a batch of
# one at 8.1 ms a token on two threads where oneMKL with the compiled step takes 3.5.
_PREFERRED_MARGIN = 2 / 3


@dataclass(frozen=True)
class LinearChoice:
    kernel: str  # the packed GEMM (kernels.cpu_linear.PACKED_KERNELS)
    few_rows_kernel: bool  # calls of few rows go to the few-rows kernel instead
    timings_ms: dict[str, float]  # what the choice rests on, by "<kernel>@<rows>"


def choose_linear_kernels(weights: list[torch.Tensor], candidates: list[str],
                          pack_threads: int | None = None,
                          prefer: str | None = None) -> LinearChoice:
    """The fastest of ``candidates`` on ``weights`` (one of each distinct linear shape) at
    torch's current thread count, packed for ``pack_threads`` (the most a call may use), from
    the host's cache when measured before, else measured now and cached. ``prefer``, where it
    is a candidate, is kept unless another is much faster (see _PREFERRED_MARGIN)."""
    margin = _MARGIN
    if prefer in candidates:
        candidates = [prefer] + [c for c in candidates if c != prefer]
        margin = _PREFERRED_MARGIN
    key = _cache_key(weights, candidates, pack_threads, margin)
    folder = cache_dir() / "linear-choice"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{key}.lock", "w")
    except OSError as e:  # a read-only home, say: measure, just not once for the host
        logger.warning("no linear-choice cache in %s (%s): measuring in this process", folder, e)
        return _measure(weights, candidates, pack_threads, margin)
    path = folder / f"{key}.json"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others read its answer
        cached = _read(path)
        if cached is not None:
            return cached
        choice = _measure(weights, candidates, pack_threads, margin)
        try:
            _write(path, choice)
        except OSError as e:
            logger.warning("could not cache the linear-layer choice in %s: %s", path, e)
    logger.info("linear layers: %s GEMM%s (timed: %s)", choice.kernel,
                ", few-rows kernel at low batch" if choice.few_rows_kernel else "",
                ", ".join(f"{k} {v:.2f} ms" for k, v in choice.timings_ms.items()))
    return choice


def _measure(weights: list[torch.Tensor], candidates: list[str],
             pack_threads: int | None = None, margin: float = _MARGIN) -> LinearChoice:
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows = [max(_FEW_ROWS, min(r, int(_FLOP_BUDGET // flops_per_row))) for r in _ROWS]
    g = torch.Generator().manual_seed(0)
    inputs = {r: {w.shape[1]: torch.randn(r, w.shape[1], generator=g, dtype=w.dtype)
                  for w in weights} for r in (*rows, _FEW_ROWS)}
    timings: dict[str, float] = {}
    scores: dict[str, float] = {}
    packs = {}
    for kernel in candidates:
        packed = [pack_linear(w, kernel, pack_threads) for w in weights]
        if any(p is None for p in packed):
            continue  # this CPU's library refuses the dtype
        packs[kernel] = packed
        for r in rows:
            timings[f"{kernel}@{r}"] = _time(lambda x: [p(x[p.in_features]) for p in packed],
                                             inputs[r])
    if not packs:
        raise ValueError(f"none of the packed GEMMs {candidates} can run {weights[0].dtype}")
    first = next(iter(packs))
    for kernel in packs:  # relative to the first, so each row count weighs the same
        scores[kernel] = sum(timings[f"{kernel}@{r}"] / timings[f"{first}@{r}"] for r in rows)
    best = min(scores, key=scores.get)
    if scores[best] > margin * scores[first]:
        best = first
    few = False
    if small_linear_usable(weights[0]):
        packed = packs[best]
        timings[f"{best}@{_FEW_ROWS}"] = _time(
            lambda x: [p(x[p.in_features]) for p in packed], inputs[_FEW_ROWS])
        timings[f"few-rows@{_FEW_ROWS}"] = _time(
            lambda x: [small_linear(x[w.shape[1]], w) for w in weights], inputs[_FEW_ROWS])
        few = timings[f"few-rows@{_FEW_ROWS}"] < _MARGIN * timings[f"{best}@{_FEW_ROWS}"]
    return LinearChoice(best, few, timings)


def _time(fn, x) -> float:
    """Best of ``_REPEATS`` after a warm-up, in ms."""
    fn(x)
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _cache_key(weights: list[torch.Tensor], candidates: list[str],
               pack_threads: int | None, margin: float) -> str:
    parts = [f"margin {margin:.4f}", cpu_identity().decode(errors="replace"),
             torch.__version__, str(weights[0].dtype),
             repr([tuple(w.shape) for w in weights]), repr(candidates),
             str(torch.get_num_threads()), str(pack_threads),
             str(enable_mkl_cpu_dispatch().applied),
             os.environ.get("PDSERVE_SMALL_LINEAR", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _read(path: Path) -> LinearChoice | None:
    try:
        d = json.loads(path.read_text())
        return LinearChoice(str(d["kernel"]), bool(d["few_rows_kernel"]),
                            {str(k): float(v) for k, v in d["timings_ms"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: measure again


def _write(path: Path, choice: LinearChoice) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(choice), f)
        os.replace(tmp, path)
    except BaseException:
        # A full disk must not leave one more temp file at every start.
        os.unlink(tmp)
        raise
