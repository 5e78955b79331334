"""Small Megatron `torch`-format checkpoints written without Megatron-Core (TP=1 PP=1, the layout
tests/checkpoint/megatron_core_fixture.py and megatron_core_training.py check against Megatron-Core
itself), for the fast tests of the loader's flags and refusals."""

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


def write_megatron_torch(root, iteration: int | str = 3, extra: dict | None = None, args=None, seed: int = 0,
                         **entries) -> dict:
    """root/iter_NNNNNNN/mp_rank_00/model_optim_rng.pt (root/release/... for iteration
    'release') and the tracker, with `entries` beside the model (optimizer, ...); the model
    state written."""
    model = GPTModel(CONFIG, init_seed=seed)
    state = {**megatron_state_dict(model), **(extra or {})}
    folder = Path(root) / ("release" if iteration == "release" else f"iter_{iteration:07d}") / "mp_rank_00"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args or megatron_args(), "checkpoint_version": 3.0, "iteration": 0 if iteration == "release"
                else iteration, "model": state, **entries}, folder / "model_optim_rng.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return state


def megatron_adam_state(model_state: dict, lr: float = 1e-3, steps: int = 2, seed: int = 0):
    """What Megatron's FP32Optimizer saves for `model_state` (Megatron names, in parameter order)
    after `steps` Adam steps on random gradients: torch AdamW's state dict over Megatron's param
    groups (weight decay for 2-D tensors, then none for 1-D ones and biases, each in parameter
    order, with Megatron's group fields); and each name's states."""
    names = [n for n in model_state if not n.endswith("._extra_state")]
    params = {n: model_state[n].clone().requires_grad_() for n in names}
    plain = [n for n in names if params[n].ndim == 1 or n.endswith(".bias")]
    decay = [n for n in names if n not in plain]
    fields = dict(max_lr=lr, min_lr=0.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    optimizer = torch.optim.AdamW([{"params": [params[n] for n in decay], "wd_mult": 1.0, **fields},
                                   {"params": [params[n] for n in plain], "wd_mult": 0.0, "weight_decay": 0.0, **fields}],
                                  lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return optimizer.state_dict(), {n: optimizer.state[params[n]] for n in names}


def megatron_scheduler(num_steps: int = 12, max_lr: float = 1e-3, weight_decay: float = 0.01, **overrides) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() for a linear schedule without warmup."""
    return {"max_lr": max_lr, "lr_warmup_steps": 0, "num_steps": num_steps, "lr_decay_style": "linear",
            "lr_decay_steps": 40, "min_lr": 0.0, "start_wd": weight_decay, "end_wd": weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": 40, **overrides}


def write_megatron_torch_dist(root, iteration: int = 3, args=None, seed: int = 0, config: GPTConfig = CONFIG) -> dict:
    """root/iter_NNNNNNN/ as Megatron's torch_dist format stores it (DCP files with every tensor
    at its full shape, decoder.layers.* stacked along a leading layer axis; common.pt with the
    args; metadata.json), written by torch.distributed.checkpoint in this one process; the
    model state written (per-layer names)."""
    import torch.distributed.checkpoint as dcp

    state = megatron_state_dict(GPTModel(config, init_seed=seed))
    stacked, per_layer = {}, {}
    for name, tensor in state.items():
        if name.startswith("decoder.layers."):
            number, rest = name[len("decoder.layers."):].split(".", 1)
            per_layer.setdefault(rest, {})[int(number)] = tensor
        else:
            stacked[name] = tensor
    for rest, layers in per_layer.items():
        stacked[f"decoder.layers.{rest}"] = torch.stack([layers[i] for i in sorted(layers)])
    folder = Path(root) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(stacked, checkpoint_id=str(folder), no_dist=True)
    args = args or megatron_args()
    args.ckpt_format = "torch_dist"
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration}, folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return state
