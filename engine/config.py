"""The engine's configuration: one dataclass, validated when built."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ROLES = ("combined", "prefill", "decode")
_KV_TRANSFER_BACKENDS = ("nixl", "torch")
_LINEAR_BACKENDS = ("auto", "onednn", "mkl", "torch")
# kernels.BACKENDS, here without importing torch (tests check they agree).
_ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# The devices the engine runs on; torch.device accepts more ("meta", "xpu") that fail later.
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
# torch.manual_seed's range (a negative seed wraps to its unsigned 64-bit value).
_SEED_MIN, _SEED_END = -(1 << 63), 1 << 64
# Tokens one engine step may schedule, where the config does not say.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The KV cache's memory budget on the CPU, where the config sets none.
DEFAULT_CPU_KV_CACHE_GIB = 1.0
GIB = 1 << 30


SCHEDULING_POLICIES = ("fcfs", "priority")


# Leases outlive their worker's reads only by mistake; the lease's Redis records expire with
# it, and Redis refuses expiries past 2**63 ms (the batch holding one failed whole).
MAX_KV_LEASE_TIMEOUT_S = 86400.0
# A day: longer idle-ping settings are no liveness check, and the waits must not overflow.
_MAX_PING_S = 86400.0


@dataclass
class EngineConfig:
    # A local Hugging Face folder or a built-in preset name (see engine.presets).
    model: str
    # A local folder holding the tokenizer's files, when not the model's (vLLM's --tokenizer;
    # engine/tokenizer_choice.py). None: the model folder's.
    tokenizer: str | None = None
    # Compute dtype; "auto" is float32 on CPU and the checkpoint's dtype on CUDA.
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # KV-cache budget; None sizes it from gpu_memory_utilization on CUDA, 1 GiB on CPU.
    kv_cache_memory_gib: float | None = None
    # Overrides the budget with an exact block count (tests use tiny caches).
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # "fcfs": waiting requests in arrival order; "priority": by SamplingParams.priority (lower
    # first), then arrival, and the lowest-priority running request is the one preempted.
    scheduling_policy: str = "fcfs"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # With prefix caching: a prompt that agrees with a cached block for only part of it copies
    # those positions' K/V instead of recomputing them (engine/kv_cache_manager.py).
    enable_partial_block_hits: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    # GEMMs of the linear layers: "auto" packs weights on the CPU for oneDNN or oneMKL, whichever
    # runs this model faster here (engine/linear_tuning.py); "onednn" or "mkl" insist on one,
    # "torch" is F.linear.
    linear_backend: str = "auto"
    # CPU: the most threads a step may use, when more than torch's thread count at load (a
    # worker that borrows idle cores, engine/core_share.py). oneMKL lays packed weights out for
    # a thread count: a pack made for one thread never runs on two. None: torch's count.
    max_cpu_threads: int | None = None
    seed: int = 0
    # combined: prefill and decode here; prefill: stop after the first token and lease the
    # blocks to a remote reader; decode: admit requests whose prompt KV arrives from outside.
    role: str = "combined"
    # A prefill lease not released by then is reclaimed (at most MAX_KV_LEASE_TIMEOUT_S).
    kv_lease_timeout_s: float = 60.0
    # Turn incremental detokenization off when only token ids are wanted (benchmarks).
    detokenize: bool = True
    # Ranks the model is split over; ranks 1.. run in worker processes (gloo on CPU, NCCL on GPU).
    tensor_parallel_size: int = 1
    # A TP worker that does not answer start-up within this many seconds fails the engine.
    tp_startup_timeout_s: float = 600.0
    # While no step runs, rank 0 pings every TP worker this often (0: never): a rank that is
    # stopped or wedged (not dead: a dead one is seen at once) would otherwise be found only
    # by the next request's step timeout, minutes later, the worker reporting SERVING meanwhile.
    tp_idle_ping_interval_s: float = 5.0
    # An idle worker that has not answered a ping within this fails the engine, as a dead
    # rank does. An idle rank answers in well under a millisecond; this only has to outlast
    # a descheduled or swapping process. Steps are never pinged, so a long one cannot trip it.
    tp_idle_ping_timeout_s: float = 10.0
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # CUDA graphs cover decode steps whose sequences all fit this many tokens (longer ones, and
    # batches over min(max_num_seqs, 512), run eagerly).
    max_seq_len_to_capture: int = 8192
    # How this engine's KV blocks move to or from another engine: "nixl", "torch" or None (no
    # transfer agent; combined serving and offline use).
    kv_transfer_backend: str | None = None
    # NIXL: threads (each a second core while it copies) that a pull of 8 MB or more is split
    # over; None: $PDSERVE_NIXL_PULL_STREAMS, else 1.
    kv_pull_streams: int | None = None
    # A KV transfer that has not completed by then fails (its blocks are freed).
    kv_transfer_timeout_s: float = 30.0
    # After a failed pull whose READ could not be proven cancelled, its destination blocks
    # stay out of use this long, so a late write cannot corrupt another request's KV.
    kv_quarantine_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path or preset name")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str)
                                           or not self.tokenizer):
            raise ValueError("tokenizer (--tokenizer) must be a non-empty folder path or None")
        for name in ("enable_prefix_caching", "enable_partial_block_hits",
                     "enable_chunked_prefill", "detokenize", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):  # "false" would read as on
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not _is_int(self.seed) or not _SEED_MIN <= self.seed < _SEED_END:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.max_cpu_threads is not None:
            _positive_int("max_cpu_threads", self.max_cpu_threads)
        if self.attention_backend not in _ATTENTION_BACKENDS:
            # None got as far as every request's first step (an AttributeError there).
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.linear_backend not in _LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {_LINEAR_BACKENDS}, "
                             f"got {self.linear_backend!r}")
        if self.role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {self.role!r}")
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        positive_number("tp_startup_timeout_s", self.tp_startup_timeout_s)
        _finite_number("tp_idle_ping_interval_s", self.tp_idle_ping_interval_s)
        if not 0 <= self.tp_idle_ping_interval_s <= _MAX_PING_S:
            raise ValueError(f"tp_idle_ping_interval_s must be seconds in [0, {_MAX_PING_S:g}] "
                             f"(0: no pings), got {self.tp_idle_ping_interval_s}")
        positive_number("tp_idle_ping_timeout_s", self.tp_idle_ping_timeout_s)
        if self.tp_idle_ping_timeout_s > _MAX_PING_S:
            raise ValueError(f"tp_idle_ping_timeout_s must be at most {_MAX_PING_S:g}, "
                             f"got {self.tp_idle_ping_timeout_s}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_seq_len_to_capture", self.max_seq_len_to_capture)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:  # here, before any weight loads
                raise ValueError(f"max_model_len {self.max_model_len} holds no prompt and an "
                                 "output token: at least 2")
        if self.num_gpu_blocks is not None:
            _positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory_gib is not None:
            positive_number("kv_cache_memory_gib", self.kv_cache_memory_gib)
            if self.num_gpu_blocks is not None:  # the budget was silently ignored
                raise ValueError(
                    f"num_gpu_blocks (--num-gpu-blocks) {self.num_gpu_blocks} sets the KV "
                    "cache's size exactly, kv_cache_memory_gib (--kv-cache-memory-gib) "
                    f"{self.kv_cache_memory_gib:g} sizes it from a budget: give one of them")
        _finite_number("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_transfer_backend is not None \
                and self.kv_transfer_backend not in _KV_TRANSFER_BACKENDS:
            raise ValueError(f"kv_transfer_backend must be one of {_KV_TRANSFER_BACKENDS} or None, "
                             f"got {self.kv_transfer_backend!r}")
        if self.kv_pull_streams is not None:
            _positive_int("kv_pull_streams", self.kv_pull_streams)
        positive_number("kv_transfer_timeout_s", self.kv_transfer_timeout_s)
        _finite_number("kv_quarantine_s", self.kv_quarantine_s)
        if not self.kv_quarantine_s >= 0:
            raise ValueError(f"kv_quarantine_s must be >= 0, got {self.kv_quarantine_s}")
        positive_number("kv_lease_timeout_s", self.kv_lease_timeout_s)
        if self.kv_lease_timeout_s > MAX_KV_LEASE_TIMEOUT_S:
            raise ValueError(f"kv_lease_timeout_s must be at most {MAX_KV_LEASE_TIMEOUT_S:.0f} "
                             f"(a day), got {self.kv_lease_timeout_s}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")

    def check_max_model_len(self, max_position_embeddings: int,
                            num_blocks: int | None = None) -> None:
        """Refuses a max_model_len the model's positions, or a KV cache of ``num_blocks`` (where
        known), cannot hold. Torch-free: `pdserve up` checks it before anything starts."""
        if self.max_model_len is None:
            return
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len (--max-model-len) {self.max_model_len} exceeds the "
                             f"model's max_position_embeddings {max_position_embeddings}")
        if num_blocks is not None and self.max_model_len > num_blocks * self.block_size:
            raise ValueError(f"max_model_len (--max-model-len) {self.max_model_len} does not "
                             f"fit the KV cache ({num_blocks} blocks of {self.block_size} tokens "
                             f"= {num_blocks * self.block_size}; --num-gpu-blocks, "
                             "--kv-cache-memory-gib, --block-size)")

    def kv_budget_bytes(self, on_cpu: bool) -> float | None:
        """The KV cache's memory budget where this config fixes it: --kv-cache-memory-gib, or
        the CPU's default. None where --num-gpu-blocks sets the blocks, or on CUDA, where the
        budget is what --gpu-memory-utilization leaves beside the weights once they loaded."""
        if self.num_gpu_blocks is not None:
            return None
        if self.kv_cache_memory_gib is not None:
            return self.kv_cache_memory_gib * GIB
        return DEFAULT_CPU_KV_CACHE_GIB * GIB if on_cpu else None

    def check_kv_budget(self, bytes_per_block: int, on_cpu: bool) -> None:
        """Refuses a memory budget (kv_budget_bytes) whose blocks of ``bytes_per_block`` (the
        largest rank's) cannot hold one max_model_len sequence. Torch-free: `pdserve up` checks
        it before anything starts; a worker found it only as it sized its cache."""
        budget = self.kv_budget_bytes(on_cpu)
        if self.max_model_len is None or budget is None:
            return
        blocks = -(-self.max_model_len // self.block_size)
        need = blocks * bytes_per_block
        if budget >= need:
            return
        if self.kv_cache_memory_gib is not None:
            given = f"--kv-cache-memory-gib {self.kv_cache_memory_gib:g}"
        else:
            given = f"the CPU's default KV-cache budget of {DEFAULT_CPU_KV_CACHE_GIB:g} GiB"
        least = math.ceil(need / GIB * 1000) / 1000  # rounded up: the figure given must fit
        raise ValueError(
            f"max_model_len (--max-model-len) {self.max_model_len} does not fit {given}: one "
            f"sequence takes {format_bytes(need)} per rank ({blocks} blocks of {self.block_size} "
            f"tokens, {format_bytes(bytes_per_block)} each); set --kv-cache-memory-gib {least:.3f} or "
            "more, or lower --max-model-len")


def format_bytes(nbytes: float) -> str:
    """A size for a message: in GiB, MiB or KiB, whichever keeps it at 1 or more."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not a count


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _finite_number(name: str, value) -> None:
    # A string or None would fail the range checks with a TypeError; inf passes them and turns
    # into NaN block counts or overflowing waits later; bool is no size or duration.
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def positive_number(name: str, value) -> None:
    _finite_number(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
