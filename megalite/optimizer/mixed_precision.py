"""The optimizer: fp32 main parameters behind 16-bit (or fp32) model parameters, fp16 loss
scaling, global-norm gradient clipping, weight-decay groups, Adam or SGD, optionally sharded
over DP x CP (the distributed optimizer) or over FSDP2 shards.

    optimizer = build_optimizer(chunks, pstate, lr=3e-4, bf16=True, use_distributed_optimizer=True)
    optimizer.zero_grad()
    ...backward of optimizer.scale_loss(loss) per micro-batch, finalize_model_grads(...)...
    ok, grad_norm, num_zeros = optimizer.step()

A step: copy 16-bit gradients to fp32 (if any); with fp16, unscale and skip the step if any
rank found inf/NaN; clip to the global norm; update; copy the fp32 main values back into the
model parameters (all-gathering them under the distributed optimizer). With
--overlap-param-gather-with-optimizer-step the first model chunk is updated first and its
all-gather runs while the other chunks are updated.
"""

import logging
import math

import torch
import torch.distributed as dist

from megalite.optimizer.distributed import build_bucket_shards, fsdp_main_params, gather_full, norm_group, sharded_dp_group
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.sharded_state import ShardedOptimizerState
from megalite.parallel import comm
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import FSDPChunk
from megalite.parallel.state import ParallelState

logger = logging.getLogger(__name__)

_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def no_weight_decay(name: str, param, decay_qk_layernorm: bool = False) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed; with `decay_qk_layernorm`
    (--apply-wd-to-qk-layernorm) the q/k layernorm weights are, as Megatron's Qwen3-Next rule."""
    if decay_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    return param.ndim == 1 or name.endswith(".bias")


class MixedPrecisionOptimizer(ShardedOptimizerState):
    """See the module docstring; build it with `build_optimizer`."""

    def __init__(self, chunks, pstate: ParallelState, *, kind: str, make_inner, clip_grad: float,
                 loss_scaler, weight_decay: float, overlap_param_gather: bool, cpu_offload: bool,
                 log_num_zeros_in_grad: bool = False, param_gather_with_step: bool = False,
                 decay_qk_layernorm: bool = False):
        self.chunks, self.pstate, self.kind = list(chunks), pstate, kind
        self.param_gather_with_step = param_gather_with_step
        self.clip_grad, self.loss_scaler = clip_grad, loss_scaler
        self.overlap_param_gather, self.cpu_offload = overlap_param_gather, cpu_offload
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.num_steps = 0  # successful steps: Adam's step count
        self.num_attempts = 0  # step() calls in this process, skipped ones included
        # why the last step() skipped its update: None (it did not), "overflow" (fp16's dynamic
        # loss scale overflowed: expected, the scale comes down) or "non-finite" (NaN / Inf
        # gradients under a static --loss-scale or without loss scaling: a fault)
        self.skip_reason: str | None = None
        self.bucket_shards, self.mains, self._shards_of, phase_of = [], [], {}, {}
        for index, chunk in enumerate(self.chunks):
            if isinstance(chunk, DistributedDataParallel):
                self._shards_of[chunk] = shards = build_bucket_shards(chunk, pstate.tp_rank, cpu_offload)
                self.bucket_shards += shards
                mains = [m for shard in shards for m in shard.mains]
            else:
                mains = fsdp_main_params(chunk, pstate.tp_rank)
            self.mains += mains
            # the update phase of a main parameter: the first chunk's go first (see _update)
            phase_of.update({id(m.main): int(param_gather_with_step and index > 0) for m in mains})
        # From the configuration, not from this rank's shards: a rank may own none at all.
        self.sharded_over_dp = pstate.dp_size * pstate.cp_size > 1 and any(
            isinstance(c, FSDPChunk) or c.use_distributed_optimizer for c in self.chunks)
        self.comm_device = next(p for c in self.chunks for p in c.module.parameters()).device
        groups = []
        for phase in sorted(set(phase_of.values())) or [0]:
            mains = [m for m in self.mains if phase_of[id(m.main)] == phase]
            decay = [m.main for m in mains if not no_weight_decay(m.name, m.param, decay_qk_layernorm)]
            plain = [m.main for m in mains if no_weight_decay(m.name, m.param, decay_qk_layernorm)]
            groups += [{"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay, "phase": phase},
                       {"params": plain, "wd_mult": 0.0, "weight_decay": 0.0, "phase": phase}]
        self.inner = make_inner(groups)

    # --- what the training loop uses -------------------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    @torch.no_grad()
    def step(self, iteration: int | None = None) -> tuple[bool, float | None, int | None]:
        """(update_successful, global grad norm, number of zero gradient elements or None).

        `iteration` (the training loop's, counting skipped steps) only names the step in the
        fp16 skip message; without it, the count of step() calls in this process is used. A
        skipped step says why in `skip_reason`."""
        self.num_attempts += 1
        self.skip_reason = None
        for shard in self.bucket_shards:
            shard.load_grads()
        if self.loss_scaler is not None:
            found_inf = self._unscale_and_find_inf()
            self.loss_scaler.update(found_inf)
            if found_inf:
                # a dynamic scale expects overflows and lowers itself; a static one cannot react
                dynamic = isinstance(self.loss_scaler, DynamicLossScaler)
                self.skip_reason = "overflow" if dynamic else "non-finite"
                logger.warning("fp16: inf/NaN in the gradients on some rank, skipping this step "
                               "(iteration %d); loss scale is %s %g", iteration or self.num_attempts,
                               "now" if dynamic else "fixed at", self.loss_scaler.scale)
                return False, None, None
        grad_norm = self.global_grad_norm()
        if not math.isfinite(grad_norm):  # every rank sees the same global norm: all skip together
            self.skip_reason = "non-finite"
            logger.warning("inf/NaN in the gradients (norm %s), skipping this step (iteration %d)", grad_norm,
                           iteration or self.num_attempts)
            return False, grad_norm, None
        if self.clip_grad > 0:
            coeff = self.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(self._grads(), coeff)
        num_zeros = self._count_zeros() if self.log_num_zeros_in_grad else None
        self._update()
        self.num_steps += 1
        return True, grad_norm, num_zeros

    def _update(self) -> None:
        """The update and the parameters' all-gather. With param_gather_with_step, in two phases:
        the first chunk's parameters, whose all-gather is launched at once, then the others'
        while it runs (Megatron: ChainedOptimizer._step dispatches model_chunks[0]'s
        start_param_sync(force_dispatch=True) right after the first chunk's optimizer steps).
        Each phase steps the inner optimizer over its own param groups; Adam is per element, so
        the result is the one-phase update's."""
        if not self.param_gather_with_step:
            self.inner.step()
            self._store_params(self.chunks)
            return
        groups = self.inner.param_groups
        try:
            for phase, chunks in ((0, self.chunks[:1]), (1, self.chunks[1:])):
                self.inner.param_groups = [g for g in groups if g["phase"] == phase]
                self.inner.step()
                self._store_params(chunks, overlap=True)
        finally:
            self.inner.param_groups = groups

    def finish_param_sync(self) -> None:
        """Wait for parameter all-gathers still in flight (--overlap-param-gather): call before
        reading the model's parameters outside a forward pass (e.g. to save them)."""
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.finish_param_sync()

    # --- internals ----------------------------------------------------------------------------
    def _grads(self, counted_only: bool = False) -> list[torch.Tensor]:
        return [g for m in self.mains if (m.counted or not counted_only) and (g := m.grad()) is not None]

    def _norm_group(self):
        """Ranks holding distinct gradients, each counted once (see norm_group)."""
        return norm_group(self.pstate, self.sharded_over_dp)

    def _unscale_and_find_inf(self) -> bool:
        grads = self._grads()
        found = torch.zeros(1, device=self.comm_device)
        for device in {g.device for g in grads}:
            found_here = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [g for g in grads if g.device == device], found_here,
                torch.full((1,), 1.0 / self.loss_scaler.scale, device=device))
            found += found_here.to(self.comm_device)
        if comm.group_size(self.pstate.world_group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.pstate.world_group)
        return found.item() > 0

    def global_grad_norm(self) -> float:
        """L2 norm of the gradients of the whole model over all ranks, each parameter once."""
        grads = self._grads(counted_only=True)
        total = torch.zeros((), dtype=torch.float32, device=self.comm_device)
        for device in {g.device for g in grads}:
            norms = torch._foreach_norm([g for g in grads if g.device == device])
            total += torch.stack([n.float() for n in norms]).square().sum().to(self.comm_device)
        comm.all_reduce(total, self._norm_group())
        return total.sqrt().item()

    @torch.no_grad()
    def params_norm(self) -> float:
        """Megatron's "params norm": the L2 norm of the fp32 main parameters of the whole model
        over all ranks, each element once as in `global_grad_norm` (MainParam.counted; sharded
        over DP x CP, each rank adds its own shard), summed in float64. A collective."""
        total = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        for m in self.mains:
            if m.counted:
                main = m.main.to_local() if hasattr(m.main, "to_local") else m.main
                total += main.detach().double().square().sum().to(self.comm_device)
        comm.all_reduce(total, self._norm_group())
        return total.sqrt().item()

    def _count_zeros(self) -> int:
        total = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        for g in self._grads(counted_only=True):
            total += (g.numel() - torch.count_nonzero(g)).to(self.comm_device, torch.float64)
        comm.all_reduce(total, self._norm_group())
        return int(total.item())

    def _store_params(self, chunks, overlap: bool = False) -> None:
        for chunk in chunks:
            for shard in self._shards_of.get(chunk, ()):
                shard.store_params()
            if isinstance(chunk, DistributedDataParallel) and chunk.use_distributed_optimizer:
                chunk.start_param_sync(overlap=overlap or self.overlap_param_gather)

    # --- checkpointing ------------------------------------------------------------------------
    def _named_params(self):
        """(chunk, name, param, MainParam or None) for every trainable parameter, same order on
        every rank of a DP group."""
        by_param = {m.param: m for m in self.mains}
        seen = set()
        for chunk in self.chunks:
            for name, param in chunk.module.named_parameters():
                if not param.requires_grad:
                    continue
                if name in seen:
                    raise ValueError(f"optimizer: parameter name {name!r} appears in two model chunks")
                seen.add(name)
                yield chunk, name, param, by_param.get(param)

    def _state_keys(self) -> tuple:
        if self.num_steps == 0 or (self.kind == "sgd" and not self.inner.defaults["momentum"]):
            return ()
        return _STATE_KEYS[self.kind]

    def _header(self, params: dict) -> dict:
        return {"optimizer": self.kind, "step": self.num_steps, "params": params,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def _values(self, entry) -> dict:
        """"param" and every optimizer state of one parameter: this rank's tensors (or Nones)."""
        values = {"param": entry.main if entry else None}
        for key in self._state_keys():
            values[key] = self.inner.state[entry.main][key] if entry else None
        return values

    def _start_load(self, state: dict) -> tuple:
        """Check the optimizer kind and take the step count; the keys every entry must hold."""
        if state.get("optimizer") != self.kind:
            raise ValueError(f"optimizer state is for {state.get('optimizer')!r}, this run uses {self.kind!r}")
        self.num_steps = int(state["step"])
        return ("param", *self._state_keys())

    def _saved_entries(self, state: dict, keys: tuple):
        """_named_params with each parameter's saved entry, checked to hold every key."""
        for chunk, name, param, entry in self._named_params():
            saved = state["params"].get(name)
            if saved is None:
                raise KeyError(f"optimizer state has no entry for parameter {name}")
            for key in keys:
                if saved.get(key) is None:
                    raise KeyError(f"optimizer state for {name} lacks {key!r}")
            yield chunk, name, param, entry, saved

    def _set_state(self, main, states: dict) -> None:
        """The loaded optimizer states of one main parameter (none before the first step)."""
        if states:
            self.inner.state[main] = {**states, **self._step_state(main)}

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Per parameter name, the fp32 main value and optimizer states as CPU tensors of this
        rank's TP-shard shape (gathered over DP x CP one parameter at a time under the distributed
        optimizer), plus the step count and loss-scaler state. Checkpoints use the sharded form
        (sharded_state_dict); this one, with load_state_dict, is the tests' layout-independent
        oracle: the same tensors whatever the DP size, distributed optimizer or FSDP2."""
        self.finish_param_sync()
        params = {}
        for chunk, name, param, entry in self._named_params():
            values = self._values(entry)
            if isinstance(chunk, FSDPChunk):
                params[name] = {k: v.full_tensor().to("cpu", torch.float32) for k, v in values.items()}
            else:
                group = sharded_dp_group(chunk, param)
                params[name] = {k: gather_full(param, entry, v, group) for k, v in values.items()}
        return self._header(params)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load the form `state_dict` returns, keeping this rank's DP x CP slice of every tensor (tests)."""
        keys = self._start_load(state)
        for chunk, name, param, entry, saved in self._saved_entries(state, keys):
            for key in keys:
                if tuple(saved[key].shape) != tuple(param.shape):
                    raise ValueError(f"optimizer state {name}.{key}: shape {tuple(saved[key].shape)}, "
                                     f"this rank's parameter is {tuple(param.shape)}")
            if entry is None:
                continue
            if isinstance(chunk, FSDPChunk):
                local = {k: chunk.shard_like(entry.main, saved[k]) for k in keys}
                entry.main.to_local().copy_(local.pop("param").to_local())
            else:
                local = {k: saved[k].reshape(-1)[entry.lo:entry.hi].to(entry.main.device, torch.float32, copy=True)
                         for k in keys}
                entry.main.copy_(local.pop("param"))
            self._set_state(entry.main, local)
        self._finish_load(state)

    def _finish_load(self, state: dict) -> None:
        """Loss scaler, then the loaded main values into the model parameters (all ranks)."""
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for shard in self.bucket_shards:
            shard.store_params()
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel) and chunk.use_distributed_optimizer:
                chunk.start_param_sync(overlap=False)

    def _step_state(self, main) -> dict:
        if self.kind != "adam":
            return {}
        on_device = self.inner.defaults.get("fused") or self.inner.defaults.get("capturable")
        return {"step": torch.tensor(float(self.num_steps), dtype=torch.float32,
                                     device=main.device if on_device else "cpu")}


def check_chunks(who: str, chunks, use_distributed_optimizer: bool, expected: torch.dtype, precision: str) -> None:
    """Each chunk is megalite's DistributedDataParallel, wrapped for this optimizer's kind (distributed
    or not) with parameters of `expected` dtype, or an FSDPChunk (apply_fsdp2); else one line naming
    `who` and what differs."""
    for chunk in chunks:
        if not isinstance(chunk, (DistributedDataParallel, FSDPChunk)):
            raise TypeError(f"{who}: chunk {type(chunk).__name__} is neither megalite "
                            "DistributedDataParallel nor FSDPChunk (apply_fsdp2)")
        if isinstance(chunk, DistributedDataParallel):
            if chunk.use_distributed_optimizer != use_distributed_optimizer:
                raise ValueError(f"{who}: use_distributed_optimizer={use_distributed_optimizer} but the "
                                 f"chunk was wrapped with use_distributed_optimizer={chunk.use_distributed_optimizer}")
            wrong = {b.param_dtype for b in chunk.buffers_} - {expected}
            if wrong:
                raise ValueError(f"{who}: model parameters are {sorted(map(str, wrong))}, expected "
                                 f"{expected} for {precision}")


def build_optimizer(ddp_chunks, pstate: ParallelState, *, optimizer: str = "adam", lr: float,
                    weight_decay: float = 0.01, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                    adam_eps: float = 1e-8, sgd_momentum: float = 0.9, clip_grad: float = 1.0,
                    fp16: bool = False, bf16: bool = False, loss_scale: float | None = None,
                    initial_loss_scale: float = 2.0**32, min_loss_scale: float = 1.0,
                    loss_scale_window: int = 1000, hysteresis: int = 2,
                    use_distributed_optimizer: bool = False, overlap_param_gather: bool = False,
                    cpu_offload: bool = False, log_num_zeros_in_grad: bool = False,
                    overlap_param_gather_with_optimizer_step: bool = False,
                    apply_wd_to_qk_layernorm: bool = False) -> MixedPrecisionOptimizer:
    """The optimizer over every chunk (DistributedDataParallel or FSDPChunk) of this rank.

    bf16 / fp16 say what the model parameters are (they must match the chunks'); the optimizer
    always keeps fp32 main parameters. fp16 adds loss scaling (`loss_scale` None: dynamic).
    `use_distributed_optimizer` must match how the DDP chunks were built."""
    if fp16 and bf16:
        raise ValueError("build_optimizer: --fp16 and --bf16 contradict each other")
    if optimizer not in _STATE_KEYS:
        raise ValueError(f"--optimizer must be one of {sorted(_STATE_KEYS)}, got {optimizer!r}")
    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    if cpu_offload and not use_distributed_optimizer:
        raise ValueError("--optimizer-cpu-offload needs --use-distributed-optimizer")
    if overlap_param_gather_with_optimizer_step and not overlap_param_gather:
        raise ValueError("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather")
    chunks = list(ddp_chunks)
    expected = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    check_chunks("build_optimizer", chunks, use_distributed_optimizer, expected, f"fp16={fp16} bf16={bf16}")
    scaler = None
    if fp16:
        scaler = ConstantLossScaler(loss_scale) if loss_scale is not None else DynamicLossScaler(
            initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
    params = [p for c in chunks for p in c.module.parameters()]
    on_cuda = bool(params) and params[0].is_cuda and not cpu_offload
    impl = {"fused": True} if on_cuda else {"foreach": True}

    def make_inner(groups):
        if optimizer == "adam":
            return torch.optim.AdamW(groups, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, **impl)
        return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum, foreach=True)

    return MixedPrecisionOptimizer(chunks, pstate, kind=optimizer, make_inner=make_inner, clip_grad=clip_grad,
                                   loss_scaler=scaler, weight_decay=weight_decay,
                                   overlap_param_gather=overlap_param_gather, cpu_offload=cpu_offload,
                                   log_num_zeros_in_grad=log_num_zeros_in_grad,
                                   param_gather_with_step=overlap_param_gather_with_optimizer_step,
                                   decay_qk_layernorm=apply_wd_to_qk_layernorm)
