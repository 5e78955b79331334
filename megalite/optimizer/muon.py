"""Muon: momentum SGD whose update of each 2-D weight is orthogonalised by a Newton-Schulz
iteration, as Megatron-Core's TensorParallelMuon (emerging-optimizers' OrthogonalizedOptimizer
with newton_schulz_tp) computes it:

    p      <- p - lr * wd * p                          (decoupled weight decay, first)
    m      <- lerp(m, g, 1 - momentum)                 (an EMA of the gradient)
    u      <- lerp(g, m, momentum) if nesterov else m
    p      <- p - lr * NS(u) * scale(rows, cols) * extra_scale_factor

NS normalises u by its Frobenius norm, transposes it when it has more rows than columns (so the
Gram matrix X X^T is the small one) and applies `steps` quintic steps X <- a X + (b A + c A A) X
with A = X X^T, the (a, b, c) of the coefficient type (cycled, or the last one repeated). With
--muon-fp32-matmul-prec medium the iteration runs in bf16 (as emerging-optimizers does under
torch's "medium" float32 matmul precision).

Data parallelism: under the distributed optimizer (flat shards) and FSDP2 (DTensor shards) the
decay and momentum are per element on each rank's shard; the update is gathered into the full
matrix, which every rank orthogonalises, applying its own elements.

Tensor parallelism (`MuonTarget.partition_dim` 0 or 1, each rank holding 1/tp of the matrix):
  blockwise    each rank orthogonalises its shard alone, scaled by the shard's shape;
  duplicated   all-gather the shards, every rank orthogonalises the full matrix, keeps its own;
  distributed  the Gram matrix and the norm are all-reduced over the TP group, so each rank
               iterates on its shard only (the transpose follows the partition dim).
With split-qkv a fused QKV weight ([groups, q + k + v rows, in]) is orthogonalised as three
matrices, q, k and v, each gathered or reduced as above.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

# Published Newton-Schulz coefficient sets (Jordan's Muon; Polar Express, CANS, AOL and
# DeepSeek-V4 as emerging-optimizers 0.3.0 tabulates them).
NS_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")  # the others cycle through their sets
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("medium", "high")
NS_EPS = 1e-7


def ns_coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    if kind not in NS_COEFFICIENTS:
        raise ValueError(f"--muon-coefficient-type {kind!r} is not one of {', '.join(NS_COEFFICIENTS)}")
    sets = NS_COEFFICIENTS[kind]
    if kind in _REPEAT_LAST:
        return [sets[min(i, len(sets) - 1)] for i in range(steps)]
    return [sets[i % len(sets)] for i in range(steps)]


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a (rows x cols) weight: spectral sqrt(max(rows, cols)) (Kimi's
    Moonlight), shape_scaling sqrt(max(1, rows / cols)) (Jordan), unit_rms_norm sqrt(rows / cols)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r} is not one of {', '.join(SCALE_MODES)}")


def newton_schulz(x: torch.Tensor, steps: int, kind: str, *, transpose: bool | None = None,
                  tp_group=None, bf16: bool = False) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of fp32 matrix `x` (see the module); with `tp_group`,
    `x` is one rank's columns of the (transposed) matrix and the norm and Gram matrix are summed
    over the group."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if tp_group is not None:
        squares = (x * x).sum()
        dist.all_reduce(squares, group=tp_group)
        X = x / torch.sqrt(squares).clamp_min(NS_EPS)
    else:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=NS_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in ns_coefficients(kind, steps):
        A = X @ X.mT
        if tp_group is not None:
            dist.all_reduce(A, group=tp_group)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


@dataclass
class MuonTarget:
    """How one (flat) fp32 main parameter is orthogonalised: its TP-local `shape`, the dim
    the TP group splits it on (None: not split, or TP 1), and for a fused QKV weight the rows
    of q, k and v in one query group."""

    shape: tuple
    partition_dim: int | None = None
    tp_group: object = None
    qkv_split: tuple | None = None
    dp_group: object = None
    """Under the distributed optimizer: the group the flat main is sharded over (this rank holds
    elements [lo, hi), possibly none); the update is summed into the full matrix over it."""
    lo: int = 0
    hi: int = 0
    device: object = None


class Muon(torch.optim.Optimizer):
    """Muon over tensors whose `targets` entry (or own shape, when absent) says what matrix
    they are; state per tensor: "momentum_buffer". See the module for the update."""

    def __init__(self, params, *, lr: float, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.01, steps: int = 5, coefficient_type: str = "quintic",
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, tp_mode: str = "duplicated",
                 split_qkv: bool = True, fp32_matmul_prec: str = "medium", targets: dict | None = None,
                 schedule: list | None = None):
        if steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be at least 1, got {steps}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode!r} is not one of {', '.join(TP_MODES)}")
        if fp32_matmul_prec not in MATMUL_PRECISIONS:
            raise ValueError(f"--muon-fp32-matmul-prec {fp32_matmul_prec!r} is not one of "
                             f"{', '.join(MATMUL_PRECISIONS)} (torch has no 'low' float32 matmul precision)")
        ns_coefficients(coefficient_type, steps)
        muon_scale(1, 1, scale_mode)
        self.nesterov, self.steps, self.coefficient_type = nesterov, steps, coefficient_type
        self.scale_mode, self.extra_scale_factor, self.tp_mode = scale_mode, extra_scale_factor, tp_mode
        self.split_qkv, self.fp32_matmul_prec = split_qkv, fp32_matmul_prec
        self.targets = targets if targets is not None else {}
        # (tensor or None, MuonTarget) of every Muon weight of the model in one order on every
        # rank: a rank holding no element of a DP-sharded weight still takes part in its collectives
        self.schedule = schedule
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _target(self, p) -> MuonTarget:
        target = self.targets.get(p)
        return target if target is not None else MuonTarget(tuple(p.shape))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon: closure is not supported")
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.fp32_matmul_prec)
        try:
            if self.schedule is None:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            self._update(p, group)
            else:
                group_of = {p: group for group in self.param_groups for p in group["params"]}
                for p, target in self.schedule:
                    if target.dp_group is None:
                        self._update(p, group_of[p])
                    else:
                        self._update_sharded(p, group_of.get(p), target)
        finally:
            torch.set_float32_matmul_precision(previous)

    def _update(self, p, group) -> None:
        target = self._target(p)
        if hasattr(p, "full_tensor"):
            return self._update_dtensor(p, group, target)
        grad = p.grad.view(target.shape)
        weight = p.view(target.shape)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"].view(target.shape)
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        if wd != 0.0:
            weight.add_(weight, alpha=-wd * lr)
        buf.lerp_(grad, 1 - beta)
        update = grad.lerp(buf, beta) if self.nesterov else buf
        weight.add_(self.orthogonalize(update, target), alpha=-lr)

    def _update_sharded(self, p, group, target: MuonTarget) -> None:
        """_update on this rank's elements [lo, hi) of a flat DP-sharded weight (p None: none):
        decay and momentum per element, the update summed into the full matrix over the DP group
        (exact: the other elements are zeros), orthogonalised, this rank's elements applied."""
        full = torch.zeros(math.prod(target.shape), dtype=torch.float32, device=target.device)
        if p is not None:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            if wd != 0.0:
                p.add_(p, alpha=-wd * lr)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            full[target.lo:target.hi] = p.grad.lerp(buf, beta) if self.nesterov else buf
        dist.all_reduce(full, group=target.dp_group)
        orthogonal = self.orthogonalize(full.view(target.shape), target).reshape(-1)
        if p is not None:
            p.add_(orthogonal[target.lo:target.hi], alpha=-group["lr"])

    def _update_dtensor(self, p, group, target: MuonTarget) -> None:
        """_update on an FSDP2 DTensor main (sharded over DP): decay and momentum per element on
        the shards, the update all-gathered, orthogonalised, this rank's shard applied."""
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.detach())
        if wd != 0.0:
            p.add_(p, alpha=-wd * lr)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - beta)
        update = p.grad.lerp(buf, beta) if self.nesterov else buf
        orthogonal = self.orthogonalize(update.full_tensor().view(target.shape), target)
        p.add_(distribute_tensor(orthogonal, p.device_mesh, p.placements, src_data_rank=None), alpha=-lr)

    def orthogonalize(self, update: torch.Tensor, target: MuonTarget) -> torch.Tensor:
        partition_dim = None if self.tp_mode == "blockwise" or target.tp_group is None else target.partition_dim
        if not (self.split_qkv and target.qkv_split):
            return self._scaled(update, partition_dim, target.tp_group)
        rows, cols = update.shape
        groups = rows // sum(target.qkv_split)
        parts = torch.split(update.view(groups, sum(target.qkv_split), cols), list(target.qkv_split), dim=1)
        done = [self._scaled(part.reshape(-1, cols), partition_dim, target.tp_group).view(groups, -1, cols)
                for part in parts]
        return torch.cat(done, dim=1).view(rows, cols)

    def _scaled(self, x: torch.Tensor, partition_dim: int | None, tp_group) -> torch.Tensor:
        size = [x.size(0), x.size(1)]
        bf16 = self.fp32_matmul_prec == "medium"
        if partition_dim is None:
            out = newton_schulz(x, self.steps, self.coefficient_type, bf16=bf16)
        else:
            tp = dist.get_world_size(tp_group)
            size[partition_dim] *= tp
            if self.tp_mode == "duplicated":
                shards = [torch.empty_like(x) for _ in range(tp)]
                dist.all_gather(shards, x.contiguous(), group=tp_group)
                full = newton_schulz(torch.cat(shards, dim=partition_dim), self.steps, self.coefficient_type, bf16=bf16)
                out = full.chunk(tp, dim=partition_dim)[dist.get_rank(tp_group)]
            else:
                out = newton_schulz(x, self.steps, self.coefficient_type, transpose=partition_dim == 0,
                                    tp_group=tp_group, bf16=bf16)
        return out * muon_scale(size[0], size[1], self.scale_mode) * self.extra_scale_factor


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) with decoupled weight decay, as emerging-optimizers' Lion:
    p <- p - lr*wd*p; update = sign(lerp(m, g, 1 - beta1)); m <- lerp(m, g, 1 - beta2);
    p <- p - lr*update. State per tensor: "exp_avg"."""

    def __init__(self, params, *, lr: float, betas=(0.95, 0.98), weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                if group["weight_decay"] != 0.0:
                    p.add_(p, alpha=-group["weight_decay"] * group["lr"])
                update = torch.sign(state["exp_avg"].lerp(p.grad, 1 - beta1))
                state["exp_avg"].lerp_(p.grad, 1 - beta2)
                p.add_(update, alpha=-group["lr"])


def is_muon_param(name: str, param, embedding_or_output: bool) -> bool:
    """Megatron's split (emerging_optimizers._is_nonlinear_or_embedding): Muon takes every 2-D
    weight that is not the word embedding or the output layer; biases, norms, embeddings, the
    output layer (and any non-2-D weight) go to the scalar optimizer."""
    return param.ndim == 2 and not embedding_or_output
