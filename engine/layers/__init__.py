"""Model building blocks: tensor-parallel linear layers, embeddings, norms, RoPE, attention."""
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                  QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                  default_weight_loader)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "ColumnParallelLinear", "LinearBase", "MergedColumnParallelLinear", "ParallelLMHead",
           "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding",
           "RowParallelLinear", "SiluAndMul", "VocabParallelEmbedding", "default_weight_loader"]
