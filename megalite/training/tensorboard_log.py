"""TensorBoard scalars under Megatron-LM's tags, as its training_log and evaluate write them:

    every --tensorboard-log-interval iterations:
        'learning-rate'        (unless --no-log-learning-rate-to-tensorboard)
        'batch-size'           (always, as Megatron-LM's training_log writes it)
        'lm loss', 'grad-norm', 'num-zeros' (--log-num-zeros-in-grad)
        'loss-scale'           (unless --no-log-loss-scale-to-tensorboard)
        'world-size'           (--log-world-size-to-tensorboard)
        'mem-reserved-bytes', 'mem-allocated-bytes', 'mem-max-allocated-bytes', 'mem-allocated-count'
                               (--log-memory-to-tensorboard; on CPU 'mem-max-rss-bytes')
      each also as '<tag> vs samples' over consumed samples;
    every --log-interval: 'params-norm' (--log-params-norm); with --log-timers-to-tensorboard
      'iteration-time' (s) and '<timer>-time' (ms per iteration, maximum over ranks);
    each evaluation: 'lm loss validation' ('lm loss test'), and its ' ppl' with
      --log-validation-ppl-to-tensorboard.

--tensorboard-queue-size is the SummaryWriter's max_queue.
"""

import math

import torch

from megalite.training.metrics import memory_usage_mb


class MegatronTensorboard:
    def __init__(self, logging, should_write: bool):
        """`logging`: the run's LoggingConfig."""
        self.logging = logging
        self.writer = None
        if should_write and logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(f"--tensorboard-dir needs the tensorboard package ({error}); "
                                   "pip install tensorboard") from None
            self.writer = SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=logging.tensorboard_queue_size)

    def _add(self, tag: str, value, iteration: int, samples: int | None = None) -> None:
        self.writer.add_scalar(tag, value, iteration)
        if samples is not None:
            self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def log_iteration(self, iteration: int, *, consumed_samples: int, learning_rate: float, batch_size: int,
                      loss: float | None, loss_scale: float, grad_norm: float | None = None,
                      num_zeros: int | None = None, world_size: int = 1, device=None) -> None:
        logging = self.logging
        if self.writer is None or iteration % logging.tensorboard_log_interval:
            return
        samples = consumed_samples
        if logging.log_learning_rate_to_tensorboard:
            self._add("learning-rate", learning_rate, iteration, samples)
        self._add("batch-size", batch_size, iteration, samples)
        if loss is not None:
            self._add("lm loss", loss, iteration, samples)
        if logging.log_loss_scale_to_tensorboard:
            self._add("loss-scale", loss_scale, iteration, samples)
        if logging.log_world_size_to_tensorboard:
            self._add("world-size", world_size, iteration, samples)
        for tag, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros)):
            if value is not None:
                self._add(tag, value, iteration, samples)
        if logging.log_memory_to_tensorboard:
            self._log_memory(iteration, device)

    def log_params_norm(self, iteration: int, consumed_samples: int, params_norm: float | None) -> None:
        """'params-norm' (computed every --log-interval, a collective)."""
        if self.writer is not None and params_norm is not None and iteration % self.logging.tensorboard_log_interval == 0:
            self._add("params-norm", params_norm, iteration, consumed_samples)

    def _log_memory(self, iteration: int, device) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            for tag, key in (("mem-reserved-bytes", "reserved_bytes.all.current"),
                             ("mem-allocated-bytes", "allocated_bytes.all.current"),
                             ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                             ("mem-allocated-count", "allocation.all.current")):
                self._add(tag, stats.get(key, 0), iteration)
        else:
            megabytes, _ = memory_usage_mb(device)
            self._add("mem-max-rss-bytes", megabytes * 2**20, iteration)

    def log_timers(self, iteration: int, seconds_per_iteration: float, timers_max_ms: dict) -> None:
        if self.writer is None or not self.logging.log_timers_to_tensorboard:
            return
        self._add("iteration-time", seconds_per_iteration, iteration)
        for phase, ms in timers_max_ms.items():
            self._add(f"{phase}-time", ms, iteration)

    def log_evaluation(self, split: str, iteration: int, consumed_samples: int, loss: float) -> None:
        if self.writer is None or loss is None:
            return
        tag = "lm loss validation" if split == "valid" else "lm loss test"
        self._add(tag, loss, iteration, consumed_samples)
        if self.logging.log_validation_ppl_to_tensorboard:
            self._add(f"{tag} ppl", math.exp(min(20.0, loss)), iteration, consumed_samples)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
