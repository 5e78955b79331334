"""Hugging Face state dicts in and out of a (possibly sharded) GPTModel chunk, in memory: the
read direction for tests and tools that hold a transformers model, the write direction for
exporting a chunk's tensors under Hugging Face's names."""

import torch

from megalite.checkpoint.hf.mapping import family_of, hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf.mapping_deepseek import split_fused_deepseek_experts
from megalite.checkpoint.hf.mapping_moe import split_fused_experts
from megalite.model.weights import gather_full_weights, load_full_weights


def _chunk_scope(model) -> dict:
    return {"layers": [int(n) for n in model.layers], "pre_process": model.pre_process,
            "post_process": model.post_process}


def load_hf_weights(model, hf_state_dict) -> None:
    """Load a Hugging Face GPT2LMHeadModel / LlamaForCausalLM (or Mixtral / Qwen2-MoE) state
    dict into a model chunk."""
    if model.config.mla is not None:
        hf_state_dict = split_fused_deepseek_experts(hf_state_dict)
    elif model.config.moe is not None:
        hf_state_dict = split_fused_experts(hf_state_dict, model.config, family_of(model.config))
    full = dict(hf_to_megalite(hf_state_dict.__getitem__, model.config, model.padded_vocab, **_chunk_scope(model)))
    if model.embedding is not None or model.share_embeddings:  # the last stage's copy (tied, or MTP's)
        embedding = dict(hf_to_megalite(hf_state_dict.__getitem__, model.config, model.padded_vocab, layers=[],
                                        post_process=False))
        full.setdefault("embedding.word_embeddings.weight", embedding["embedding.word_embeddings.weight"])
    load_full_weights(model, full.__getitem__)


def export_hf_weights(model) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of this chunk (a collective over the TP group)."""
    full = gather_full_weights(model)
    return dict(megalite_to_hf(full.__getitem__, model.config, **_chunk_scope(model)))
