"""What a training run reports: Megatron's console lines, a JSON-lines metrics file,
TensorBoard and Weights & Biases.

    logger = MetricsLogger.from_config(run_config.logging, run_config.options,
                                       should_write=is_last_stage and tp_rank == 0 and dp_rank == 0)
    logger.log_training(TrainingRecord(iteration=..., lm_loss=..., ...))
    logger.log_evaluation("valid", iteration, lm_loss)
    logger.close()

Only the rank the loop chooses (`should_write`) prints or writes anything. TensorBoard and
wandb are imported only when asked for.
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime


@dataclass
class TrainingRecord:
    """One logged iteration; losses and times are averages over the log interval."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    loss_scale: float = 1.0
    grad_norm: float | None = None
    skipped_iterations: int = 0
    nan_iterations: int = 0
    tokens_per_second_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation as a fraction of the dense bf16 peak; None when the device's peak is unknown."""
    mfu_fp8: float | None = None
    """An --fp8-format run's MFU against the device's dense FP8 peak (same FLOPs); None otherwise."""
    memory_mb: float | None = None
    memory_kind: str | None = None
    """'cuda_max_allocated' or 'max_rss' (CPU), see memory_usage_mb."""
    params_norm: float | None = None
    num_zeros: int | None = None
    """Zero gradient elements of the last step (--log-num-zeros-in-grad)."""
    moe_losses: dict | None = None
    """MoE auxiliary losses: {name: mean over MoE layers, 'name/layer_N': per layer}."""


def throughput(flops_per_token: float, tokens_per_iteration: int, seconds_per_iteration: float,
               world_size: int, peak_flops: float | None, peak_fp8_flops: float | None = None) -> dict:
    """tokens/s per GPU, TFLOP/s per GPU and MFU (None without a known peak) of one iteration
    that processed `tokens_per_iteration` tokens (global batch x seq length) on `world_size`
    GPUs; `mfu_fp8` the same FLOPs against `peak_fp8_flops` (given for --fp8-format runs)."""
    tokens = tokens_per_iteration / seconds_per_iteration / world_size
    achieved = flops_per_token * tokens
    return {"tokens_per_second_per_gpu": tokens, "tflops_per_gpu": achieved / 1e12,
            "mfu": achieved / peak_flops if peak_flops else None,
            "mfu_fp8": achieved / peak_fp8_flops if peak_fp8_flops else None}


def memory_usage_mb(device=None) -> tuple[float, str]:
    """(MiB, kind): the CUDA allocator's peak on a CUDA device, else the process's peak RSS."""
    import torch

    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    import resource  # Unix only; megalite runs on Linux and macOS

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10), "max_rss"


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron caps it."""
    return math.exp(min(20.0, loss))


def format_training_line(record: TrainingRecord, now: datetime | None = None) -> str:
    """The line Megatron prints every --log-interval, with megalite's throughput fields."""
    now = now or datetime.now()
    r = record
    parts = [f" [{now.strftime('%Y-%m-%d %H:%M:%S')}] iteration {r.iteration:8d}/{r.train_iters:8d} |",
             f" consumed samples: {r.consumed_samples:12d} |",
             f" elapsed time per iteration (ms): {r.elapsed_ms_per_iteration:.1f} |"]
    if r.tflops_per_gpu is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {r.tflops_per_gpu:.1f} |")
        if r.mfu is not None and r.mfu_fp8 is not None:
            parts.append(f" MFU: {100 * r.mfu:.1f}% of the bf16 peak, {100 * r.mfu_fp8:.1f}% of the FP8 peak |")
        else:
            parts.append(f" MFU: {100 * r.mfu:.1f}% |" if r.mfu is not None
                         else " MFU: n/a (unknown device peak) |")
    if r.tokens_per_second_per_gpu is not None:
        parts.append(f" tokens per second per GPU: {r.tokens_per_second_per_gpu:.1f} |")
    parts += [f" learning rate: {r.learning_rate:.6E} |",
              f" global batch size: {r.global_batch_size:5d} |",
              f" lm loss: {r.lm_loss:.6E} |",
              f" loss scale: {r.loss_scale:.1f} |"]
    if r.grad_norm is not None:
        parts.append(f" grad norm: {r.grad_norm:.3f} |")
    if r.num_zeros is not None:
        parts.append(f" num zeros: {float(r.num_zeros):.1f} |")
    if r.params_norm is not None:
        parts.append(f" params norm: {r.params_norm:.3f} |")
    for name, value in (r.moe_losses or {}).items():
        if "/" not in name:
            parts.append(f" {name}: {value:.6E} |")
    parts += [f" number of skipped iterations: {r.skipped_iterations:3d} |",
              f" number of nan iterations: {r.nan_iterations:3d} |"]
    if r.memory_mb is not None:
        label = "max allocated" if r.memory_kind == "cuda_max_allocated" else "max RSS"
        parts.append(f" {label} memory (MB): {r.memory_mb:.1f} |")
    return "".join(parts)


def format_evaluation_lines(split: str, iteration: int, lm_loss: float) -> str:
    """Megatron's evaluation block: a rule, the loss and perplexity, a rule."""
    name = "validation" if split == "valid" else split
    line = (f" {name} loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
            f"lm loss PPL: {perplexity(lm_loss):.6E} | ")
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def _plain(value):
    """Python scalars for JSON (tensors and numpy numbers hold .item())."""
    return value.item() if hasattr(value, "item") else value


def iter_metrics_records(path: str):
    """(line, record) for every record of a --metrics-file. Raises ValueError naming the file
    and line of one that is not a JSON object with an integer "iteration"."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
                raise ValueError(f"{path}:{number}: expected a JSON object with an integer \"iteration\"")
            yield line, record


def read_metrics(path: str) -> tuple[dict, dict]:
    """(training records by iteration, {split: evaluation records by iteration})."""
    train, evals = {}, {}
    for _, record in iter_metrics_records(path):
        if "split" in record:
            evals.setdefault(record["split"], {})[record["iteration"]] = record
        else:
            train[record["iteration"]] = record
    return train, evals


def trim_metrics_file(path: str, after_iteration: int) -> None:
    """Drop records logged after `after_iteration` (a resumed run logs them again); the file
    is rewritten through a temporary name."""
    if not os.path.exists(path):
        return
    kept = [line if line.endswith("\n") else line + "\n"
            for line, record in iter_metrics_records(path) if record["iteration"] <= after_iteration]
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.writelines(kept)
    os.replace(temporary, path)


class MetricsLogger:
    """Console, --metrics-file, --tensorboard-dir and --wandb-project outputs of one rank."""

    def __init__(self, should_write: bool, *, metrics_file: str | None = None,
                 tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 wandb_exp_name: str | None = None, wandb_save_dir: str | None = None,
                 wandb_entity: str | None = None, run_config: dict | None = None,
                 resume_iteration: int | None = None, print_fn=None):
        """`resume_iteration`: records after it are removed from an existing metrics file; new
        records are always appended."""
        self.should_write = should_write
        self.print_fn = print_fn or (lambda text: print(text, flush=True))
        self._file = self._tensorboard = self._wandb = None
        if not should_write:
            return
        if metrics_file:
            if resume_iteration is not None:
                trim_metrics_file(metrics_file, resume_iteration)
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", encoding="utf-8")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(f"--tensorboard-dir needs the tensorboard package ({error}); "
                                   "pip install tensorboard") from None
            self._tensorboard = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("--wandb-project needs the wandb package; pip install wandb "
                                   "(set WANDB_MODE=offline without network)") from None
            save_dir = wandb_save_dir or "wandb"
            os.makedirs(save_dir, exist_ok=True)
            self._wandb = wandb.init(project=wandb_project, entity=wandb_entity or None,
                                     name=wandb_exp_name or None, dir=save_dir, config=run_config or {})

    @classmethod
    def from_config(cls, logging, options: dict, should_write: bool, resume_iteration: int | None = None,
                    print_fn=None) -> "MetricsLogger":
        """A logger for a run's LoggingConfig (`options`, every option's value, go to wandb as
        the run's config). TensorBoard is left to megalite.training.tensorboard_log (Megatron's tags)."""
        return cls(should_write, metrics_file=logging.metrics_file,
                   wandb_project=logging.wandb_project, wandb_exp_name=logging.wandb_exp_name,
                   wandb_save_dir=logging.wandb_save_dir, wandb_entity=logging.wandb_entity,
                   run_config=options, resume_iteration=resume_iteration, print_fn=print_fn)

    def _write(self, record: dict, step: int, prefix: str):
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k not in ("iteration", "time")}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(f"{prefix}/{key}", value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)

    def log_training(self, record: TrainingRecord) -> str | None:
        """Print the training line and write the record; returns the line (None if not writing)."""
        if not self.should_write:
            return None
        values = {k: _plain(v) for k, v in asdict(record).items()}
        moe_losses = values.pop("moe_losses") or {}
        line = format_training_line(TrainingRecord(**values, moe_losses=moe_losses))
        self.print_fn(line)
        self._write({**values, **moe_losses, "time": time.time()}, values["iteration"], "train")
        return line

    def log_evaluation(self, split: str, iteration: int, lm_loss: float) -> str | None:
        """Print the evaluation block of `split` ('valid' or 'test') and write its record."""
        if split not in ("valid", "test"):
            raise ValueError(f"evaluation split must be 'valid' or 'test', got {split!r}")
        if not self.should_write:
            return None
        lm_loss = float(_plain(lm_loss))
        text = format_evaluation_lines(split, iteration, lm_loss)
        self.print_fn(text)
        record = {"split": split, "iteration": int(iteration), "lm_loss": lm_loss,
                  "lm_loss_ppl": perplexity(lm_loss), "time": time.time()}
        self._write(record, int(iteration), split)
        return text

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._tensorboard = self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
