"""Operators a model's forward and backward dispatch per transformer layer and outside the
layers, counted by running a tiny model of the same structure (norm, activation, attention,
biases, MoE experts) under a dispatch counter. On a CPU each operator costs host time the
calibration measures (cluster.op_overhead); the counts do not depend on the sizes.
"""

import contextlib
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.model.config import GPTConfig


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def tiny(config: GPTConfig, num_layers: int) -> GPTConfig:
    """`config`'s structure at toy sizes: 2 heads of 4 channels, 16 hidden, 64 tokens."""
    moe = config.moe
    if moe is not None:
        from dataclasses import replace
        moe = replace(moe, ffn_hidden_size=8, layer_freq=moe.layer_freq if isinstance(moe.layer_freq, int) else 1,
                      shared_expert_intermediate_size=8 if moe.shared_expert_intermediate_size else None)
    return config.replace(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                          num_query_groups=1 if config.num_query_groups != config.num_attention_heads else 2,
                          kv_channels=4, ffn_hidden_size=32, vocab_size=64, max_position_embeddings=16,
                          sequence_parallel=False, recompute_granularity=None, params_dtype="float32",
                          fused_kernels=False, moe=moe)


def tiny_model(config: GPTConfig, seq_length: int = 8):
    """(model, tokens) of `config` in this process."""
    from megalite.model.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config), torch.randint(0, config.vocab_size, (1, seq_length))


def micro_batch(model, tokens, counters=(None, None)) -> None:
    """One forward and backward, each under its counter when given."""
    forward, backward = (c if c is not None else contextlib.nullcontext() for c in counters)
    with forward:
        loss = model(tokens, labels=tokens).float().mean()
    with backward:
        loss.backward()


def count_ops(config: GPTConfig, seq_length: int = 8) -> tuple[int, int]:
    """(forward, backward) operators of one training micro-batch of `config` (one process)."""
    model, tokens = tiny_model(config, seq_length)
    counters = (OpCounter(), OpCounter())
    micro_batch(model, tokens, counters)
    return counters[0].count, counters[1].count


@lru_cache(maxsize=64)
def _counts(config_key: tuple) -> tuple:
    values = dict(config_key)
    values["moe"] = None if values["moe"] is None else dict(values["moe"])
    values["extra"] = {}
    config = GPTConfig.from_dict(values)
    one, two = count_ops(tiny(config, 1)), count_ops(tiny(config, 2))
    per_layer = (two[0] - one[0], two[1] - one[1])
    return per_layer, (one[0] - per_layer[0], one[1] - per_layer[1])


def op_counts(config: GPTConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((forward, backward) per layer, (forward, backward) outside the layers)."""
    values = config.to_dict()
    values["moe"] = None if config.moe is None else tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in config.moe.to_dict().items()))
    values["unfused_kernels"] = tuple(values["unfused_kernels"])
    values["extra"] = ()
    key = tuple(sorted(values.items()))
    return _counts(key)
