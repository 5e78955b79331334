"""--optimizer muon: megalite's mixed-precision optimizer (fp32 main parameters, clipping, the
training loop's interface) whose inner optimizer is Muon for the 2-D weights and Adam or Lion
(--muon-scalar-optimizer) for the rest, split as Megatron splits them (muon.is_muon_param).

Checkpoints hold the same two keys for every parameter, so the sharded save/load and the
resharding of MixedPrecisionOptimizer serve Muon unchanged: "exp_avg" is Adam's (or Lion's)
first moment or Muon's momentum buffer; "exp_avg_sq" is Adam's second moment (zeros for a Muon
weight; absent with Lion).

Under the distributed optimizer each rank keeps the momentum of its own elements; the update of
each Muon weight is summed into the full (TP-local) matrix over the DP group, and every rank
orthogonalises it and applies its own elements (muon.Muon._update_sharded): the result of DDP,
with the state sharded but the Newton-Schulz work not (Megatron's layer-wise distributed
optimizer gives each rank whole weights instead). FSDP2 likewise, all-gathering each DTensor
update (Muon._update_dtensor); Megatron refuses FSDP2 with Muon.
"""

from collections import defaultdict

import torch

from megalite.optimizer.distributed import sharded_dp_group
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer, check_chunks
from megalite.optimizer.muon import Lion, Muon, MuonTarget, is_muon_param
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.expert.groups import tensor_split_of

EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
SCALAR_OPTIMIZERS = ("adam", "lion")


def qkv_split_of(config) -> tuple:
    """(q, k, v) rows per query group of the fused QKV weight of a GPTConfig (Megatron's
    _get_qkv_split_shapes)."""
    kv = config.kv_channels or config.hidden_size // config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    return (config.num_attention_heads // groups * kv, kv, kv)


class MuonAndScalar(torch.optim.Optimizer):
    """Muon and the scalar optimizer stepped together, as one torch optimizer: param_groups
    is both's groups (the LR scheduler sets each one's lr) and `state` one mapping for both."""

    def __init__(self, muon: Muon, scalar: torch.optim.Optimizer):
        self.muon, self.scalar = muon, scalar
        self.defaults = {}
        self.state = defaultdict(dict)
        muon.state = scalar.state = self.state
        self.param_groups = muon.param_groups + scalar.param_groups
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups  # callers may swap the list (phases); keep each part's own
        self.muon.param_groups = [g for g in groups if g.get("muon")]
        self.scalar.param_groups = [g for g in groups if not g.get("muon")]
        self.muon.step()
        self.scalar.step()

    def add_param_group(self, group):
        raise ValueError("--optimizer muon: param groups are fixed when the optimizer is built "
                         "(--decoupled-lr is not implemented with Muon)")


class MuonMixedPrecisionOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer with kind "muon" (see the module)."""

    def __init__(self, chunks, pstate, *, muon_options: dict, scalar_optimizer: str, scalar_options: dict,
                 qkv_split: tuple | None, **kwargs):
        self._muon_options, self._scalar_optimizer = muon_options, scalar_optimizer
        self._scalar_options, self._qkv_split = scalar_options, qkv_split
        super().__init__(chunks, pstate, kind="muon", make_inner=self._make_inner, **kwargs)

    def _target(self, chunk, name, param, entry) -> MuonTarget | None:
        if not is_muon_param(name, param, name.endswith(EMBEDDING_OR_OUTPUT)):
            return None
        lo, hi = (entry.lo, entry.hi) if entry is not None else (0, 0)
        dp_group = sharded_dp_group(chunk, param) if isinstance(chunk, DistributedDataParallel) else None
        if dp_group is None and (lo, hi) != (0, param.numel()):
            raise ValueError(f"--optimizer muon: {name} holds elements [{lo}, {hi}) of {param.numel()} "
                             "without a group to gather them over")
        # an expert weight is split over the expert-tensor-parallel group (Megatron: expt_tp for
        # parameters flagged expert_tp), each expert's linear its own matrix
        tp_group, tp_size, _ = tensor_split_of(self.pstate, param)
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        qkv = self._qkv_split if ("linear_qkv.weight" in name and self._qkv_split
                                  and param.shape[0] % sum(self._qkv_split) == 0) else None
        return MuonTarget(tuple(param.shape), param.partition_dim if split else None,
                          tp_group if split else None, qkv, dp_group, lo, hi, param.device)

    def _make_inner(self, groups):
        schedule = [(entry.main if entry is not None else None, target)
                    for chunk, name, param, entry in self._named_params()
                    if (target := self._target(chunk, name, param, entry)) is not None]
        self._targets = {main: target for main, target in schedule if main is not None}
        muon_groups, scalar_groups = [], []
        for group in groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            muon = [p for p in group["params"] if p in self._targets]
            scalar = [p for p in group["params"] if p not in self._targets]
            muon_groups += [{**settings, "params": muon, "muon": True}] if muon else []
            scalar_groups.append({**settings, "params": scalar})
        lr = self._muon_options["lr"]
        muon = Muon(muon_groups or [{"params": []}], targets=self._targets, schedule=schedule, **self._muon_options)
        muon.param_groups = [g for g in muon.param_groups if g["params"]]
        if self._scalar_optimizer == "lion":
            scalar = Lion(scalar_groups, lr=lr, **self._scalar_options)
        else:
            impl = {"fused": True} if self.mains and self.mains[0].main.is_cuda else {"foreach": True}
            scalar = torch.optim.AdamW(scalar_groups, lr=lr, **self._scalar_options, **impl)
        return MuonAndScalar(muon, scalar)

    def is_muon(self, main) -> bool:
        return main in self._targets

    def _state_keys(self) -> tuple:
        if self.num_steps == 0:
            return ()
        return ("exp_avg",) if self._scalar_optimizer == "lion" else ("exp_avg", "exp_avg_sq")

    def _values(self, entry) -> dict:
        values = {"param": entry.main if entry else None}
        for key in self._state_keys():
            if entry is None:
                values[key] = None
            elif self.is_muon(entry.main):
                buf = self.inner.state[entry.main]["momentum_buffer"].detach()
                values[key] = buf if key == "exp_avg" else torch.zeros_like(buf)
            else:
                values[key] = self.inner.state[entry.main][key]
        return values

    def _set_state(self, main, states: dict) -> None:
        if not states:
            return
        if self.is_muon(main):
            self.inner.state[main] = {"momentum_buffer": states["exp_avg"]}
        elif self._scalar_optimizer == "adam":
            on_device = self.inner.scalar.defaults.get("fused")
            step = torch.tensor(float(self.num_steps), dtype=torch.float32, device=main.device if on_device else "cpu")
            self.inner.state[main] = {**states, "step": step}
        else:
            self.inner.state[main] = dict(states)


def build_muon_optimizer(ddp_chunks, pstate, *, lr: float, weight_decay: float = 0.01, momentum: float = 0.9,
                         nesterov: bool = False, scale_mode: str = "spectral", num_ns_steps: int = 5,
                         coefficient_type: str = "quintic", tp_mode: str = "duplicated", split_qkv: bool = True,
                         extra_scale_factor: float = 1.0, fp32_matmul_prec: str = "medium",
                         scalar_optimizer: str = "adam", adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                         adam_eps: float = 1e-8, lion_beta1: float = 0.95, lion_beta2: float = 0.98,
                         qkv_split: tuple | None = None, clip_grad: float = 1.0, fp16: bool = False,
                         bf16: bool = False, use_distributed_optimizer: bool = False,
                         overlap_param_gather: bool = False,
                         log_num_zeros_in_grad: bool = False) -> MuonMixedPrecisionOptimizer:
    """Muon over `ddp_chunks` (megalite DistributedDataParallel, with or without the distributed
    optimizer); `qkv_split` is (q, k, v) rows per query group: (heads / groups * kv_channels,
    kv_channels, kv_channels)."""
    if scalar_optimizer not in SCALAR_OPTIMIZERS:
        raise ValueError(f"--muon-scalar-optimizer {scalar_optimizer!r} is not one of {', '.join(SCALAR_OPTIMIZERS)}")
    if fp16:
        raise ValueError("--optimizer muon with --fp16 is not supported (as in Megatron); use --bf16")
    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    expected = torch.bfloat16 if bf16 else torch.float32
    check_chunks("build_muon_optimizer", ddp_chunks, use_distributed_optimizer, expected, f"bf16={bf16}")
    muon_options = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        steps=num_ns_steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, tp_mode=tp_mode, split_qkv=split_qkv,
                        fp32_matmul_prec=fp32_matmul_prec)
    scalar_options = (dict(betas=(lion_beta1, lion_beta2)) if scalar_optimizer == "lion"
                      else dict(betas=(adam_beta1, adam_beta2), eps=adam_eps))
    return MuonMixedPrecisionOptimizer(
        ddp_chunks, pstate, muon_options=muon_options, scalar_optimizer=scalar_optimizer,
        scalar_options=scalar_options, qkv_split=qkv_split, clip_grad=clip_grad, loss_scaler=None,
        weight_decay=weight_decay, overlap_param_gather=overlap_param_gather, cpu_offload=False,
        log_num_zeros_in_grad=log_num_zeros_in_grad)
