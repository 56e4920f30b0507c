"""Model steps on the CPU through compiled layer code (kernels/csrc/decode_graph_cpu.c).

The CPU's stand-in for the captured CUDA graphs of engine/cuda_graph.py, with the same
``bucket_for``/``run`` face for the model runner. The Python model launches ~10 kernels per
layer; at decode batch sizes their Python side (module calls, views, allocations, launcher
checks, ctypes) is a serial 3-4 ms of a ~30 ms tiny-llama step on 2 cores, while the second
core idles. A decode-only step runs as one C call; a step with prefill rows runs each layer's
parts before and after the attention in C and the attention itself through the Python
backend (``CPUAttentionBackend.attend``: flash SDPA for the prefill rows). The same kernels
run in the same order and threads, so the hidden states equal the Python path's bit for bit;
the checks the launchers made per call are made here once per step.

It takes over only where every piece is one it reproduces: a float32 Llama-family model on
the CPU at TP=1, the compiled attention backend, and every decoder linear layer on oneMKL's
packed GEMM (the few-rows kernel where the layer kept its plain weight). Anything else, or
``enforce_eager``, leaves the Python path.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from engine.layers import LinearBase
from engine.parallel_state import get_tp_size
from kernels.attention_backend import AttentionMetadata
from kernels.cpu_attention import CPUAttentionBackend
from kernels.cpu_build import load_kernel
from kernels.cpu_decode import blocks_contiguous, check_ranges, cpu_kernels_available, supports
from kernels.cpu_kv_write import check_slots
from kernels.cpu_mkl_linear import mkl_available, mkl_compute_address

_LIB_NAME = "decode_graph_cpu"
# The packed GEMM the compiled layers call (oneMKL's cblas_sgemm_compute).
GRAPH_LINEAR_KERNEL = "mkl"
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("packed", _p), ("plain", _p), ("bias", _p), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("k_cache", _p), ("v_cache", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i32), ("hidden", _i32), ("num_heads", _i32),
                ("num_kv_heads", _i32), ("head_size", _i32), ("inter", _i32), ("eps", _f32),
                ("scale", _f32), ("cache_bs", _i64), ("block_size", _i32), ("cos_sin", _p),
                ("final_norm", _p), ("gemm", _p), ("layers", ctypes.POINTER(_Layer))]


class _StepIn(ctypes.Structure):
    _fields_ = [("num_tokens", _i32), ("positions", _p), ("slots", _p), ("block_tables", _p),
                ("table_stride", _i64), ("seq_lens", _p)]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("residual", "h", "qkv", "qn", "kn", "attn", "gate_up",
                                        "act")]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_kernel(_LIB_NAME)
    if lib is not None:
        common = [ctypes.POINTER(_Model), ctypes.POINTER(_StepIn), _p, ctypes.POINTER(_Scratch)]
        lib.decode_graph_f32.argtypes = common + [_i32, _i32, _i32]
        lib.layer_pre_attention_f32.argtypes = common + [_i32, _i32]
        lib.layer_post_attention_f32.argtypes = common + [_i32, _i32]
        for fn in (lib.decode_graph_f32, lib.layer_pre_attention_f32,
                   lib.layer_post_attention_f32):
            fn.restype = None
    return lib


class _Pins:
    """Takes tensors' addresses for the C structs and keeps every such tensor referenced, so a
    re-pack or re-bind after the graph was built cannot free memory the C code reads."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.tensors.append(t)
        return t.data_ptr()


def preferred_linear_kernel(dtype: torch.dtype, tp_size: int) -> str | None:
    """The packed GEMM a model's layers should take so the compiled step can run them (the
    loader's tuning prefers it), or None where the step never runs a model of this kind."""
    return GRAPH_LINEAR_KERNEL if dtype == torch.float32 and tp_size == 1 else None


def _linear(layer: LinearBase, pin: _Pins) -> _Linear | None:
    pw = layer.packed_weight
    if pw is None or pw.kernel != GRAPH_LINEAR_KERNEL or layer.tp_size != 1:
        return None
    bias = layer.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    plain = layer.weight.data if layer.use_small_linear else None
    if plain is not None and not plain.is_contiguous():
        return None
    return _Linear(pin(pw.data), pin(plain), pin(bias), pw.out_features, pw.in_features)


class CPUModelGraph:
    """Runs a step's decoder layers in compiled code (a decode-only step in one C call);
    ``build`` says whether it can."""

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], model_w: _Model,
                 pins: _Pins) -> None:
        self.model = model
        self._layers = (_Layer * len(layers))(*layers)  # kept alive: model_w points into it
        model_w.layers = ctypes.cast(self._layers, ctypes.POINTER(_Layer))
        self._model_w = model_w
        self.cos_sin = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
        attn0 = model.model.layers[0].self_attn.attn
        self.num_blocks, self.block_size = attn0.k_cache.shape[0], attn0.k_cache.shape[1]
        self.qk_norm = model.model.layers[0].self_attn.qk_norm
        self._pinned = pins.tensors  # every tensor whose address the structs carry
        self._scratch: dict[str, torch.Tensor] = {}
        self._capacity = 0
        self.num_replays = 0

    @classmethod
    def build(cls, model: torch.nn.Module) -> CPUModelGraph | None:
        """The graph for ``model`` (its KV cache bound), or None where some piece is not one
        the C graph reproduces."""
        inner = getattr(model, "model", None)
        if (_lib() is None or not mkl_available() or inner is None
                or not hasattr(inner, "layers") or len(inner.layers) == 0):
            return None
        first = inner.layers[0]
        param = next(model.parameters())
        if preferred_linear_kernel(param.dtype, get_tp_size()) is None or \
                param.device.type != "cpu":
            return None
        pin = _Pins()
        layers = []
        for layer in inner.layers:
            built = _layer(layer, pin)
            if built is None:
                return None
            layers.append(built)
        sa = first.self_attn
        cos_sin = sa.rotary_emb.cos_sin_cache
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            return None
        k0 = sa.attn.k_cache
        # One eps for every norm: the C graph passes one.
        norms = [inner.norm] + [n for layer in inner.layers for n in _norms(layer)]
        if len({n.eps for n in norms}) != 1:
            return None
        gemm = mkl_compute_address()
        model_w = _Model(len(layers), inner.norm.weight.shape[0], sa.num_heads, sa.num_kv_heads,
                         sa.head_dim, first.mlp.down_proj.input_size, first.input_layernorm.eps,
                         sa.attn.scale, k0.stride(0), k0.shape[1], pin(cos_sin),
                         pin(inner.norm.weight), gemm, None)
        return cls(model, layers, model_w, pin)

    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The step's token count: the graph runs every step (decode-only ones whole, others
        around the Python attention)."""
        return meta.num_tokens or None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            bucket: int) -> torch.Tensor:
        """[num_tokens, hidden] final hidden states of a step (``bucket`` from ``bucket_for``)."""
        n = bucket
        decode_only = meta.num_decodes == meta.num_seqs == n
        step = ctypes.byref(self._step_in(positions, meta, n))
        hidden = self.model.model.embed_tokens(input_ids).contiguous()  # [n, hidden]
        args = (ctypes.byref(self._model_w), step, hidden.data_ptr(),
                ctypes.byref(self._buffers(n)))
        layers = self.model.model.layers
        hooked = any(layer._forward_pre_hooks for layer in layers)
        if decode_only and not hooked:
            _lib().decode_graph_f32(*args, 0, len(layers), torch.get_num_threads())
        else:
            attn = None if decode_only else self._attention_views(n)
            for i, layer in enumerate(layers):
                # Each layer's forward pre-hooks first, as the Python model runs them (with no
                # inputs: the step's tensors live in C). The core share gives borrowed cores
                # back between layers this way; the thread count is read again per layer.
                for hook in tuple(layer._forward_pre_hooks.values()):
                    hook(layer, ())
                threads = torch.get_num_threads()
                if attn is None:
                    _lib().decode_graph_f32(*args, i, i + 1, threads)
                    continue
                _lib().layer_pre_attention_f32(*args, i, threads)
                a = layer.self_attn.attn
                a.backend.attend(*attn[:3], a.k_cache, a.v_cache, meta, a.scale, attn[3],
                                 ranges_checked=True)
                _lib().layer_post_attention_f32(*args, i, threads)
        self.num_replays += 1
        return hidden

    def _attention_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """(q, k, v, out) over the scratch rows the C layer halves leave them in."""
        m, sc = self._model_w, self._scratch
        heads, kv_heads, d = m.num_heads, m.num_kv_heads, m.head_size
        q_size, kv_size = heads * d, kv_heads * d
        qkv = sc["qkv"][:n]
        if self.qk_norm:
            q, k = sc["qn"][:n].view(n, heads, d), sc["kn"][:n].view(n, kv_heads, d)
        else:
            q = qkv[:, :q_size].view(n, heads, d)
            k = qkv[:, q_size:q_size + kv_size].view(n, kv_heads, d)
        v = qkv[:, q_size + kv_size:].view(n, kv_heads, d)
        return q, k, v, sc["attn"][:n].view(n, heads, d)

    def _step_in(self, positions: torch.Tensor, meta: AttentionMetadata, n: int) -> _StepIn:
        # What the Python path's launchers check per call, checked once for the step.
        tables, lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        for name, t, dtype, dims, rows in (("positions", positions, torch.int64, 1, n),
                                           ("slot_mapping", slots, torch.int64, 1, n),
                                           ("seq_lens", lens, torch.int32, 1, meta.num_seqs),
                                           ("block_tables", tables, torch.int32, 2,
                                            meta.num_seqs)):
            if (t.dtype != dtype or t.dim() != dims or t.shape[0] != rows
                    or t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor with {rows} "
                                 f"rows, got {t.dtype} {tuple(t.shape)}")
        # Every sequence's, prefill rows' too: the backend's attend relies on it.
        check_ranges(tables, lens, self.num_blocks, self.block_size)
        check_slots(slots, self.num_blocks, self.block_size)
        if int(positions.min()) < 0 or int(positions.max()) >= self.cos_sin.shape[0]:
            raise ValueError(f"positions must be in [0, {self.cos_sin.shape[0]})")
        return _StepIn(n, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                       tables.stride(0), lens.data_ptr())

    def _buffers(self, n: int) -> _Scratch:
        # Grown to the largest step seen; a step uses the first n rows of each.
        if n > self._capacity:
            m = self._model_w
            q, kv = m.num_heads * m.head_size, m.num_kv_heads * m.head_size
            widths = {"residual": m.hidden, "h": m.hidden, "qkv": q + 2 * kv,
                      "qn": q, "kn": kv, "attn": q, "gate_up": 2 * m.inter, "act": m.inter}
            self._scratch = {k: torch.empty(n, w) for k, w in widths.items()}
            self._capacity = n
        return _Scratch(*(t.data_ptr() for t in self._scratch.values()))


def _layer(layer: torch.nn.Module, pin: _Pins) -> _Layer | None:
    sa, mlp = layer.self_attn, layer.mlp
    if not isinstance(sa.attn.backend, CPUAttentionBackend):
        return None
    linears = [_linear(m, pin) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(lin is None for lin in linears):
        return None
    k, v = sa.attn.k_cache, sa.attn.v_cache
    if (k.dim() != 4 or k.dtype != torch.float32 or not blocks_contiguous(k)
            or v.stride() != k.stride() or not cpu_kernels_available()
            or not supports(torch.empty(0, sa.num_heads, sa.head_dim), k)):
        return None
    norms = [n.weight for n in _norms(layer)]
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return None
    q_norm, k_norm = (norms[2], norms[3]) if sa.qk_norm else (None, None)
    return _Layer(*linears, pin(norms[0]), pin(norms[1]), pin(q_norm), pin(k_norm),
                  pin(k), pin(v))


def _norms(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's RMSNorms: input, post-attention, then q and k where it has them."""
    sa = layer.self_attn
    return ([layer.input_layernorm, layer.post_attention_layernorm]
            + ([sa.q_norm, sa.k_norm] if sa.qk_norm else []))
