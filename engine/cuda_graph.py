"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU spends most of its time launching kernels; a graph
launches the whole forward at once. Graphs need static shapes and addresses, so every input
lives in a static buffer sized for the largest bucket, a step's batch is padded up to the
nearest bucket, and the attention backend must not read host-side metadata that changes per
step (``AttentionBackend.supports_cuda_graphs``). Padded rows write no KV (slot -1) and attend
to one token of block 0, so they cannot touch any sequence's cache; their outputs are dropped.

Only pure-decode steps qualify (one new token per sequence); prefill chunks run eagerly.
``capture=False`` runs the very same padded, static-buffer path without capturing: the
CPU tests check the padding and bucketing with it, the GPU tests check capture on top.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.attention_backend import AttentionMetadata
from kernels.input_checks import check_index_bounds, index_bounds, index_checks_affordable

logger = logging.getLogger(__name__)

# Buckets grow in steps of 8 past the first few powers of two (a batch pads by < 8 rows).
_SMALL_BUCKETS = (1, 2, 4)
_BUCKET_STEP = 8


@dataclass(frozen=True)
class CUDAGraphConfig:
    """What the decode graphs are captured for (derived from EngineConfig by setup)."""

    max_batch_size: int  # the largest bucket
    max_num_blocks_per_seq: int  # width of the static block table
    block_size: int
    # The KV cache's blocks, to bound a replayed step's indices (None: not checked).
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_blocks_per_seq", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")

    @property
    def batch_sizes(self) -> list[int]:
        sizes = [b for b in _SMALL_BUCKETS if b < self.max_batch_size]
        sizes += range(_BUCKET_STEP, self.max_batch_size, _BUCKET_STEP)
        return sorted(set(sizes) | {self.max_batch_size})


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_num_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: 0..max_bs, one query per sequence


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, cfg: CUDAGraphConfig, device: torch.device,
                 capture: bool = True) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.cfg = cfg
        self.device = device
        self.capture = capture
        n, w = cfg.max_batch_size, cfg.max_num_blocks_per_seq
        self.buf = _StaticInputs(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, w, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device))
        self.metas = {bs: self._bucket_meta(bs) for bs in cfg.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> [bs, hidden] static output
        self.num_replays = 0
        if capture:
            self._capture_all()

    # --- which steps qualify ------------------------------------------------------------------
    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The bucket a step pads to, or None when it must run eagerly."""
        n = meta.num_seqs
        if (n == 0 or meta.num_decodes != n or meta.num_tokens != n
                or n > self.cfg.max_batch_size or meta.block_size != self.cfg.block_size
                or meta.block_tables.shape[1] > self.cfg.max_num_blocks_per_seq):
            return None
        return next(b for b in self.cfg.batch_sizes if b >= n)

    # --- running ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            bucket: int) -> torch.Tensor:
        """[n, hidden] hidden states of a decode step (``bucket`` from ``bucket_for``)."""
        n = meta.num_seqs
        if self.cfg.num_blocks is not None and index_checks_affordable(meta):
            # A replay runs no Python, so not the attention backend's own checks either: an
            # index past the cache would be written there (kernels/input_checks.py).
            check_index_bounds(index_bounds(meta.slot_mapping, meta.block_tables),
                               self.cfg.num_blocks, self.cfg.block_size)
        self._fill(input_ids, positions, meta)
        if self.capture:
            self.graphs[bucket].replay()
            out = self.outputs[bucket]
        else:
            out = self._forward(bucket, seq_lens_list=meta.seq_lens_list)
        self.num_replays += 1
        return out[:n]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> None:
        b, n = self.buf, meta.num_seqs
        width = meta.block_tables.shape[1]
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        b.seq_lens[:n].copy_(meta.seq_lens)
        b.block_tables[:n, :width].copy_(meta.block_tables)
        b.block_tables[:n, width:].zero_()
        self._pad_from(n)

    def _forward(self, bucket: int, seq_lens_list: list[int] | None = None) -> torch.Tensor:
        meta = self.metas[bucket]
        if seq_lens_list is not None:
            # Host-side mirror for backends that read it (the torch one; never under capture).
            meta = _with_host_lens(meta, seq_lens_list, bucket)
        return self.model(self.buf.input_ids[:bucket], self.buf.positions[:bucket], meta)

    # --- capture ------------------------------------------------------------------------------
    def _bucket_meta(self, bs: int) -> AttentionMetadata:
        b = self.buf
        max_len = self.cfg.max_num_blocks_per_seq * self.cfg.block_size
        # Host fields hold the static upper bounds: a captured kernel is sized by them once.
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:bs], query_start_loc=b.query_start_loc[:bs + 1],
            seq_lens=b.seq_lens[:bs], block_tables=b.block_tables[:bs],
            query_lens_list=[1] * bs, seq_lens_list=[max_len] * bs, max_query_len=1,
            max_seq_len=max_len, block_size=self.cfg.block_size, num_decodes=bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in the memory the largest already reserved.
        for bs in reversed(self.cfg.batch_sizes):
            self._pad_from(0)  # capture runs write nothing into the cache
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and settle allocations first
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # On this runner's device: without a stream, capture takes one shared by every
            # runner, made on whichever device was current first.
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs),
                    self.cfg.batch_sizes)

    def _pad_from(self, n: int) -> None:
        # Rows from n on: no KV write, a one-token context in block 0 (finite, and discarded).
        b = self.buf
        b.input_ids[n:].zero_()
        b.positions[n:].zero_()
        b.slot_mapping[n:].fill_(-1)
        b.seq_lens[n:].fill_(1)
        b.block_tables[n:].zero_()


def _with_host_lens(meta: AttentionMetadata, seq_lens_list: list[int],
                    bucket: int) -> AttentionMetadata:
    lens = list(seq_lens_list) + [1] * (bucket - len(seq_lens_list))
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, block_tables=meta.block_tables, query_lens_list=[1] * bucket,
        seq_lens_list=lens, max_query_len=1, max_seq_len=max(lens),
        block_size=meta.block_size, num_decodes=bucket)
