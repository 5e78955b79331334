"""Small Megatron `torch`-format checkpoints written without Megatron-Core (TP=1 PP=1, the layout
tests/convert/megatron_core_fixture.py checks against Megatron-Core itself), for the fast tests
of the loader's flags and refusals."""

import argparse
from pathlib import Path

import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel

CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=16,
                   normalization="RMSNorm", activation="swiglu", add_bias_linear=False, position_embedding_type="rope",
                   untie_embeddings_and_output_weights=True, ffn_hidden_size=32, make_vocab_size_divisible_by=8,
                   hidden_dropout=0.0, attention_dropout=0.0)


def megatron_args(**overrides) -> argparse.Namespace:
    values = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2, group_query_attention=False,
                  ffn_hidden_size=32, kv_channels=8, seq_length=16, max_position_embeddings=16, vocab_size=64,
                  padded_vocab_size=64, make_vocab_size_divisible_by=8, normalization="RMSNorm", norm_epsilon=1e-5,
                  swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
                  rotary_base=10000, rotary_percent=1.0, untie_embeddings_and_output_weights=True, params_dtype=torch.float32,
                  hidden_dropout=0.0, attention_dropout=0.0, consumed_train_samples=12, consumed_valid_samples=0)
    values.update(overrides)
    return argparse.Namespace(**values)


def megatron_state_dict(model: GPTModel) -> dict:
    """Megatron-Core names (`decoder.` prefix) of a TP=1 megalite model's tensors."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("layers.") or name.startswith("final_layernorm."):
            name = "decoder." + name
        out[name] = tensor.clone()
    return out


def write_megatron_torch(root, iteration: int = 3, extra: dict | None = None, args=None, seed: int = 0) -> dict:
    """root/iter_NNNNNNN/mp_rank_00/model_optim_rng.pt and the tracker; the model state written."""
    model = GPTModel(CONFIG, init_seed=seed)
    state = {**megatron_state_dict(model), **(extra or {})}
    folder = Path(root) / f"iter_{iteration:07d}" / "mp_rank_00"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args or megatron_args(), "checkpoint_version": 3.0, "iteration": iteration, "model": state},
               folder / "model_optim_rng.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return state
