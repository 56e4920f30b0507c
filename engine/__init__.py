"""pdserve's engine: the model, paged KV cache, scheduler and sampler that prefill and decode
workers share."""
import kernels  # noqa: F401  (first: it sets up oneMKL's dispatch before torch is imported)
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, NoFreeBlocksError
from engine.outputs import KVAllocation, KVLease, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "KVLease",
           "KVAllocation", "NoFreeBlocksError"]
