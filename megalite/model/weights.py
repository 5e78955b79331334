"""Move full (unsharded) weights in and out of a possibly sharded GPTModel chunk."""

from collections.abc import Callable

import torch

from megalite.parallel.expert.groups import tensor_split_of
from megalite.parallel.sharding import gather_tp_full, param_shard_of_full


def persistent_buffers(model):
    """(name, buffer) of the state that is not a parameter but belongs to the weights: the MoE
    routers' expert biases (replicated on every rank)."""
    return [(name, buf) for name, buf in model.named_buffers() if name.endswith("router.expert_bias")]


def source_name(model, name: str) -> str:
    """The full-model tensor a parameter holds (a tied output copy holds the word embedding)."""
    if name == "output_layer.weight" and not model.config.untie_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


@torch.no_grad()
def load_full_weights(model, get_full: Callable[[str], torch.Tensor]) -> None:
    """Copy this rank's shard of every parameter, and the persistent buffers, from
    `get_full(name)` (full tensors)."""
    for name, param in model.named_parameters():
        _, world, rank = tensor_split_of(model.pstate, param)
        full = get_full(source_name(model, name))
        shard = param_shard_of_full(param, full, rank, world)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: expected shape {tuple(param.shape)} for this rank, got {tuple(shard.shape)} "
                             f"from a full tensor of shape {tuple(full.shape)}")
        param.copy_(shard)
    for name, buf in persistent_buffers(model):
        buf.copy_(get_full(name))


@torch.no_grad()
def gather_full_weights(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors of this chunk's parameters (or of their gradients), gathered over the TP
    group (expert weights over the ETP group): a collective every rank of them must enter."""
    out = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param
        if value is not None:
            out[source_name(model, name)] = gather_tp_full(param, value, tensor_split_of(model.pstate, param)[0])
    if not grads:
        out.update((name, buf.clone()) for name, buf in persistent_buffers(model))
    return out
