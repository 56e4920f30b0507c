"""Linear layers sharded for tensor parallelism, in vLLM's vocabulary.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and sum the partial products with an all-reduce. Every
parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``, which takes the FULL
Hugging Face tensor and copies this rank's slice, so the checkpoint loader never needs to know
how a layer is sharded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_layout import kv_head_range
from engine.parallel_state import get_tp_group, get_tp_size
from kernels.cpu_linear import PackedLinear, pack_linear
from kernels.cpu_small_linear import SMALL_LINEAR_MAX_ROWS, small_linear, small_linear_usable
from kernels.huge_pages import to_huge_pages


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: object = None) -> None:
    """Copies an unsharded tensor as is (casting to the parameter's dtype and device)."""
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, packed_weight: PackedLinear | None,
                   bias: torch.Tensor | None, use_small_linear: bool) -> torch.Tensor:
    """x W^T (+ bias) by the path a layer packed for: the few-rows kernel for calls of few
    rows (low-batch decode), the packed GEMM (oneDNN's or oneMKL's), or F.linear where
    nothing was packed."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if use_small_linear and x.shape[0] <= SMALL_LINEAR_MAX_ROWS:
        return small_linear(x, weight, bias)
    return packed_weight(x, bias)


def _new_param(*shape: int, loader) -> nn.Parameter:
    # Inference only: no autograd bookkeeping. Values come from the checkpoint.
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size_per_partition, input_size_per_partition]."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        # The group is captured at build time: the model keeps talking to its own ranks.
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size, loader=self.weight_loader)
        if bias:
            self.bias = _new_param(output_size, loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

        # The weight in a packed GEMM's layout once pack() has run (CPU); None: F.linear.
        self.packed_weight: PackedLinear | None = None
        # Set by pack(): calls of few rows go to the few-rows kernel on the plain weight.
        self.use_small_linear = False

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight)

    def pack(self, kernel: str = "onednn", few_rows_kernel: bool = True,
             threads: int | None = None) -> bool:
        """Packs the loaded weight for ``kernel`` (kernels.cpu_linear.PACKED_KERNELS); False,
        changing nothing, where it cannot run the dtype. With ``few_rows_kernel`` the plain
        copy stays where the few-rows kernel can read it (float32 on the CPU): at low-batch
        decode it can beat a packed GEMM, for twice the layer's weight memory. Elsewhere it
        is freed. ``threads``: the most a call may use (kernels.cpu_linear.pack_linear)."""
        packed = pack_linear(self.weight.data, kernel, threads)
        if packed is None:
            return False
        self.packed_weight = packed
        self.use_small_linear = few_rows_kernel and small_linear_usable(self.weight.data)
        if not self.use_small_linear:
            self.weight.data = self.weight.data.new_empty(0)
        else:  # the few-rows kernel streams it whole every low-batch step
            self.weight.data = to_huge_pages(self.weight.data)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's x W^T (+ bias), no communication: [T, input] -> [T, output]."""
        return linear_forward(x, self.weight, self.packed_weight, bias, self.use_small_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        super().__init__(input_size, divide(output_size, tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        rows = param.shape[0]
        check_shape(loaded_weight, (rows * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices in one GEMM (gate_proj and up_proj).

    Each rank stores [its slice of part 0; its slice of part 1; ...] so the local output
    splits cleanly into the per-part slices.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        tp_size = get_tp_size()
        for size in self.output_sizes:
            divide(size, tp_size, "merged output size")
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            check_shape(loaded_weight, (sum(self.output_sizes), *param.shape[1:]))
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"bad shard id {shard_id!r} for {len(self.output_sizes)} parts")
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]))
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(
            loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one GEMM, split by attention head.

    Query heads are split evenly. KV heads are split too while there are at least as many as
    ranks; with fewer (MQA, or GQA at high TP) each rank holds one KV head, replicated across
    tp_size // num_kv_heads ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        group = get_tp_group()
        tp_size = group.size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        heads = kv_head_range(total_num_kv_heads, tp_size, group.rank)
        self.num_kv_heads, self.kv_head_start = heads.num, heads.start
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        hs = self.head_size
        if shard_id is None:  # an already fused checkpoint tensor
            sizes = [self.total_num_heads * hs, self.total_num_kv_heads * hs,
                     self.total_num_kv_heads * hs]
            check_shape(loaded_weight, (sum(sizes), *param.shape[1:]))
            for sid, part in zip("qkv", loaded_weight.split(sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            full, offset, size = self.total_num_heads * hs, 0, self.q_size
            src = self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            full, size = self.total_num_kv_heads * hs, self.kv_size
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            src = self.kv_head_start * hs
        else:
            raise ValueError(f"bad shard id {shard_id!r} for a qkv projection")
        check_shape(loaded_weight, (full, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, src, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed by an all-reduce.

    The input is expected already split (the output of a column-parallel layer). The bias is
    whole on every rank and added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        super().__init__(divide(input_size, tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # bias
            default_weight_loader(param, loaded_weight)
            return
        cols = param.shape[1]
        check_shape(loaded_weight, (param.shape[0], cols * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp_group.all_reduce(self.matmul(x))
        if self.bias is not None:
            y = y + self.bias
        return y
