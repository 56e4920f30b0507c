"""Which GPUs each worker of a local cluster (``pdserve up``) runs on, and how much of each.

A worker process sees only its own GPUs (``CUDA_VISIBLE_DEVICES``), so every worker can say
``cuda`` and its TP ranks ``cuda:0..tp-1``. Where the GPUs suffice, every worker has its own:
prefill workers first (``tp`` consecutive GPUs each), then decode workers. Where they do not,
workers share GPUs round-robin, and each worker's ``--gpu-memory-utilization`` is the
cluster's divided by the number of workers on its busiest GPU: the engine sizes its KV cache
from its own share of the device (engine/setup.py), so two workers at 0.45 fill what one at
0.9 would, whichever starts first. A worker added to the running cluster gets what the workers
already on its GPUs leave of the cluster's utilization, as theirs stay as they are.

NCCL refuses two ranks of one group on one GPU, so the torch KV-transfer backend (an NCCL pair
group per prefill/decode pair on CUDA) cannot serve a prefill and a decode worker on one GPU;
NIXL (UCX's CUDA IPC) can. That is refused here, before anything starts.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The least share of a GPU a worker added to the running cluster is given: less is no room for
# a model's weights and a cache (4 GiB of an 80 GiB GPU), or only rounding the others left.
MIN_ADDED_SHARE = 0.05


@dataclass(frozen=True)
class WorkerGpus:
    role: str  # "prefill" or "decode"
    gpus: tuple[str, ...]  # entries of the launcher's CUDA_VISIBLE_DEVICES (ids or UUIDs)
    gpu_memory_utilization: float
    shared: bool  # another worker of the plan uses one of these GPUs

    @property
    def visible_devices(self) -> str:
        return ",".join(self.gpus)

    def describe(self) -> str:
        share = f", {self.gpu_memory_utilization:.2f} of its memory" if self.shared else ""
        return f"{self.role} on GPU {self.visible_devices}{share}"


@dataclass
class GpuPlan:
    workers: list[WorkerGpus]
    gpus: tuple[str, ...]
    kv_transfer_backend: str = "nixl"
    # Whether workers get their memory share as --gpu-memory-utilization (False: the
    # launcher's caller set that flag for every worker itself).
    split_memory: bool = True

    @property
    def shared(self) -> bool:
        return any(w.shared for w in self.workers)

    def next_for(self, role: str, tp: int, utilization: float) -> WorkerGpus:
        """GPUs for a worker added to the running cluster: those with the most of
        ``utilization`` left (then the fewest workers). Its share is what is left: the workers
        there keep theirs, and each engine takes its share of the whole device
        (engine/setup.py), so a split as in ``plan_gpus`` would put the GPU's shares past
        ``utilization`` and leave the newcomer too little free memory to start. ValueError
        where that is under ``MIN_ADDED_SHARE``, unless the workers' own flag sets their
        memory (``split_memory`` False: the launcher hands out no share)."""
        if tp > len(self.gpus):
            raise ValueError(f"a worker of -tp {tp} needs {tp} GPUs; {len(self.gpus)} visible")
        load = _load(self.workers, self.gpus)
        left = {g: utilization - sum(w.gpu_memory_utilization for w in self.workers
                                     if g in w.gpus) for g in self.gpus}
        order = sorted(self.gpus, key=lambda g: (-left[g], load[g], self.gpus.index(g)))
        chosen = tuple(sorted(order[:tp], key=self.gpus.index))
        other = "decode" if role == "prefill" else "prefill"
        if self.kv_transfer_backend == "torch" and any(
                w.role == other and set(w.gpus) & set(chosen) for w in self.workers):
            raise ValueError(f"a new {role} worker would share GPU {','.join(chosen)} with a "
                             f"{other} worker, which --kv-transfer-backend torch (NCCL) "
                             "cannot pair on one GPU")
        fullest = min(chosen, key=lambda g: left[g])
        share = max(left[fullest], 0.0)
        if self.split_memory and share < MIN_ADDED_SHARE:
            raise ValueError(
                f"a new {role} worker would get {share:.2f} of GPU {fullest}'s memory: its "
                f"workers hold {utilization - left[fullest]:.2f} of it, of the cluster's "
                f"--gpu-memory-utilization {utilization}; stop one of them first")
        worker = WorkerGpus(role, chosen, share, any(load[g] for g in chosen))
        self.workers.append(worker)
        return worker


def visible_gpus(count: int, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The GPUs this launcher may hand out: its own CUDA_VISIBLE_DEVICES entries where set
    (ids or UUIDs, passed on as written), else ``0..count-1``."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return tuple(str(i) for i in range(count))
    return tuple(e.strip() for e in listed.split(",") if e.strip())[:count]


def plan_gpus(num_prefill: int, prefill_tp: int, num_decode: int, gpus: tuple[str, ...],
              utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
              kv_transfer_backend: str = "nixl") -> GpuPlan:
    """Every worker's GPUs and memory share; ValueError where the GPUs cannot hold the plan."""
    if not gpus:
        raise ValueError("no GPU to place the workers on")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if prefill_tp > len(gpus):
        raise ValueError(f"-tp {prefill_tp} needs {prefill_tp} GPUs per prefill worker; "
                         f"{len(gpus)} visible ({','.join(gpus)})")
    wants = [("prefill", prefill_tp)] * num_prefill + [("decode", 1)] * num_decode
    cursor, slots = 0, []
    for role, n in wants:
        # A TP worker's GPUs must be distinct: wrap the cursor instead of splitting a worker
        # over the end of the list and the start.
        if cursor % len(gpus) + n > len(gpus):
            cursor += len(gpus) - cursor % len(gpus)
        slots.append((role, tuple(gpus[(cursor + k) % len(gpus)] for k in range(n))))
        cursor += n
    load = Counter(g for _, chosen in slots for g in chosen)
    workers = []
    for role, chosen in slots:
        busiest = max(load[g] for g in chosen)
        workers.append(WorkerGpus(role, chosen, utilization / busiest, busiest > 1))
    mixed = sorted({g for g in gpus if {"prefill", "decode"} <= {r for r, c in slots if g in c}},
                   key=gpus.index)
    if mixed and kv_transfer_backend == "torch":
        raise ValueError(
            f"{num_prefill} prefill (x{prefill_tp} GPUs) and {num_decode} decode workers on "
            f"{len(gpus)} GPU(s) put a prefill and a decode worker on GPU {','.join(mixed)}, "
            "and --kv-transfer-backend torch pairs them over NCCL, which cannot put both ranks "
            "of a pair on one GPU: use the nixl backend, or give them GPUs of their own")
    return GpuPlan(workers, tuple(gpus), kv_transfer_backend)


def _load(workers: list[WorkerGpus], gpus: tuple[str, ...]) -> Counter:
    load = Counter(dict.fromkeys(gpus, 0))
    load.update(g for w in workers for g in w.gpus)
    return load
