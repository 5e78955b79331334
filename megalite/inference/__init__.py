"""Inference: KV cache, sampling and text generation from megalite checkpoints.

    from megalite.inference import SamplingParams, generate_tokens, load_model
"""

from megalite.inference.generate import generate_tokens, load_model, read_common
from megalite.inference.kv_cache import InferenceCache, KVCache
from megalite.inference.sampling import SamplingParams, sample_next

__all__ = ["InferenceCache", "KVCache", "SamplingParams", "generate_tokens", "load_model", "read_common",
           "sample_next"]
