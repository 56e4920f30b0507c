"""vLLM's engine flags that pdserve has no flag of its own for, so that a vLLM command line
runs here or says what to change: the values that already hold here are taken (an fp8 KV
cache is not, ``--kv-cache-dtype auto`` is), every other refused with what pdserve does
instead. Also vLLM's --kv-cache-memory (bytes; vLLM's own start-up log suggests
`--kv-cache-memory=N`), which argparse read as an abbreviation of --kv-cache-memory-gib, its
bytes as GiB."""
from __future__ import annotations

import argparse
import math

from engine.config import GIB


class _RefuseKvCacheBytes(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        hint = ""
        try:
            nbytes = float(values)
        except ValueError:  # vLLM also takes "40G" and such: no conversion guessed here
            nbytes = math.nan
        if math.isfinite(nbytes) and nbytes > 0:
            hint = f" ({values} bytes: --kv-cache-memory-gib {nbytes / GIB:.4g})"
        parser.error(f"{option_string} is vLLM's KV-cache budget in bytes; pdserve takes "
                     f"--kv-cache-memory-gib, in GiB{hint}")


_LOCAL_ONLY = ("pdserve loads a model from a local folder, never from the hub: give the "
               "folder of that revision's snapshot as --model")
# Flag: (the values that hold here, what pdserve does instead of the others).
_VALUED = {
    ("--kv-cache-dtype",): (("auto",), "the KV cache is kept in --dtype's type (no fp8 KV "
                                       "cache)"),
    ("--load-format",): (("auto", "safetensors"), "weights load from the folder's safetensors "
                                                  "files"),
    ("--tokenizer-mode",): (("auto", "hf"), "the tokenizer is the folder's fast one, or "
                                            "--tokenizer's"),
    ("--quantization", "-q"): ((), "weights are used unquantized, in --dtype's type"),
    ("--pipeline-parallel-size", "-pp"): (("1",), "a model is split by "
                                                  "--tensor-parallel-size only"),
    ("--distributed-executor-backend",): (("mp",), "tensor-parallel ranks are processes "
                                                   "(no Ray)"),
    ("--revision",): ((), _LOCAL_ONLY),
    ("--code-revision",): ((), _LOCAL_ONLY),
    ("--tokenizer-revision",): ((), _LOCAL_ONLY),
    ("--swap-space",): ((), "a preempted request is recomputed, never swapped out to host "
                            "memory: drop the flag"),
    ("--cpu-offload-gb",): ((), "weights stay whole on their device: drop the flag"),
}
# Flags that ask for nothing pdserve does not already do.
_SWITCHES = {
    "--trust-remote-code": "runs no code from a model folder: only its own architectures",
    "--disable-log-stats": "logs no periodic stats",
}


class _Holds(argparse.Action):
    """Takes a value that already holds here; refuses any other with what pdserve does."""

    def __init__(self, *args, holds: tuple[str, ...] = (), instead: str = "", **kw):
        super().__init__(*args, **kw)
        self.holds, self.instead = holds, instead

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in self.holds:
            took = f" (pdserve takes {', '.join(self.holds)})" if self.holds else ""
            parser.error(f"{option_string} {values}: {self.instead}{took}")


class _Taken(argparse.Action):
    """A vLLM switch whose request pdserve always meets: nothing to set."""

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def add_refused_vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", action=_RefuseKvCacheBytes,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flags, (holds, instead) in _VALUED.items():
        p.add_argument(*flags, action=_Holds, holds=holds, instead=instead,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag, why in _SWITCHES.items():
        p.add_argument(flag, action=_Taken, nargs=0, default=argparse.SUPPRESS,
                       help=f"vLLM's; taken as it is: pdserve {why}")
