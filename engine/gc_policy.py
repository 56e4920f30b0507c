"""The Python garbage collector in long-running services: freeze the startup heap.

A loaded worker holds ~340k container objects (the model's modules, the tokenizer, torch's and
gRPC's own), all alive for the life of the process. A full collection walks all of them: 126
ms on the 2-core VM, with the GIL held, so a token stream stalls for that long if one lands
mid-stream. Python starts one once the objects that survived younger collections reach a
quarter of the long-lived ones (~85k here): a two-minute ``pdserve bench serve`` never got
there (each service ran three full collections while loading and one at exit, 75-290 ms each),
but a service that runs for days and keeps growing state (prefix-cache bookkeeping, stats,
connections) does.

Once startup is over, one collection and ``gc.freeze()`` move every live object to the
permanent generation, which collections skip: later full collections walk only what serving
created since. Frozen objects are still freed by reference counting; only a cycle among them
stays until exit. At exit the heap is unfrozen, so extension modules that check for leaked
objects at interpreter shutdown (nanobind) find theirs collected as usual.
"""
from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_startup_heap() -> int:
    """Collects, then freezes every object alive now; returns how many are frozen in all."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    return gc.get_freeze_count()
