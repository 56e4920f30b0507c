"""pdserve's engine: the model, paged KV cache, scheduler and sampler that prefill and decode
workers share.

The names below are imported when first used, so that importing a torch-free part of the
package (the gRPC server's lifecycle, the tokenizer, sampling parameters) does not import
torch: the router and the command line's client side stay light.
"""
import kernels  # noqa: F401  (first: it sets up oneMKL's dispatch before torch is imported)
from engine.lazy_names import lazy_getattr

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "NoFreeBlocksError": "engine.kv_cache_manager",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "KVLease": "engine.outputs",
    "KVAllocation": "engine.outputs",
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
