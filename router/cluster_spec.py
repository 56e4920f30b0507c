"""What ``pdserve up`` starts, as one validated dataclass (``ClusterSpec``), and the flag
reading that decides each worker's defaults: its threads, its prefill step budget, its GPUs.
``Cluster`` (router/launcher.py) starts the processes a spec describes.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, field

from client.channels import check_api_key
from engine.cpus import usable_cpus
from router.gpu_placement import DEFAULT_GPU_MEMORY_UTILIZATION, GpuPlan, plan_gpus, visible_gpus

# Requests in flight a stopping service waits for (--drain-timeout-s of every service).
DRAIN_TIMEOUT_S = 10.0

_SPINCOUNT = "20000"
# A prefill worker's step budget (--max-num-batched-tokens) where the workers share one host's
# CPU cores, unless the worker flags set one. A 2048-token prefill step on such a host runs for
# ~0.5-1 s, its working set spills the shared L3, and it gives borrowed cores back only between
# decoder layers (~60-120 ms apart): the co-located decode worker's steps slow down meanwhile.
# Measured on 2 cores (docs/benchmarks.md, session 12): 512 against 2048, four runs each,
# decode TPOT at concurrency 32 -20% (27-30 -> 21-23 ms), concurrency 8 throughput +6%.
_SHARED_CPU_PREFILL_BUDGET = 512


@dataclass
class ClusterSpec:
    model: str = "tiny-llama"
    # 0: aggregated (see above)
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    redis_url: str | None = None
    router_port: int = 0
    namespace: str = "pdserve"
    kv_transfer_backend: str = "nixl"
    # Extra engine flags for every worker, e.g. ["--num-gpu-blocks", "256"].
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    # The router's API keys (router --api-key/--admin-api-key; None: its environment's). They
    # reach it through its environment, which only its user may read, never its command
    # line, which any local user sees in ps.
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    start_timeout_s: float = 180.0
    # Passed to every service as --drain-timeout-s: see STOP_GRACE_S.
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    # CPU threads per worker rank (OMP_NUM_THREADS); None shares this host's cores out among
    # the ranks the spec starts, since every worker busy on all cores at once oversubscribes
    # them. An OMP_NUM_THREADS already in the environment wins.
    threads_per_rank: int | None = None
    # Workers share this host's cores (engine/core_share.py): one busy while the others idle
    # takes every core. Only where this spec shares the cores out itself (no OMP_NUM_THREADS
    # in the environment, no threads_per_rank) and every worker is one process (TP=1).
    share_cores: bool = True
    # Workers on CUDA: the GPUs to spread them over (CUDA_VISIBLE_DEVICES entries; None: the
    # launcher's own visible GPUs), and each GPU's memory share for the workers on it,
    # divided among them where they share it (router/gpu_placement.py). None: 0.9, or the
    # --gpu-memory-utilization of worker_args, which then applies to each worker as given.
    gpus: tuple[str, ...] | None = None
    gpu_memory_utilization: float | None = None
    # Workers step their engine in a process of their own (the workers' --engine-process).
    # None: those the launcher places on GPUs do, where TP is 1. There the step is mostly
    # Python that would wait on the worker's gRPC loop for the GIL, and the host has idle
    # cores (an H100, tiny-llama: 1.17-1.18x the cluster's output tokens/s, docs/benchmarks.md);
    # on CPUs both would compete for the cores the model uses. Not yet run on GPUs with TP.
    engine_process: bool | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a cluster needs at least one decode worker and 0 or more prefill "
                             f"workers (0: aggregated), got {self.num_prefill} prefill and "
                             f"{self.num_decode} decode")
        if isinstance(self.prefill_tp, bool) or not isinstance(self.prefill_tp, int) \
                or self.prefill_tp < 1:
            raise ValueError(f"-tp must be a positive integer, got {self.prefill_tp!r}")
        if self.aggregated and self.prefill_tp > 1:
            raise ValueError(f"-tp {self.prefill_tp} sets the prefill workers' tensor-parallel "
                             "size, and an aggregated cluster (no prefill worker) has none")
        limit = flag_value(self.router_args, "--max-local-prefill-length")
        if self.aggregated and limit is not None and limit.isdigit() and int(limit) == 0:
            raise ValueError("with no prefill worker the decode workers prefill every prompt: "
                             "--max-local-prefill-length 0 would leave nothing to serve it")
        check_api_key(self.api_key)
        check_api_key(self.admin_api_key)
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")

    @property
    def aggregated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_ranks(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode

    @property
    def cores_shared(self) -> bool:
        # A lone worker has every core already: there is nobody to borrow from. Workers on GPUs
        # compute there: borrowing cores would buy them nothing and cost every step its
        # bookkeeping (and every eager layer its check whether to give cores back).
        return (self.share_cores and self.prefill_tp == 1 and self.threads_per_rank is None
                and "OMP_NUM_THREADS" not in os.environ and self.num_ranks > 1
                and on_cpu(self.worker_args))

    def router_flags(self) -> list[str]:
        """The router's flags: the spec's, and for an aggregated cluster a local-prefill limit
        of the model's whole context unless one was given."""
        args = list(self.router_args)
        if self.aggregated and flag_value(args, "--max-local-prefill-length") is None:
            args += ["--max-local-prefill-length", str(_max_position(self.model))]
        return args

    def router_env(self) -> dict[str, str]:
        """The router's environment: this process's, with the spec's API keys."""
        env = dict(os.environ)
        for name, key in (("PDSERVE_API_KEY", self.api_key),
                          ("PDSERVE_ADMIN_API_KEY", self.admin_api_key)):
            if key is not None:
                env[name] = key
        return env

    def admin_key(self) -> str | None:
        """The key the router's admin service takes: its admin key, else its API key, from
        its flags, the spec or the environment it inherits (router/auth.py)."""
        flags = self.router_args
        env = self.router_env()
        return (flag_value(flags, "--admin-api-key") or env.get("PDSERVE_ADMIN_API_KEY")
                or flag_value(flags, "--api-key") or env.get("PDSERVE_API_KEY") or None)

    def engine_args(self, role: str, extra: list[str]) -> list[str]:
        """A worker's engine flags: the spec's, then ``extra``, then the defaults that depend on
        where the workers run (a flag already given wins)."""
        args = [*self.worker_args, *extra]
        if role == "prefill" and self.prefill_tp > 1:
            args += ["--tensor-parallel-size", str(self.prefill_tp)]
        # Only workers that join the core share (one process each; TP ranks keep their own
        # threads), and only with chunked prefill: without it the budget caps the prompt length.
        if (role == "prefill" and self.cores_shared and tp_size(args) == 1 and on_cpu(args)
                and flag_value(args, "--max-num-batched-tokens") is None
                and _chunked_prefill(args)):
            args += ["--max-num-batched-tokens", str(_SHARED_CPU_PREFILL_BUDGET)]
        return args

    def gpu_plan(self) -> GpuPlan | None:
        """Where the workers go on this host's GPUs; None where they compute on the CPU or
        their flags pin a device (``--device cuda:N``): then the flags say it all."""
        device = flag_value(self.worker_args, "--device") or "auto"
        if device not in ("auto", "cuda") or on_cpu(self.worker_args):
            return None
        if flag_value(self.worker_args, "--gpu-memory-utilization") is not None:
            util = None  # the worker flag, as given, for every worker
        else:
            util = self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        gpus = self.gpus
        if gpus is None:
            gpus = visible_gpus(cuda_device_count())
        plan = plan_gpus(self.num_prefill, self.prefill_tp, self.num_decode, gpus,
                         util or DEFAULT_GPU_MEMORY_UTILIZATION, self.kv_transfer_backend)
        plan.split_memory = util is not None
        return plan

    def step_budget(self, role: str) -> int:
        """The --max-num-batched-tokens a ``role`` worker of this spec runs with."""
        value = flag_value(self.engine_args(role, []), "--max-num-batched-tokens")
        if value is None:
            from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return int(value)

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            # The CPUs this process may use (its affinity, its cgroup's quota), not the host's:
            # the workers inherit both.
            per = self.threads_per_rank or max(1, usable_cpus() // self.num_ranks)
            env["OMP_NUM_THREADS"] = str(per)
        # GNU OpenMP's idle threads spin 300k rounds (~9 ms here) before they sleep. Here the
        # cores are never a worker's alone: the router, the client's streams, each worker's
        # event loop and, with a core share, the other workers run on them too, and a spinning
        # thread keeps them off a core: a decode worker that just went idle spins on the core
        # the next prompt's prefill borrowed (shared-prefix TTFT warm/cold: median 0.21 over ten
        # runs with 300k, 0.19 with 20k, on 2 cores once the workers' teams stopped running
        # throttled, engine/openmp_threads.py). 20k rounds (~1 ms) still span the gaps between
        # one step's kernels. A setting in the environment wins.
        env.setdefault("GOMP_SPINCOUNT", _SPINCOUNT)
        return env


def flag_value(args: list[str], *names: str) -> str | None:
    """The value a service's arguments give a flag (``--flag v`` or ``--flag=v``; the last
    wins), or None."""
    found = None
    for flag, value in zip(args, [*args[1:], ""]):
        flag, eq, attached = flag.partition("=")
        if flag in names:
            found = attached if eq else value
    return found


def tp_size(args: list[str]) -> int:
    """The tensor-parallel size a service's arguments ask for."""
    value = flag_value(args, "--tensor-parallel-size", "-tp")
    return int(value) if value is not None and value.isdigit() else 1


def on_cpu(args: list[str]) -> bool:
    """Whether a worker with these arguments computes on the CPU (``--device``; "auto" takes a
    GPU where torch sees one)."""
    device = flag_value(args, "--device") or "auto"
    if device != "auto":
        return device.startswith("cpu")
    return cuda_device_count() == 0


# The device nodes through which torch.cuda reaches a GPU: NVIDIA's driver, ROCm's (torch's
# HIP build answers torch.cuda), and WSL's paravirtual GPU.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


@functools.cache
def cuda_device_count() -> int:
    """The GPUs torch sees on this host, asked of a short-lived process: the launcher runs as
    long as its cluster and computes nothing, so it does not keep torch (~250 MB) loaded.
    A process that has torch already (a test, a benchmark) asks it directly."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.device_count()
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        # No driver's device here: torch would find none. The probe's import of torch took
        # ~2.7 s of CPU from the services starting beside it on a 2-core host.
        return 0
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or not probe.stdout.strip().isdigit():
        raise RuntimeError(f"could not ask torch for this host's GPUs: "
                           f"{probe.stderr.strip()[-2000:]}")
    return int(probe.stdout.strip())


def _max_position(model: str) -> int:
    """The model's context length, from its config.json (a preset is built first)."""
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    return ModelConfig.from_pretrained(resolve_model(model)).max_position_embeddings


def _chunked_prefill(args: list[str]) -> bool:
    """Whether the engine will chunk prefill: on by default; of its two switches
    (argparse's BooleanOptionalAction) the last one given wins."""
    on = True
    for a in args:
        if a in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
            on = a == "--enable-chunked-prefill"
    return on
