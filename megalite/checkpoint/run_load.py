"""--load for a training run, whatever wrote the checkpoint: megalite (DCP, torch_dist) or
Megatron-LM (torch or torch_dist), with Megatron's checkpoint policies: --ckpt-format and
--auto-detect-ckpt-format, --ckpt-step, --pretrained-checkpoint, --use-checkpoint-args,
--dist-ckpt-strictness, the scheduler flags, and --save-retain-interval's pruning.

A Megatron checkpoint is read with megalite.checkpoint.megatron.reader: every rank reads the full
tensors of its own parameters and keeps its TP slice; its optimizer state, schedule and RNG
states follow Megatron's rules (megatron/resume.py): a full resume where the layout is
readable, a refusal naming the file otherwise.
"""

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import torch

from megalite.checkpoint.megatron.safe_pickle import safe_torch_load
from megalite.checkpoint.megatron.reader import MegatronCheckpoint, megatron_format, megatron_iteration_dir
from megalite.checkpoint.publish import ConversionError
from megalite.model.weights import load_full_weights
from megalite.checkpoint.dcp.format import VOCAB_PARAMS, CheckpointError
from megalite.checkpoint.dcp.checkpoint import (TRACKER, load_checkpoint, load_optimizer_state,
                                                 published_iteration_dir, read_tracker)
from megalite.checkpoint.dcp.integrity import verify_integrity_manifest
from megalite.checkpoint.model_match import check_model_matches, stored_model_config
from megalite.checkpoint.megatron.resume import load_optimizer, open_optimizer_state, restore_rng, scheduler_state

log = logging.getLogger(__name__)

def checkpoint_args_of(load_dir) -> dict | None:
    """The arguments stored with the checkpoint under `load_dir` (Megatron's Namespace or
    megalite's common.json args) as a dict, or None when there is none."""
    found = megatron_iteration_dir(load_dir)
    if found is not None:
        folder = found[0]
        path = folder / "common.pt" if (folder / "metadata.json").exists() else next(
            p / "model_optim_rng.pt" for p in sorted(folder.iterdir()) if p.name.startswith("mp_rank_"))
        ns = safe_torch_load(path).get("args")
        return dict(vars(ns)) if ns is not None else None
    iteration = read_tracker(load_dir)
    if iteration is None:
        return None
    common = Path(load_dir) / f"iter_{iteration:07d}" / "common.json"
    return json.loads(common.read_text()).get("args") if common.exists() else None


def check_format(ckpt, load_dir, iteration=None) -> str | None:
    """The format of the checkpoint under `load_dir` ('torch' or 'torch_dist'; None when there
    is none), refused when it is not --ckpt-format and --auto-detect-ckpt-format is not set."""
    found = megatron_format(load_dir, iteration)
    if found is None:
        found = "torch_dist" if (Path(load_dir) / TRACKER).is_file() else None
    wanted = "torch_dist" if ckpt.ckpt_format == "dcp" else ckpt.ckpt_format
    if found is not None and found != wanted and not ckpt.auto_detect_ckpt_format:
        raise CheckpointError(f"--ckpt-format {ckpt.ckpt_format}: the checkpoint under {load_dir} is in {found} "
                              "format (pass --auto-detect-ckpt-format or --ckpt-format " + found + ")")
    return found


def check_unexpected(unused: list[str], strictness: str, where) -> None:
    """--dist-ckpt-strictness for stored model tensors the model has no place for."""
    if not unused:
        return
    message = f"{where}: tensor {unused[0]} has no place in the model" + (
        f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
    if strictness.startswith("raise_"):
        raise CheckpointError(message + " (--dist-ckpt-strictness " + strictness + ")")
    if strictness.startswith("log_"):
        log.warning("%s; not loaded", message)


def _plain_config(config) -> dict:
    """A GPTConfig as a checkpoint's model_config holds it (JSON's view)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def load_megatron(ckpt, load_dir, chunks, pstate, iteration=None, tracker=None) -> dict:
    """Load a Megatron checkpoint's weights (and RNG states) into `chunks`; its common state as
    megalite's load_checkpoint returns it, with the optimizer state still to load
    ("megatron_optimizer"; None: not to be loaded)."""
    vocab = chunks[0].config.vocab_size
    try:
        source = MegatronCheckpoint(load_dir, vocab_size=vocab, iteration=iteration)
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    notes = check_model_matches(_plain_config(source.config), chunks[0].config, source.path, new_run=ckpt.finetune)
    if pstate.rank == 0:
        for note in notes:
            print(note, flush=True)
    release = source.path.name == "release"  # Megatron takes only the weights of a release checkpoint
    optimizer_state = None
    if not (ckpt.finetune or ckpt.no_load_optim or release or ckpt.skip_train):
        optimizer_state = open_optimizer_state(ckpt, source)  # refuses unreadable layouts before any work
    for model in chunks:
        def full(name, model=model):
            tensor = source.get(name)
            if name in VOCAB_PARAMS and tensor.shape[0] < model.padded_vocab:
                tensor = torch.cat([tensor, tensor.new_zeros(model.padded_vocab - tensor.shape[0], *tensor.shape[1:])])
            return tensor
        try:
            load_full_weights(model, full)
        except (ValueError, ConversionError) as e:
            raise CheckpointError(f"{source.path}: {e}") from None
    check_unexpected(source.unused(), ckpt.dist_ckpt_strictness, source.path)
    rng_note = None
    if not (ckpt.finetune or ckpt.no_load_rng or release or getattr(source.args, "no_save_rng", False)):
        rng_note = restore_rng(source, pstate, tracker)
    iteration = 0 if release else source.iteration
    if pstate.rank == 0:
        what = ("weights only: a release checkpoint" if release else "with its optimizer state"
                if optimizer_state is not None else "weights")
        print(f"loaded Megatron {source.format} checkpoint {source.path} (iteration {iteration}, {what})", flush=True)
        if rng_note:
            print(rng_note, flush=True)
    ns = source.args
    return {"path": str(source.path), "iteration": iteration,
            "consumed_train_samples": int(getattr(ns, "consumed_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(ns, "consumed_valid_samples", 0) or 0),
            "megatron_format": source.format, "megatron_optimizer": optimizer_state}


def resume_optimizer(common: dict, ckpt, *, chunks, optimizer, scheduler, pstate) -> None:
    """The optimizer state and learning-rate schedule of the checkpoint `load_for_run` loaded
    (megalite's or Megatron's), unless --no-load-optim or --finetune; call after building the
    optimizer (its fp32 main parameters start from the loaded weights)."""
    if "megatron_format" not in common:
        load_optimizer_state(common, chunks=chunks, optimizer=optimizer, pstate=pstate)
        restore_scheduler(scheduler, common["lr_scheduler"], ckpt)
        return
    state = common["megatron_optimizer"]
    if state is None:
        return
    notes = load_optimizer(state, chunks, optimizer)
    restore_scheduler(scheduler, scheduler_state(state, scheduler, ckpt, common["consumed_train_samples"]), ckpt)
    if pstate.rank == 0:
        for note in notes:
            print(note, flush=True)


def non_persistent_dir(ckpt) -> Path | None:
    """Where --non-persistent-save-interval's checkpoints go: --non-persistent-local-ckpt-dir
    (local), --non-persistent-global-ckpt-dir or <save>/non_persistent (global)."""
    if ckpt.non_persistent_save_interval is None:
        return None
    if ckpt.non_persistent_ckpt_type == "local":
        return Path(ckpt.non_persistent_local_ckpt_dir)
    return Path(ckpt.non_persistent_global_ckpt_dir or Path(ckpt.save) / "non_persistent")


def _newest_load_dir(ckpt):
    """--load, or the non-persistent checkpoint directory when its latest iteration is newer
    (Megatron resumes from whichever is more recent)."""
    other = non_persistent_dir(ckpt)
    if ckpt.ckpt_step is not None or other is None or not (other / TRACKER).is_file():
        return ckpt.load
    mine = read_tracker(ckpt.load) if ckpt.load and (Path(ckpt.load) / TRACKER).is_file() else None
    return str(other) if mine is None or read_tracker(other) > mine else ckpt.load


def load_for_run(ckpt, chunks, pstate, tracker) -> dict | None:
    """What build_run loads: --load (at --ckpt-step; or a newer non-persistent checkpoint),
    else --pretrained-checkpoint (weights only, marked "finetune"); None when neither holds a
    checkpoint."""
    for load_dir, pretrained in ((_newest_load_dir(ckpt), False), (ckpt.pretrained_checkpoint, True)):
        if not load_dir or not (Path(load_dir) / TRACKER).is_file():
            continue
        iteration = None if pretrained else ckpt.ckpt_step
        if ckpt.verify_integrity:
            _verify_integrity(load_dir, iteration, pstate)
        if megatron_iteration_dir(load_dir, iteration) is not None:
            check_format(ckpt, load_dir, iteration)
            common = load_megatron(dataclasses.replace(ckpt, finetune=ckpt.finetune or pretrained), load_dir, chunks,
                                   pstate, iteration, tracker)
        else:
            check_format(ckpt, load_dir, iteration)
            notes = check_model_matches(stored_model_config(load_dir, iteration), chunks[0].config, load_dir,
                                        new_run=ckpt.finetune or pretrained)
            if pstate.rank == 0:
                for note in notes:
                    print(note, flush=True)
            no_rng = ckpt.no_load_rng or ckpt.finetune or pretrained
            common = load_checkpoint(load_dir, chunks=chunks, pstate=pstate, rng_tracker=tracker, load_rng=not no_rng,
                                     fallback=ckpt.ckpt_fallback_to_previous and iteration is None, iteration=iteration)
        if common is not None:
            return {**common, "finetune": pretrained}
    return None


def _verify_integrity(load_dir, iteration, pstate) -> None:
    """--verify-integrity before anything is read: rank 0 checks the checkpoint directory's
    integrity.json (Megatron's or megalite's) and every rank gets its verdict (Megatron's
    verify_integrity_manifest)."""
    import torch.distributed as dist

    found = megatron_iteration_dir(load_dir, iteration)
    folder = found[0] if found is not None else published_iteration_dir(
        load_dir, read_tracker(load_dir) if iteration is None else iteration)
    verdict = [None]
    if pstate.rank == 0:
        try:
            count = verify_integrity_manifest(folder)
            print(f"--verify-integrity: {count} file(s) of {folder} match integrity.json", flush=True)
        except CheckpointError as error:
            verdict = [str(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


def restore_scheduler(scheduler, state: dict, ckpt) -> None:
    """The learning-rate schedule from a checkpoint: the same schedule required (Megatron's
    default), this run's (--override-opt_param-scheduler) or the checkpoint's
    (--use-checkpoint-opt_param-scheduler)."""
    if ckpt.use_checkpoint_opt_param_scheduler:
        from megalite.config.run import DECAY_STYLES, WSD_DECAY_STYLES

        scheduler.max_lr, scheduler.min_lr, scheduler.init_lr = state["max_lr"], state["min_lr"], state["init_lr"]
        scheduler.warmup_steps, scheduler.decay_steps = state["warmup_steps"], state["decay_steps"]
        scheduler.decay_style = DECAY_STYLES[state["decay_style_id"]]
        scheduler.wsd_decay_steps = state["wsd_decay_steps"] or None
        scheduler.wsd_decay_style = WSD_DECAY_STYLES[state["wsd_decay_style_id"]]
    try:
        scheduler.load_state_dict(state, strict=not (ckpt.override_opt_param_scheduler
                                                     or ckpt.use_checkpoint_opt_param_scheduler))
    except ValueError as e:
        raise CheckpointError(f"{e} (pass --override-opt_param-scheduler to keep this run's schedule, or "
                              "--use-checkpoint-opt_param-scheduler to take the checkpoint's)") from None


def prune_checkpoints(root, retain_interval: int | None) -> list[Path]:
    """--save-retain-interval: delete iter_* folders whose iteration is not a multiple of
    `retain_interval` (None: every one), except the latest; the folders deleted."""
    root = Path(root)
    latest = read_tracker(root)
    removed = []
    for path in sorted(root.glob("iter_*")):
        match = re.fullmatch(r"iter_(\d{7})", path.name)
        if match and int(match.group(1)) != latest and (retain_interval is None or int(match.group(1)) % retain_interval):
            shutil.rmtree(path)
            removed.append(path)
    return removed
