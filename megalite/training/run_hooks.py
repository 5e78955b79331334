"""What Megatron's training-loop flags add around each iteration:

    --deterministic-mode        deterministic algorithms and NCCL / cuBLAS settings, before any group
    --manual-gc                 Python's collector off; collect every --manual-gc-interval
                                iterations and around evaluation, on every rank at the same point
    --empty-unused-memory-level torch.cuda.empty_cache() after training (1) and evaluation (2) steps
    --profile                   torch.profiler over iterations [--profile-step-start, --profile-step-end)
                                on --profile-ranks, one Chrome trace per rank
    --check-weight-hash-across-dp-replicas-interval
                                every replica's weights hashed and compared
    --log-progress              Megatron's progress.txt lines in --save

    hooks = RunHooks(training, logging, pstate, device)   # megalite.config.run_config's parts
    hooks.before_iteration(iteration)   # iteration about to run (1-based)
    hooks.after_iteration(iteration, models)
"""

import gc
import hashlib
import os
from datetime import datetime

import torch
import torch.distributed as dist

DETERMINISM_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_VALUES = {"NCCL_ALGO": {"Ring", "CollnetDirect", "CollnetChain", "^NVLS"},
                        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": {"0"},
                        "CUBLAS_WORKSPACE_CONFIG": {":4096:8", ":16:8"}}


def apply_deterministic_mode(environ=os.environ) -> None:
    """Megatron's --deterministic-mode: refuse a non-deterministic setting of NCCL_ALGO,
    NVTE_ALLOW_NONDETERMINISTIC_ALGO or CUBLAS_WORKSPACE_CONFIG already in the environment, fill
    the deterministic ones, and make torch raise on any non-deterministic kernel. Call before
    the process group and the first CUDA kernel (they read the variables once)."""
    for name, accepted in DETERMINISTIC_VALUES.items():
        value = environ.get(name)
        tokens = [t.strip() for t in value.split(",")] if name == "NCCL_ALGO" and value else [value]
        if value is not None and not all(t in accepted for t in tokens):
            raise ValueError(f"--deterministic-mode: {name}={value!r} is not deterministic "
                             f"(accepted: {', '.join(sorted(accepted))})")
    for name, value in DETERMINISM_ENV.items():
        environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def weights_digest(models) -> bytes:
    """SHA-256 of every parameter's bytes, in the models' parameter order."""
    digest = hashlib.sha256()
    for model in models:
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            digest.update(name.encode())
            digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()


def check_weight_hash(models, pstate, iteration: int) -> None:
    """Raise naming the data-parallel ranks whose weights differ from the first replica's."""
    if pstate.dp_size == 1:
        return
    mine = torch.frombuffer(bytearray(weights_digest(models)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(pstate.dp_size)]
    dist.all_gather(gathered, mine, group=pstate.dp_group)
    differ = [r for r, digest in enumerate(gathered) if not torch.equal(digest, gathered[0])]
    if differ:
        raise RuntimeError(f"--check-weight-hash-across-dp-replicas-interval: at iteration {iteration} "
                           f"the weights of data-parallel rank(s) {differ} differ from rank 0's "
                           f"(global rank {pstate.rank}, TP rank {pstate.tp_rank}, PP rank {pstate.pp_rank})")


def append_progress(save_dir: str, world_size: int, text: str) -> None:
    """One progress.txt line as Megatron writes it: time, Slurm job id, GPU count, text."""
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "progress.txt"), "a", encoding="utf-8") as handle:
        handle.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: "
                     f"{os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {world_size}\t{text}\n")


def progress_start(save_dir: str, world_size: int) -> tuple[datetime, float]:
    """(start time, floating-point operations at that start) of the earliest job of this world
    size in progress.txt, as Megatron's get_start_time_from_progress_log reads them."""
    start, start_flops, latest = None, None, 0.0
    with open(os.path.join(save_dir, "progress.txt"), encoding="utf-8") as handle:
        for line in handle:
            tokens = line.strip().split("\t")
            if len(tokens) < 4:
                continue
            if tokens[3] == "Saved checkpoint" and len(tokens) > 7:
                latest = float(tokens[7].split(": ")[1])
            if int(tokens[2].split(": ")[1]) != world_size:
                start = start_flops = None
                continue
            if tokens[3] == "Starting job" and start is None:
                start, start_flops = datetime.strptime(tokens[0], "%Y-%m-%d %H:%M:%S"), latest
    return start, start_flops


def saved_flops(save_dir: str, iteration: int) -> float:
    """The floating-point operations progress.txt records for the checkpoint of `iteration`."""
    path, flops = os.path.join(save_dir, "progress.txt"), 0.0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                tokens = line.rstrip("\n").split("\t")
                if len(tokens) > 7 and tokens[3] == "Saved checkpoint" and tokens[4] == f"Iteration: {iteration}":
                    flops = float(tokens[7].split(": ")[1])
    return flops


class RunHooks:
    def __init__(self, training, logging, pstate, device, *, flops_per_sample: float = 0.0,
                 resume_iteration: int | None = None):
        """`training`, `logging`: the run's TrainingConfig and LoggingConfig; `resume_iteration`:
        the loaded checkpoint's iteration; the floating-point operations progress.txt recorded for
        it are where this job's count starts (Megatron keeps the count in its checkpoints)."""
        self.training, self.logging, self.pstate, self.device = training, logging, pstate, device
        self.progress_dir = logging.progress_dir
        start_flops = 0.0
        if self.progress_dir and resume_iteration:
            start_flops = saved_flops(self.progress_dir, resume_iteration)
        self.flops_per_sample, self.job_start_flops = flops_per_sample, start_flops
        self.total_flops = start_flops
        self.job_start = datetime.now()
        self.profiler = None
        ranks = [int(r) for r in (logging.profile_ranks or ["0"])]
        self.profiles = logging.profile and pstate.rank in ranks
        if training.manual_gc:
            gc.disable()
            gc.collect()
        if self.progress_dir and pstate.rank == 0:
            append_progress(self.progress_dir, pstate.world_size, "Starting job")

    # --- around iterations ------------------------------------------------------------------
    def before_iteration(self, iteration: int) -> None:
        if self.profiles and iteration == self.logging.profile_step_start:
            trace_dir = self.logging.profile_dir
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    trace_dir, worker_name=f"rank{self.pstate.rank}"),
                record_shapes=True)
            self.profiler.start()

    def after_iteration(self, iteration: int, models, samples: int) -> None:
        training = self.training
        self.total_flops += self.flops_per_sample * samples
        if self.profiler is not None and iteration + 1 >= self.logging.profile_step_end:
            self.profiler.stop()  # writes the trace
            self.profiler = None
        if training.empty_unused_memory_level >= 1 and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if training.manual_gc and training.manual_gc_interval and iteration % training.manual_gc_interval == 0:
            gc.collect()
        interval = training.check_weight_hash_across_dp_replicas_interval
        if interval and iteration % interval == 0:
            check_weight_hash(models, self.pstate, iteration)

    def around_evaluation(self) -> None:
        """Called at the start and the end of each evaluation."""
        if self.training.manual_gc and self.training.manual_gc_eval:
            gc.collect()
        if self.training.empty_unused_memory_level >= 2 and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def after_save(self, iteration: int, consumed_samples: int) -> None:
        """Megatron's progress line for a saved checkpoint (rank 0)."""
        if not self.progress_dir or self.pstate.rank != 0:
            return
        world = self.pstate.world_size
        seconds = max((datetime.now() - self.job_start).total_seconds(), 1e-9)
        job = (self.total_flops - self.job_start_flops) / (seconds * 1e12 * world)
        start, start_flops = progress_start(self.progress_dir, world)
        elapsed = max((datetime.now() - start).total_seconds(), 1e-9)
        cumulative = (self.total_flops - start_flops) / (elapsed * 1e12 * world)
        append_progress(self.progress_dir, world,
                        f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                        f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                        f"Floating-point operations: {self.total_flops:.2e}\t"
                        f"Tokens (in billions): {consumed_samples * self.training.seq_length / 10**9:.2f}")

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.training.manual_gc:
            gc.enable()
