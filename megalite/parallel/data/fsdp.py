"""ZeRO-3 through PyTorch's FSDP2 (`fully_shard`), sharding over the data-parallel group only.

Each transformer layer and then the root model are sharded over a DeviceMesh built from
pstate.dp_group, so megalite's own tensor parallelism composes with it: TP layers are plain
modules holding TP-local parameters, which FSDP2 shards further along dim 0 over DP. A
mixture-of-experts layer's local experts are sharded first, over their own mesh of the
expert-data-parallel group (torchtitan's dp_shard_mod_ep), with the gradient divided by DP
as the dense gradients are (each rank's expert gradient already sums its ETP x EP block's
tokens).

Mixed precision is FSDP2's: keep the model's parameters in fp32 (they are the optimizer's main
parameters) and pass param_dtype=torch.bfloat16 to compute in bf16; gradients are reduced in
`reduce_dtype` (fp32 by default).

Works on CPU with gloo in torch 2.13 (reduce_scatter and all_gather are supported there). The
one workaround: FSDP2 replaces each parameter by a new DTensor parameter, which loses
megalite's parameter attributes (tensor_model_parallel, sequence_parallel, shared_embedding,
...), so apply_fsdp2 copies them onto the new parameters.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from megalite.parallel.state import ParallelState

_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                     "shared_embedding", "expert_parallel")


class FSDPChunk(nn.Module):
    """An FSDP2-sharded model chunk with the interface of DistributedDataParallel, so the
    training loop, finalize_model_grads and build_optimizer treat both alike."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.module, self.mesh = module, mesh

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally; reduce-scatter after the last micro-batch."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self) -> None:
        """FSDP2 reduce-scatters during backward; nothing to start."""

    def finish_grad_sync(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward; nothing to finish."""

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    @staticmethod
    def shard_like(dtensor, full: torch.Tensor):
        """This rank's shard of `full`, placed like `dtensor` (every rank holds `full`): for the
        optimizer's gathered load_state_dict, the tests' oracle (checkpoints load FlatShards)."""
        # clone: the shard may view `full`, which the caller still owns
        return distribute_tensor(full.to(dtensor.device, dtensor.dtype), dtensor.device_mesh, dtensor.placements,
                                 src_data_rank=None).clone()


def apply_fsdp2(model: nn.Module, pstate: ParallelState, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True) -> FSDPChunk:
    """Shard `model` (a GPTModel chunk) with FSDP2 over the data-parallel group, each entry of
    model.layers separately and the rest at the root, in place; returns the FSDPChunk wrapping
    it. `param_dtype` is the compute dtype (None: the parameters' own, fp32)."""
    if pstate.dp_group is None:
        raise ValueError("apply_fsdp2 needs torch.distributed (pstate.dp_group is None)")
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if wrong:
        raise ValueError(f"apply_fsdp2: parameters must be float32 (they are the main parameters); got {wrong}. "
                         "Build the model with params_dtype='float32' and pass param_dtype=torch.bfloat16")
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(pstate.dp_group, device_type)
    attributes = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
                  for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    expert_mesh = _expert_mesh(model, pstate, device_type)
    for layer in model.layers.values():
        for experts in _expert_modules(layer):
            fully_shard(experts, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            experts.set_gradient_divide_factor(float(pstate.dp_size))
            # gloo has no PREMUL_SUM: a sum, then the division (on one rank torch 2.13 would divide twice)
            if expert_mesh.size() > 1 and dist.get_backend(pstate.dp_group) != "nccl":
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for name, param in model.named_parameters():
        for attribute, value in attributes[name].items():
            setattr(param, attribute, value)
    return FSDPChunk(model, mesh)


def _expert_modules(layer: nn.Module) -> list[nn.Module]:
    """The outermost submodules of `layer` holding expert parameters (param.expert_parallel) only."""
    found, covered = [], set()
    for module in layer.modules():  # outer modules first
        params = list(module.parameters())
        if module not in covered and params and all(getattr(p, "expert_parallel", False) for p in params):
            found.append(module)
            covered.update(module.modules())
    return found


def _expert_mesh(model: nn.Module, pstate: ParallelState, device_type: str) -> DeviceMesh | None:
    """A mesh of the expert-data-parallel group (this rank alone when that group has one rank)."""
    if pstate.expert is None or not any(getattr(p, "expert_parallel", False) for p in model.parameters()):
        return None
    group = pstate.expert.edp_group
    if group is None:
        group = dist.new_group([pstate.rank], use_local_synchronization=True)
    return DeviceMesh.from_group(group, device_type)
