"""pdserve's engine: the model, paged KV cache, scheduler and sampler that prefill and decode
workers share.

The names below are imported when first used, so that importing a torch-free part of the
package (the gRPC server's lifecycle, the tokenizer, sampling parameters) does not import
torch: the router and the command line's client side stay light.
"""
import importlib

import kernels  # noqa: F401  (first: it sets up oneMKL's dispatch before torch is imported)

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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = list(_EXPORTS)
