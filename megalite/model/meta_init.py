"""Deferred initialisation: build a model on the meta device (no memory, no values), then
materialise it on the device it will run on.

    model = GPTModel(config, pstate, device="meta")
    materialize_(model, "cuda")        # the weights GPTModel(config, pstate, device="cuda") has

Materialisation allocates this rank's parameters and runs the model's own init_weights, one
module at a time, so it draws exactly what construction on that device draws, and holds at
most one full (unsharded) weight tensor at a time besides the shards (none with
init_on_shard). With `init=False` the parameters are only allocated (a checkpoint load or a
dry run on a fake device fills or ignores them).
"""

import torch
from torch import nn


def _empty_like(tensor: torch.Tensor, device) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


@torch.no_grad()
def materialize_(model: nn.Module, device, *, init: bool = True) -> nn.Module:
    """Replace every meta parameter and buffer of `model` by an uninitialised one on `device`,
    keeping its attributes (tensor_model_parallel, partition_dim, shared_embedding, ...) and
    sharing, then (with `init`) initialise as construction on `device` would. Returns `model`."""
    done: dict[int, torch.Tensor] = {}
    replaced = []  # the meta tensors, alive until the end so that their ids stay unique
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in done:
                new = nn.Parameter(_empty_like(param, device), requires_grad=param.requires_grad)
                # megalite's attributes; a fake tensor's own bookkeeping stays its own
                new.__dict__.update({k: v for k, v in param.__dict__.items() if k not in new.__dict__})
                done[id(param)] = new
                replaced.append(param)
            module._parameters[name] = done[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                replaced.append(buf)
                module._buffers[name] = done.setdefault(id(buf), _empty_like(buf, device))
    if init:
        model.init_weights(model.init_seed)
    return model

