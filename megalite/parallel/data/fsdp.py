"""ZeRO-3 through PyTorch's FSDP2 (`fully_shard`), sharding over DP x CP.

Each transformer layer and then the root model are sharded over a DeviceMesh built from
pstate.dp_cp_group (the data-parallel group without context parallelism; torchtitan's
dp_shard_cp dimension), so megalite's own tensor parallelism composes with it: TP layers are
plain modules holding TP-local parameters, which FSDP2 shards further along dim 0. Each CP
rank's gradient is that of its part of every sequence, so gradients are summed over CP and
averaged over DP: the reduce-scatter divides by the DP size, not the mesh's. A
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
from torch._subclasses.fake_tensor import unset_fake_temporarily
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
    """Shard `model` (a GPTModel chunk) with FSDP2 over DP x CP, each entry of model.layers
    separately and the rest at the root, in place; returns the FSDPChunk wrapping it.
    `param_dtype` is the compute dtype (None: the parameters' own, fp32)."""
    if pstate.dp_cp_group is None:
        raise ValueError("apply_fsdp2 needs torch.distributed (pstate.dp_cp_group is None)")
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if wrong:
        raise ValueError(f"apply_fsdp2: parameters must be float32 (they are the main parameters); got {wrong}. "
                         "Build the model with params_dtype='float32' and pass param_dtype=torch.bfloat16")
    device_type = next(model.parameters()).device.type
    mesh = _mesh(pstate.dp_cp_group, device_type)
    attributes = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
                  for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    expert_mesh = _expert_mesh(model, pstate, device_type)
    # each CP rank's gradient is that of its part of every sequence (summed over CP), and each
    # rank's expert gradient sums its ETP x EP block's tokens: both are divided by DP alone
    dense_divisor = pstate.dp_size if pstate.cp_size > 1 else None
    for layer in model.layers.values():
        for experts in _expert_modules(layer):
            _shard(experts, expert_mesh, policy, reshard_after_forward, divide_by=pstate.dp_size)
        _shard(layer, mesh, policy, reshard_after_forward, divide_by=dense_divisor)
    _shard(model, mesh, policy, reshard_after_forward, divide_by=dense_divisor)
    for name, param in model.named_parameters():
        for attribute, value in attributes[name].items():
            setattr(param, attribute, value)
    return FSDPChunk(model, mesh)


def _shard(module: nn.Module, mesh: DeviceMesh, policy, reshard_after_forward: bool, divide_by: int | None) -> None:
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if divide_by is None:
        return
    module.set_gradient_divide_factor(float(divide_by))
    # a divide factor other than the mesh size is NCCL's PREMUL_SUM; elsewhere a sum, then the
    # division (on a one-rank mesh torch 2.13 would divide twice)
    if mesh.size() > 1 and dist.get_backend(mesh.get_group()) != "nccl":
        module.set_force_sum_reduction_for_comms(True)


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
    return _mesh(group, device_type)


def _mesh(group, device_type: str) -> DeviceMesh:
    """The DeviceMesh of `group`; its rank table is a real tensor even under the dry run's
    FakeTensorMode (whose fake tensors cannot answer DeviceMesh's nonzero())."""
    with unset_fake_temporarily():
        return DeviceMesh.from_group(group, device_type)
