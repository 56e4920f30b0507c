"""vLLM flags whose pdserve counterparts take another unit: refused with what to type instead.
Without them argparse read vLLM's --kv-cache-memory (bytes; vLLM's own start-up log suggests
`--kv-cache-memory=N`) as an abbreviation of --kv-cache-memory-gib, its bytes as GiB."""
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


def add_refused_vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", action=_RefuseKvCacheBytes,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
