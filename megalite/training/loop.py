"""The training loop: steps, logging, evaluation, checkpoints and every way a run stops.

A run stops, saving a checkpoint first when --save is given, at the end of training, at
--exit-interval, after --exit-duration-in-mins (counted from the earliest rank's process
start, as Megatron counts it), or on SIGTERM / SIGUSR1 (Slurm's warning before a time limit).
Ranks agree on stopping through one small all-reduce per iteration, so they always stop at the
same iteration.
"""

import math
import time

import torch
import torch.distributed as dist

from megalite.model.moe import reset_global_aux_loss_counts, set_loss_backward_scale, update_expert_bias
from megalite.model.mtp import auxiliary_losses
from megalite.model.offload import end_offload_step
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.checkpoint.dcp.checkpoint import save_checkpoint
from megalite.checkpoint.dcp.rng_state import layout_record
from megalite.checkpoint.run_load import non_persistent_dir, prune_checkpoints
from megalite.training.metrics import MetricsLogger, TrainingRecord, memory_usage_mb, throughput
from megalite.training.per_token_loss import scale_main_grads, token_factor
from megalite.training.rerun import WILL_RERUN_FROM_CHECKPOINT, RerunFault, RerunState, non_finite_gradients
from megalite.training.rerun_injection import ErrorInjector
from megalite.training.run_hooks import RunHooks
from megalite.training.setup_run import Run, build_data, data_iterator
from megalite.training.stop_signals import StopSignals, signal_name
from megalite.training.straggler import report_stragglers
from megalite.training.tensorboard_log import MegatronTensorboard
from megalite.training.test_mode import check_qk_layernorm_replicas
from megalite.training.timers import Timers

def agree(run: Run, values: list[float]) -> list[float]:
    """Element-wise maximum over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=run.device)
    if run.pstate.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _dp_mean(run: Run, loss: torch.Tensor | None) -> float | None:
    """The step's loss averaged over data-parallel replicas (last pipeline stage only)."""
    if loss is None:
        return None
    loss = loss.detach().float().clone()
    if run.pstate.dp_size > 1:
        dist.all_reduce(loss, group=run.pstate.dp_group)
        loss /= run.pstate.dp_size
    return loss.item()


def _take(iterator, count: int) -> list | None:
    """The next `count` micro-batches (None for a rank without data)."""
    if iterator is None:
        return None
    batches = []
    for batch in iterator:
        batches.append(batch)
        if len(batches) == count:
            return batches
    raise ValueError(f"the micro-batch iterator ended after {len(batches)} of {count} micro-batches")


def common_state(run: Run) -> dict:
    return {"consumed_train_samples": run.consumed_train_samples, "consumed_valid_samples": run.consumed_valid_samples,
            "lr_scheduler": run.scheduler.state_dict(), "args": run.config.options,
            "model_config": run.model_config.to_dict(), "tokenizer": run.config.data.tokenizer_record()}


class Trainer:
    def __init__(self, run: Run):
        cfg = run.config
        self.run, self.training, self.logging, self.ckpt = run, cfg.training, cfg.logging, cfg.checkpoint
        self.pending_save = None
        self.timers = Timers(self.logging.timing_log_level, run.device, self.logging.timing_log_option)
        self.logger = MetricsLogger.from_config(self.logging, cfg.options, run.writes_logs,
                                                resume_iteration=run.iteration if run.loaded_from else None)
        self.tensorboard = MegatronTensorboard(self.logging, run.writes_logs)
        self.batch_schedule = cfg.data.batch_schedule
        self.hooks = RunHooks(self.training, self.logging, run.pstate, run.device,
                              flops_per_sample=run.flops_per_token * self.training.seq_length,
                              resume_iteration=run.iteration if run.loaded_from and not self.ckpt.finetune else None)
        self.forward_backward_seconds = 0.0  # this rank's, over the log window (--log-straggler)
        training = self.training
        # Megatron draws from Python's random, seeded with --seed + 100 x the pipeline rank
        injector = ErrorInjector(training.error_injection_rate, training.error_injection_type, run.pstate.rank,
                                 training.seed + 100 * run.pstate.pp_rank)
        self.rerun = RerunState(training.rerun_mode, run.tracker, run.device, lambda v: agree(run, v), self.say,
                                rank=run.pstate.rank, injector=injector, log=lambda text: print(text, flush=True),
                                check_nan=training.check_for_nan_in_loss_and_grad)
        if run.loaded_from and not self.ckpt.finetune:  # (run.rerun_record is None after a pretrained load)
            self.rerun.load(run.rerun_record, run.pstate.world_size,
                            run.checkpoint_layout in (None, layout_record(run.pstate)))
        self.train_ds, self.valid_ds, self.test_ds = build_data(run)
        # Only the first and last pipeline stages build datasets; every rank must agree on which
        # splits exist, or the others would wait in the pipeline for a split that has no data.
        reads = run.pstate.is_first_stage or run.pstate.is_last_stage
        present = agree(run, [float(reads and ds is not None) for ds in (self.train_ds, self.valid_ds, self.test_ds)])
        self.has_split = dict(zip(("train", "valid", "test"), (p > 0 for p in present)))
        if self.training.total_train_iters > 0 and not self.has_split["train"]:
            raise ValueError(f"no training data: --split {self.training.split!r} (or --train-data-path) leaves the "
                             "training split without documents")
        # Background checkpoint writes get a process group of their own (see save_checkpoint).
        self.save_group = dist.new_group(backend="gloo") if self.ckpt.async_save else None
        # Every split's loader forks its workers now, before any checkpoint is written (see
        # data_iterator); the test split's too, though it is read only after the last save.
        self.valid_iter = self.data_iterator(self.valid_ds, run.consumed_valid_samples)
        self.test_iter = self.data_iterator(self.test_ds, 0) if self.training.eval_iters > 0 else None

    def close(self):
        """The end of the run: no checkpoint write or parameter all-gather left in flight, the
        writers closed, and nothing but collectable references left on the model and its
        process groups (remove_grad_hooks), so that dropping the run frees them."""
        self.finish_pending_save()
        if self.run.optimizer is not None:  # --skip-train builds none
            self.run.optimizer.finish_param_sync()
        for chunk in self.run.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.remove_grad_hooks()
        self.hooks.close()
        self.tensorboard.close()
        self.logger.close()

    def data_iterator(self, dataset, consumed_samples: int):
        """Micro-batches of `dataset` from `consumed_samples` on (setup_run.data_iterator).

        Its DataLoader forks its worker processes here (persistent: once per loader), and never
        while --async-save writes a checkpoint in a background thread. fork() copies only the
        calling thread: a lock that thread holds at that instant (in torch's thread pools,
        OpenMP or MKL state, the allocator) stays locked forever in the child, and the worker's
        first act, torch.set_num_threads(1), can wait on it for ever; the rank then waits for
        a batch that never comes, with the checkpoint still unpublished. So a pending save is
        finished first (on every rank: they create iterators at the same points), and the
        Trainer creates all its iterators before the first save. Spawned or forkserver workers
        would avoid the fork, at the price of importing torch again in every worker and
        pickling the dataset (its index arrays) into each."""
        self.finish_pending_save()
        return data_iterator(self.run, dataset, consumed_samples)

    # --- checkpoints ---------------------------------------------------------------------------
    def save(self, non_persistent: bool = False, rerun_record: dict | None = None):
        """A checkpoint under --save, or (`non_persistent`) under non_persistent_dir, which keeps
        only its latest; `rerun_record`: a reproduced fault's record (RerunState.load)."""
        run, ckpt = self.run, self.ckpt
        root = non_persistent_dir(ckpt) if non_persistent else ckpt.save
        if not root:
            return
        self.finish_pending_save()
        run.optimizer.finish_param_sync()
        async_save = ckpt.async_save and not non_persistent
        with self.timers("save-checkpoint"):
            self.pending_save = save_checkpoint(
                root, run.iteration, chunks=run.models, optimizer=None if ckpt.no_save_optim else run.optimizer,
                pstate=run.pstate, rng_tracker=None if ckpt.no_save_rng else run.tracker,
                common={**common_state(run), **({"rerun_state_machine": rerun_record} if rerun_record else {})},
                async_save=async_save, group=self.save_group,
                fully_parallel=ckpt.ckpt_fully_parallel_save, cache_plan=ckpt.ckpt_assume_constant_structure,
                verify_integrity=ckpt.verify_integrity)
        if not async_save:
            self.pending_save = None
            self.say(f"saved checkpoint at iteration {run.iteration} to {root}")
            self._prune(root, None if non_persistent else ckpt.save_retain_interval, non_persistent)
        self.hooks.after_save(run.iteration, run.consumed_train_samples)

    def _prune(self, root, retain_interval, always: bool = False):
        if (always or retain_interval) and self.run.pstate.rank == 0:
            prune_checkpoints(root, retain_interval)

    def finish_pending_save(self, only_if_done: bool = False):
        if self.pending_save is None or (only_if_done and not self.pending_save.done()):
            return
        path = self.pending_save.finalize()
        self.pending_save = None
        self.say(f"saved checkpoint (asynchronously) to {path}")
        self._prune(self.ckpt.save, self.ckpt.save_retain_interval)

    def say(self, text: str):
        if self.run.pstate.rank == 0:
            print(text, flush=True)

    # --- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str, iterator) -> float | None:
        """Mean loss over --eval-iters batches of `split` (on the last stage); nothing when the
        split has no data or --eval-iters is 0."""
        run = self.run
        if not self.has_split[split] or self.training.eval_iters == 0:
            return None
        for chunk in run.models:
            chunk.eval()
        self.hooks.around_evaluation()
        batch = run.config.data.eval_batch_size
        executor = run.executor_for(batch // (self.training.micro_batch_size * run.pstate.dp_size))
        losses = []
        with self.timers("evaluation"):
            for _ in range(self.training.eval_iters):
                losses.append(self.step_loss(executor, iterator, forward_only=True)[0])
                if self.training.empty_unused_memory_level >= 2 and run.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.hooks.around_evaluation()
        for chunk in run.models:
            chunk.train()
        if split == "valid":
            run.consumed_valid_samples += self.training.eval_iters * batch
        mean = sum(losses) / len(losses) if run.pstate.is_last_stage else None
        if run.writes_logs:
            self.logger.log_evaluation(split, run.iteration, mean)
            self.tensorboard.log_evaluation(split, run.iteration, run.consumed_train_samples, mean)
        return mean

    def step_loss(self, executor, iterator, forward_only: bool = False):
        """(the step's loss averaged over DP replicas, or None off the last stage; the factor
        --calculate-per-token-loss scales gradients by, or None)."""
        run = self.run
        if run.per_token is not None:
            run.per_token.tokens = 0
        loss = _dp_mean(run, executor.run(iterator, forward_only=forward_only))
        if run.per_token is None:
            return loss, None
        factor = token_factor(run.per_token, run.pstate, executor.num_microbatches, run.device)
        return (loss * factor if loss is not None else None), factor

    # --- training ------------------------------------------------------------------------------
    def _forward_backward(self, executor, microbatches, rng: dict | None = None):
        """Gradients of one step left in the DDP buffers (after restoring `rng`, for a re-run);
        returns the step's loss."""
        run = self.run
        if rng is not None:
            self.rerun.restore_rng(rng)
        run.optimizer.zero_grad()
        executor.loss_scale = run.optimizer.loss_scale
        set_loss_backward_scale(run.models, run.optimizer.loss_scale / executor.num_microbatches,
                                run.per_token is not None)
        reset_global_aux_loss_counts(run.models)
        started = time.perf_counter()
        with self.timers("forward-backward"):
            loss, factor = self.step_loss(executor, microbatches)
        self.forward_backward_seconds += time.perf_counter() - started
        end_offload_step(run.models)  # --fine-grained-activation-offloading's warm-up step ends
        with self.timers("grads-sync"):
            finalize_model_grads(run.chunks, run.pstate)
            if factor is not None:
                scale_main_grads(run.chunks, factor)
        return loss

    def train_step(self, iterator):
        """One iteration: (loss, update ok, grad norm, zeros in the gradients, batch size)."""
        run = self.run
        batch = self.batch_schedule.at(run.consumed_train_samples)
        executor = run.executor_for(batch // (self.training.micro_batch_size * run.pstate.dp_size))
        self.hooks.before_iteration(run.iteration)
        for graphs in run.cuda_graphs:  # captured once the warm-up steps are done
            graphs.before_step()
        if self.training.test_mode:
            check_qk_layernorm_replicas(run.models, run.pstate, run.iteration + 1)
        if self.rerun.active:  # keep the micro-batches and random state for a re-run
            batches = _take(iterator, executor.num_microbatches)
            rng = self.rerun.save_rng()
            loss = self._forward_backward(executor, iter(batches) if batches is not None else None)
            validations = 2 * executor.num_microbatches if run.pstate.is_last_stage else 0
            try:
                again = self.rerun.check(run.iteration + 1, loss, lambda: (self._forward_backward(
                    executor, iter(batches) if batches is not None else None, rng),), validations)
            except RerunFault as fault:
                if fault.save_checkpoint:
                    self._save_fault(rng)
                raise
            loss = loss if again is None else again[0]
        else:
            loss = self._forward_backward(executor, iterator)
        with self.timers("optimizer"):
            ok, grad_norm, num_zeros = run.optimizer_step(run.iteration + 1)
            if not ok and run.optimizer.skip_reason == "non-finite" and self.rerun.check_nan:  # not an fp16 overflow
                raise non_finite_gradients(run.iteration + 1, grad_norm, loss)
            update_expert_bias(run.models, run.pstate.dp_cp_group)
        if ok:
            run.scheduler.step(batch)
        run.iteration += 1
        run.consumed_train_samples += batch
        self.hooks.after_iteration(run.iteration, run.models, batch)
        if run.writes_logs:
            self.tensorboard.log_iteration(
                run.iteration, consumed_samples=run.consumed_train_samples,
                learning_rate=run.optimizer.param_groups[0]["lr"], batch_size=batch, loss=loss,
                loss_scale=run.optimizer.loss_scale, grad_norm=grad_norm, num_zeros=num_zeros,
                world_size=run.pstate.world_size, device=run.device)
        return loss, ok, grad_norm, num_zeros, batch

    def _save_fault(self, rng: dict) -> None:
        """Megatron's checkpoint of a reproduced fault: the state before the step (its random
        state restored, no optimizer step) with every rank's record of the fault."""
        run = self.run
        self.rerun.restore_rng(rng)
        records = [self.rerun.checkpoint_state()]
        if run.pstate.world_size > 1:
            records = [None] * run.pstate.world_size
            dist.all_gather_object(records, self.rerun.checkpoint_state())
        if not self.ckpt.save:
            self.say("--rerun-mode validate_results: no --save, so the checkpoint to re-run from is not written")
            return
        self.save(rerun_record={"state": WILL_RERUN_FROM_CHECKPOINT, "iteration": run.iteration + 1,
                                "ranks": records})
        self.finish_pending_save()

    def _log(self, losses, skipped, nans, grad_norm, norm_of_params, elapsed, iters, num_zeros=None, batch=None,
             moe_losses=None):
        run, training = self.run, self.training
        seconds = elapsed / max(iters, 1)
        batch = batch or training.global_batch_size
        rates = throughput(run.flops_per_token, batch * training.seq_length, seconds,
                           run.pstate.world_size, run.peak_flops, run.peak_fp8_flops)
        memory, kind = memory_usage_mb(run.device)
        record = TrainingRecord(
            iteration=run.iteration, train_iters=training.total_train_iters, consumed_samples=run.consumed_train_samples,
            elapsed_ms_per_iteration=seconds * 1000, learning_rate=run.optimizer.param_groups[0]["lr"],
            global_batch_size=batch, lm_loss=sum(losses) / len(losses) if losses else math.nan,
            loss_scale=run.optimizer.loss_scale, grad_norm=grad_norm, skipped_iterations=skipped,
            nan_iterations=nans, memory_mb=memory, memory_kind=kind, params_norm=norm_of_params,
            num_zeros=num_zeros, moe_losses=moe_losses, **rates)
        self.logger.log_training(record)

    def _log_window(self, losses, skipped, nans, grad_norm, elapsed, iters, num_zeros=None, batch=None):
        """The end of a --log-interval window; collectives (norm, timers) on every rank."""
        run = self.run
        norm_of_params = run.optimizer.params_norm() if self.logging.log_params_norm else None
        moe_losses = auxiliary_losses(run.models, run.model_config, run.pstate.world_group)
        if run.writes_logs:
            self._log(losses, skipped, nans, grad_norm, norm_of_params, elapsed, iters, num_zeros, batch,
                      moe_losses)
        timing = self.timers.report(run.pstate.world_group, iters)
        if timing and run.writes_logs:
            self.logger.print_fn(timing)
        if run.writes_logs:
            self.tensorboard.log_timers(run.iteration, elapsed / max(iters, 1), self.timers.last_max_ms)
            self.tensorboard.log_params_norm(run.iteration, run.consumed_train_samples, norm_of_params)
        rerun_stats = self.rerun.report()
        if rerun_stats:
            self.say(rerun_stats)
        if self.logging.log_straggler:
            line = report_stragglers(self.forward_backward_seconds / max(iters, 1), run.pstate, run.device)
            if run.pstate.rank == 0:
                print(line, flush=True)
        self.forward_backward_seconds = 0.0

    def train(self, signals: StopSignals, start_time: float) -> str:
        """Train until a stop condition; returns why it stopped. `start_time`: when this
        process started (time.time()), the origin of --exit-duration-in-mins."""
        run, training, ckpt = self.run, self.training, self.ckpt
        iterator = self.data_iterator(self.train_ds, run.consumed_train_samples)
        window_start = time.time()
        losses, skipped, nans, window_iters, grad_norm = [], 0, 0, 0, None
        while run.iteration < training.total_train_iters:
            loss, ok, norm, num_zeros, batch = self.train_step(iterator)
            window_iters += 1
            skipped += 0 if ok else 1
            grad_norm = norm if norm is not None else grad_norm
            if loss is not None:
                nans += 0 if math.isfinite(loss) else 1
                losses.append(loss)
            if run.iteration % self.logging.log_interval == 0:
                self._log_window(losses, skipped, nans, grad_norm, time.time() - window_start, window_iters,
                                 num_zeros, batch)
                losses, skipped, nans, window_iters, window_start = [], 0, 0, 0, time.time()
            if training.eval_interval and run.iteration % training.eval_interval == 0:
                self.evaluate("valid", self.valid_iter)
            self.finish_pending_save(only_if_done=True)
            # the largest elapsed time is the earliest process start's, as Megatron counts it
            got_signal, minutes = agree(run, [float(signals.received), (time.time() - start_time) / 60])
            if ckpt.save and ckpt.save_interval and run.iteration % ckpt.save_interval == 0:
                self.save()
                saved = True
            else:
                saved = False
                if ckpt.non_persistent_save_interval and run.iteration % ckpt.non_persistent_save_interval == 0:
                    self.save(non_persistent=True)
            reason = None
            if got_signal:
                reason = f"signal {signal_name(got_signal)}"
            elif training.exit_duration_in_mins and minutes >= training.exit_duration_in_mins:
                reason = "exit-duration-in-mins"
            elif training.exit_interval and run.iteration % training.exit_interval == 0:
                reason = "exit-interval"
            if reason:
                if not saved:
                    self.save()
                return reason
        return "done"
