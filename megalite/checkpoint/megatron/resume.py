"""A full resume from a Megatron-LM checkpoint: its optimizer state into megalite's optimizer
(plain or distributed, any TP x PP x DP: megalite reshards by parameter name), its
opt_param_scheduler into megalite's learning-rate schedule, and its RNG states when the run
has the checkpoint's TP x PP layout, with Megatron's rules:

  - nothing of the optimizer, scheduler or RNG from a `release` checkpoint, with --finetune, or
    (optimizer and scheduler) with --no-load-optim, or (RNG) with --no-load-rng;
  - the schedule must be this run's unless --override-opt_param-scheduler (this run's, its step
    count set to the consumed samples) or --use-checkpoint-opt_param-scheduler (the checkpoint's);
  - RNG states under another (TP, PP) layout are ignored, saying so in one line.

Layouts megalite cannot read are refused when the checkpoint is opened (optimizer.py),
before anything is built.
"""

import random

import numpy as np
import torch

from megalite.checkpoint.megatron.optimizer import MegatronOptimizerState, refuse
from megalite.checkpoint.publish import ConversionError
from megalite.model.weights import source_name
from megalite.parallel import comm
from megalite.parallel.sharding import param_shard_of_full
from megalite.checkpoint.dcp.format import VOCAB_PARAMS, CheckpointError
from megalite.config.run import DECAY_STYLES, WSD_DECAY_STYLES


def open_optimizer_state(ckpt, source) -> MegatronOptimizerState:
    """The checkpoint's optimizer state, checked readable and of this run's optimizer."""
    state = MegatronOptimizerState(source)
    if state.kind != ckpt.optimizer:
        refuse(state.where, f"the optimizer state is for {state.kind!r}, this run uses --optimizer {ckpt.optimizer}")
    return state


def load_optimizer(state: MegatronOptimizerState, chunks, optimizer) -> list[str]:
    """Every parameter's main value and optimizer states, this rank's shard of each, into
    `optimizer`; the lines to print (settings the checkpoint's optimizer had otherwise)."""
    keys = ("param", *state.keys) if state.step > 0 else ("param",)
    params = {}
    for model in chunks:
        rank, world = comm.group_rank(model.tp_group), comm.group_size(model.tp_group)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            src, entry = source_name(model, name), {}
            for key in keys:
                try:
                    full = state.get(src, key)
                except ConversionError as e:
                    refuse(state.where, str(e))
                if src in VOCAB_PARAMS and full.shape[0] < model.padded_vocab:
                    full = torch.cat([full, full.new_zeros(model.padded_vocab - full.shape[0], *full.shape[1:])])
                entry[key] = param_shard_of_full(param, full, rank, world).to(torch.float32)
            params[name] = entry
    try:
        optimizer.load_state_dict({"optimizer": state.kind, "step": state.step, "params": params,
                                   "loss_scaler": state.grad_scaler})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{state.where}: optimizer state does not fit this run ({e})") from e
    saved, mine = state.hyperparameters, optimizer.param_groups[0]
    return [f"the checkpoint's optimizer had {key} = {saved[key]!r}; megalite keeps this run's {mine[key]!r}"
            for key in ("betas", "eps", "momentum") if key in saved and key in mine and tuple(
                np.atleast_1d(saved[key])) != tuple(np.atleast_1d(mine[key]))]


def scheduler_state(state: MegatronOptimizerState, scheduler, ckpt, consumed_samples: int) -> dict:
    """Megatron's opt_param_scheduler as megalite's LRScheduler state (Megatron stores neither
    --lr-warmup-init nor the WSD settings: this run's), after Megatron's weight-decay checks."""
    saved = state.scheduler
    if not isinstance(saved, dict):
        refuse(state.where, "no 'opt_param_scheduler' entry")

    def value(*names):
        found = next((saved[n] for n in names if n in saved), None)
        if found is None:
            refuse(state.where, f"the opt_param_scheduler has no {names[0]!r}")
        return found

    style = value("lr_decay_style", "decay_style")
    if style not in DECAY_STYLES:
        refuse(state.where, f"the opt_param_scheduler's decay style {style!r} is not one of megalite's {DECAY_STYLES}")
    _check_weight_decay(saved, scheduler, ckpt, state.where)
    num_steps = int(value("num_steps", "num_iters"))
    if ckpt.override_opt_param_scheduler:
        num_steps = consumed_samples  # Megatron re-derives the step from the samples consumed
    return {"num_steps": num_steps, "max_lr": float(value("max_lr", "start_lr")), "min_lr": float(value("min_lr")),
            "init_lr": scheduler.init_lr, "warmup_steps": value("lr_warmup_steps", "warmup_steps", "warmup_iter"),
            "decay_steps": value("lr_decay_steps", "decay_steps", "end_iter"), "decay_style_id": DECAY_STYLES.index(style),
            "wsd_decay_steps": scheduler.wsd_decay_steps or 0,
            "wsd_decay_style_id": WSD_DECAY_STYLES.index(scheduler.wsd_decay_style)}


def _check_weight_decay(saved: dict, scheduler, ckpt, where) -> None:
    """Megatron's scheduler also holds the weight decay (start_wd to end_wd); megalite's is
    constant: the checkpoint's must be this run's --weight-decay, unless overridden or taken."""
    if "start_wd" not in saved or ckpt.override_opt_param_scheduler:
        return
    start, end = float(saved["start_wd"]), float(saved["end_wd"])
    if ckpt.use_checkpoint_opt_param_scheduler:
        if start != end:
            raise CheckpointError(f"{where}: the checkpoint's weight decay goes from {start} to {end}; megalite's is "
                                  "constant (pass --override-opt_param-scheduler to keep this run's --weight-decay)")
        for group in scheduler.optimizer.param_groups:
            group["weight_decay"] = end * group.get("wd_mult", 1.0)
    elif start != ckpt.weight_decay or end != ckpt.weight_decay:
        raise CheckpointError(f"{where}: the checkpoint's weight decay is {start} to {end} but this run has "
                              f"--weight-decay {ckpt.weight_decay} (pass --override-opt_param-scheduler to keep this "
                              "run's schedule, or --use-checkpoint-opt_param-scheduler to take the checkpoint's)")


def restore_rng(source, pstate, tracker) -> str | None:
    """Megatron's RNG states of this rank, when the run has the checkpoint's (TP, PP); the line
    to print (why they were skipped, or what was not restored), or None."""
    ns = source.args
    saved_layout = (getattr(ns, "tensor_model_parallel_size", 1) or 1, getattr(ns, "pipeline_model_parallel_size", 1) or 1)
    if (saved_layout[0], saved_layout[1]) != (pstate.tp_size, pstate.pp_size):
        return (f"(TP, PP) mismatch after resume ({(pstate.tp_size, pstate.pp_size)} vs {saved_layout} from "
                "checkpoint): RNG state will be ignored")
    if source.format == "torch":
        states = source.files.states[(pstate.tp_rank, pstate.pp_rank)].get("rng_state")
        where = source.files.paths[(pstate.tp_rank, pstate.pp_rank)]
    else:
        key = f"rng_state/shard_{pstate.pp_rank}.{pstate.tp_rank}_{saved_layout[1]}.{saved_layout[0]}"
        states, where = source.files.stored_object(key), source.path
    if not states:
        return f"{where}: no RNG states in the checkpoint; megalite seeds from --seed"
    state = states[0]  # one per DP rank only with Megatron's --data-parallel-random-init, which megalite lacks
    try:
        version, internal, gauss = state["random_rng_state"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        device = tracker.device if tracker is not None else torch.device("cpu")
        if device.type != "cuda":
            return "restored Megatron's Python, NumPy and torch CPU RNG states; its CUDA ones are not used on CPU"
        torch.cuda.set_rng_state(state["cuda_rng_state"], device)
        if state.get("rng_tracker_states") and tracker is not None:
            tracker.set_states(dict(state["rng_tracker_states"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where}: unreadable RNG state ({e})") from None
    return None
