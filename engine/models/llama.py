"""One decoder for the Llama family: Llama 2/3, Mistral (full attention), Qwen2 and Qwen3.

The differences are all config switches: q/k/v (and o) bias, per-head q/k RMSNorm, an explicit
head_dim, tied embeddings, GQA/MQA and the RoPE scaling.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.layers import (Attention, MergedColumnParallelLinear, ParallelLMHead,
                           QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                           SiluAndMul, VocabParallelEmbedding, default_weight_loader)
from engine.model_config import ModelConfig
from kernels.attention_backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter],
                                                       bias=cfg.mlp_bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2 * inter / tp], gate then up
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                             self.qkv_proj.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary_emb, backend)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                     cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary_emb, backend)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # HF projection name -> (our fused module, shard id in it).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden_size] final hidden states."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 logits."""
        return self.lm_head.compute_logits(hidden).float()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Layer i reads and writes kv_cache[:, i, 0] (keys) and kv_cache[:, i, 1] (values).

        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads_on_this_rank, head_size]
        (block-major: engine/kv_layout.py)
        """
        attn0 = self.model.layers[0].self_attn
        layers = len(self.model.layers)
        if (kv_cache.dim() != 6 or kv_cache.shape[1] != layers or kv_cache.shape[2] != 2
                or kv_cache.shape[4] != attn0.num_kv_heads or kv_cache.shape[5] != attn0.head_dim):
            raise ValueError(
                f"kv cache shape {tuple(kv_cache.shape)} does not match the model: expected "
                f"[num_blocks, {layers}, 2, block_size, {attn0.num_kv_heads}, {attn0.head_dim}]")
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.bind_kv_cache(kv_cache[:, i, 0], kv_cache[:, i, 1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named full tensors; ValueError lists any missing or unexpected names."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        loaded: set[tuple[str, object]] = set()
        unexpected: list[str] = []
        tied = self.config.tie_word_embeddings
        stored_head = stored_embed = None
        for hf_name, tensor in weights:
            if self._ignored(hf_name):
                continue
            if tied and hf_name == "lm_head.weight":
                stored_head = tensor  # settled once the embedding is in
                continue
            if tied and hf_name == "model.embed_tokens.weight":
                # Kept whole (a reference: safetensors maps the file) until the head is
                # settled, on the full tensor and not on this rank's slice of it.
                stored_embed = tensor
            name, shard_id = self._param_name(hf_name)
            param = params.get(name)
            if param is None:
                unexpected.append(hf_name)
                continue
            self._load_tensor(param, hf_name, tensor, shard_id)
            # An already fused checkpoint tensor (shard None) fills every shard.
            shards = self._shard_ids(name) if shard_id is None else [shard_id]
            loaded.update((name, sid) for sid in shards)
        if stored_head is not None:
            self._settle_tied_head(stored_head, stored_embed, loaded)
        missing = [self._hf_name(name, sid) for name in params
                   for sid in self._shard_ids(name) if (name, sid) not in loaded]
        if missing or unexpected:
            raise ValueError("checkpoint does not match the model: "
                             f"missing weights {_brief(missing)}; "
                             f"unexpected weights {_brief(unexpected)}")

    def _ignored(self, hf_name: str) -> bool:
        return hf_name.endswith("rotary_emb.inv_freq")  # RoPE tables are recomputed

    def _settle_tied_head(self, head: torch.Tensor, embed: torch.Tensor | None,
                          loaded: set[tuple[str, object]]) -> None:
        """A tied model whose checkpoint stores lm_head.weight too, resolved as transformers'
        tie_weights does: a head equal to the embedding stays tied, one that differs is kept
        untied (the config is wrong about the checkpoint), and with no embedding stored the
        head fills the tied pair. ``head`` and ``embed`` are the checkpoint's full tensors."""
        weight = self.model.embed_tokens.weight
        if embed is None:
            self._load_tensor(weight, "lm_head.weight", head)
            loaded.add(("model.embed_tokens.weight", None))
            return
        # Decided on the full tensors, so every tensor-parallel rank decides alike (a rank's
        # slice may match where another's differs). In the compute dtype: where the two are
        # equal there, tying computes the same logits without a second copy.
        if _equal_in(weight.dtype, head, embed):
            return
        untied = nn.Parameter(torch.empty_like(weight), requires_grad=False)
        untied.weight_loader = self.lm_head.weight_loader
        self._load_tensor(untied, "lm_head.weight", head)
        logger.warning("%s: config.json ties lm_head to embed_tokens, but the checkpoint stores "
                       "a different lm_head.weight; using it untied, as transformers does",
                       self.config.folder)
        self.lm_head.weight = untied

    @staticmethod
    def _load_tensor(param: nn.Parameter, hf_name: str, tensor: torch.Tensor,
                     shard_id: object = None) -> None:
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if not tensor.is_floating_point():
                # copy_ would cast it to the parameter's dtype: an integer (quantized) or bool
                # tensor of the right shape loaded as garbage weights, with no error.
                raise ValueError(f"checkpoint tensor has dtype {tensor.dtype}, not a "
                                 "floating-point one (quantized checkpoints are not supported)")
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"weight {hf_name}: {e}") from None

    def _param_name(self, hf_name: str) -> tuple[str, object]:
        module, _, leaf = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in self.packed_modules_mapping:
            fused, shard_id = self.packed_modules_mapping[proj]
            return f"{parent}.{fused}.{leaf}", shard_id
        return hf_name, None

    def _shard_ids(self, name: str) -> list[object]:
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        ids = [sid for fused, sid in self.packed_modules_mapping.values() if fused == proj]
        return ids or [None]

    def _hf_name(self, name: str, shard_id: object) -> str:
        if shard_id is None:
            return name
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        proj = next(p for p, (f, s) in self.packed_modules_mapping.items()
                    if f == fused and s == shard_id)
        return f"{parent}.{proj}.{leaf}"


def _equal_in(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor,
              rows: int = 4096) -> bool:
    """Whether a and b are equal once cast to dtype; cast a block of rows at a time, so a
    vocabulary-sized pair never costs two full copies."""
    if a.shape != b.shape:
        return False  # loading the head then names the mismatch
    return all(torch.equal(a[i:i + rows].to(dtype), b[i:i + rows].to(dtype))
               for i in range(0, a.shape[0], rows))


def _brief(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
