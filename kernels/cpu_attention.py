"""The CPU attention backend: the torch backend with decodes run by a compiled kernel.

Decode attention is memory-bound. The torch path copies every decode's blocks into a padded
batch before SDPA reads them again; the compiled kernel (kernels/csrc/paged_decode_cpu.c)
reads each block in place, once. The K/V write is a compiled memcpy per row
(kernels/csrc/kv_write_cpu.c). Prefill chunks, and anything the kernels do not take (dtypes
other than float32), stay on the torch path.
"""
from __future__ import annotations

import torch

from kernels.attention_backend import AttentionMetadata
from kernels.cpu_decode import (check_seq_lens, cpu_kernels_available,
                                paged_decode_attention_cpu, supports)
from kernels.cpu_kv_write import kv_write_takes, write_kv_cpu
from kernels.torch_attention import TorchAttentionBackend, _StepPlan, _write_kv


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if not _kernels_take(query, k_cache, v_cache):
            # Whatever the kernels cannot read (other dtypes, a K or V cache whose head dim is
            # padded past head_size): the torch path takes any strides.
            return super().forward(query, key, value, k_cache, v_cache, meta, scale)
        plan = self._step_plan(meta, k_cache, query.dtype, gather_decodes=False)
        if _compiled_write(meta.slot_mapping) and kv_write_takes(key, value, k_cache, v_cache):
            # Slots were range-checked once for the step, in _make_plan.
            write_kv_cpu(key, value, k_cache, v_cache, meta.slot_mapping, slots_checked=True)
        else:
            _write_kv(key, value, k_cache, v_cache, plan)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        return self.attend(query, key, value, k_cache, v_cache, meta, scale, out)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, out: torch.Tensor, ranges_checked: bool = False) -> torch.Tensor:
        """``forward`` after the step's K/V are in the cache (the CPU graph writes them
        itself), into ``out`` [num_tokens, num_heads, head_size]. ``ranges_checked``: the
        caller checked the step's slots, block ids and lengths against the cache."""
        plan = self._step_plan(meta, k_cache, query.dtype, gather_decodes=False,
                               ranges_checked=ranges_checked)
        nd = meta.num_decodes
        if nd:  # decodes come first, one token each: token row i is sequence i
            paged_decode_attention_cpu(query[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                       meta.seq_lens[:nd], scale, out=out[:nd],
                                       ranges_checked=True)
        self._prefill(query, key, value, k_cache, v_cache, plan, scale, out)
        return out

    def _make_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype,
                   gather_decodes: bool, ranges_checked: bool) -> _StepPlan:
        # Once per step, not per layer: every layer reads the same tables from same-shaped caches.
        # The torch plan bounds every slot and block id; the decode kernel also needs its
        # lengths tensor within the tables' reach.
        plan = super()._make_plan(meta, k_cache, dtype, gather_decodes, ranges_checked)
        nd = meta.num_decodes
        if not (gather_decodes or ranges_checked):
            check_seq_lens(meta.block_tables[:nd], meta.seq_lens[:nd], k_cache.shape[1])
        return plan


def _kernels_take(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    # The decode kernel reads both caches with k_cache's strides.
    return (supports(query, k_cache) and v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
            and cpu_kernels_available())


def _compiled_write(slot_mapping: torch.Tensor) -> bool:
    # The model runner's slots; anything else (a hand-built metadata) takes the torch path.
    return (slot_mapping.dtype == torch.int64 and slot_mapping.device.type == "cpu"
            and slot_mapping.dim() == 1 and slot_mapping.is_contiguous())
