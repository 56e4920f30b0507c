"""Executors run one forward pass on every tensor-parallel rank and hand rank 0 the logits.

The engine talks to one ``Executor``: the single-process one for TP=1, the multi-process one
(engine.tp_executor) for TP>1. Both hold rank 0's model and KV cache in the engine's process.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from engine.kv_layout import KVCacheLayout, make_layout
from engine.model_config import ModelConfig
from engine.model_runner import ModelInput, ModelRunner
from engine.parallel_state import TPGroup
from engine.setup import (RankSpec, cpu_graph_enabled, cuda_graph_config, load_rank_model,
                          rank_capacity_blocks)


class Executor(ABC):
    num_blocks: int
    runner: ModelRunner  # rank 0's
    group: TPGroup  # rank 0's view of the TP group
    kv_agent = None  # rank 0's kvtransfer agent (None without a KV transfer backend)
    _kv_handles: list = []

    @abstractmethod
    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        """Runs ``inp`` on every rank; rank 0's logits, [rows of inp.sample_indices, vocab] (None: no rows)."""

    @abstractmethod
    def kv_cache_layouts(self) -> list[KVCacheLayout]:
        """Every rank's cache layout, in rank order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers (if any); idempotent."""

    def check_health(self) -> None:
        """Raises ExecutorError once the executor can no longer run steps (a TP worker died),
        so an idle engine finds out before the next request does. One process: nothing to
        lose but itself."""

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]."""
        return self.runner.kv_cache

    def _release_device_memory(self) -> None:
        """A stopped engine on a GPU gives rank 0's memory back: torch's caching allocator
        would keep it from other processes, and a later engine in this process sizes its cache
        from what the device has free (``with LLM(...)`` in a loop). On the CPU the memory goes
        back when the engine is dropped. Called only while no step runs on the runner."""
        runner = getattr(self, "runner", None)  # None: shut down before the runner was built
        if runner is not None and runner.device.type == "cuda":
            runner.release()

    def kv_handles(self) -> list:
        """Every rank's kvtransfer handle, in rank order ([] without a KV transfer backend)."""
        return list(self._kv_handles)

    def start_worker_pulls(self, remotes: list, remote_block_ids: list[int],
                           local_block_ids: list[int], deadline: float) -> list:
        """Starts the pull on ranks 1.. (each in its process); futures of TransferStats.
        A single-process executor has no other ranks."""
        return []

    def forget_worker_peers(self, agent_names: list[str]) -> None:
        """Tells ranks 1.. to drop their connections to these remote agents (none here)."""

    @property
    def comm_seconds(self) -> float:
        """Time rank 0 spent in collectives so far."""
        return self.group.comm_seconds


class UniProcExecutor(Executor):
    """TP=1: the model runs in the engine's process, on the engine's thread."""

    def __init__(self, spec: RankSpec, model_config: ModelConfig) -> None:
        self.group = TPGroup(0, 1)
        model = load_rank_model(spec, self.group)
        self.num_blocks = rank_capacity_blocks(spec, model_config, self.group)
        layout = make_layout(model_config, self.num_blocks, spec.config.block_size,
                             spec.torch_dtype)
        self.runner = ModelRunner(model, layout, spec.torch_dtype, spec.rank_device(0),
                                  cuda_graph_config(spec, model_config, self.num_blocks),
                                  cpu_graph=cpu_graph_enabled(spec))
        self.kv_agent = make_rank_agent(spec, self.runner)
        self._kv_handles = [self.kv_agent.handle()] if self.kv_agent is not None else []
        # Held by a step: shutdown frees the runner's memory only when no step is using it.
        self._step_lock = threading.Lock()

    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        with self._step_lock:
            return self.runner.run(inp)

    def kv_cache_layouts(self) -> list[KVCacheLayout]:
        return [self.runner.layout]

    def shutdown(self) -> None:
        if self.kv_agent is not None:
            self.kv_agent.close()
            self.kv_agent = None
        if self._step_lock.acquire(blocking=False):  # else a step still runs: leave it be
            try:
                self._release_device_memory()
            finally:
                self._step_lock.release()


def make_rank_agent(spec: RankSpec, runner: ModelRunner):
    """This rank's KV transfer agent over its cache, or None when no backend is configured."""
    backend = spec.config.kv_transfer_backend
    if backend is None:
        return None
    from kvtransfer import make_agent
    if backend == "torch":
        return make_agent(backend, runner.kv_cache, runner.layout)
    # A decode engine only pulls: nobody reads from its cache.
    return make_agent(backend, runner.kv_cache, runner.layout,
                      pull_streams=spec.config.kv_pull_streams,
                      serves_reads=spec.config.role != "decode")


def make_executor(spec: RankSpec, model_config: ModelConfig) -> Executor:
    if spec.config.tensor_parallel_size == 1:
        return UniProcExecutor(spec, model_config)
    from engine.tp_executor import MultiprocExecutor
    return MultiprocExecutor(spec, model_config)
