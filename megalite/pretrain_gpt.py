"""Pretrain a GPT: `python -m megalite.pretrain_gpt [Megatron flags]`, under torchrun or srun.

Exit status: 0 when training finished or stopped on purpose (a signal, --exit-interval,
--exit-duration-in-mins) after saving, or --skip-train evaluated; then --exit-reason-file
says which. A SIGTERM / SIGUSR1 during start-up (from the first import on) stops every rank
before the first iteration, with nothing to save, also with 0 and the signal as the reason.
2 for bad options (a flag whose optional package is missing too), an unusable checkpoint or
a checkpoint that could not be written (a full disk): one line naming the flag, file,
directory or tensor. 16 and 17 for a
result validation that stopped the run (--rerun-mode validate_results, Megatron's codes: 16
resume from the checkpoint it saved, 17 validation failed). 1 for any other failure. A peer
rank that died or hung makes every other rank stop with status 1 and one line saying which
rank it is and which collective failed (collectives time out after
--distributed-timeout-minutes instead of hanging); the rank whose own code failed prints its
traceback.
"""

import time

PROCESS_START = time.time()  # the origin of --exit-duration-in-mins, before any slow import

import gc  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

# Nothing heavier here: main() installs the SIGTERM / SIGUSR1 handler before torch is imported
# (seconds), so that a signal during start-up stops the run cleanly instead of killing it.
from megalite.training.stop_signals import StopSignals, signal_name  # noqa: E402


def _die(status: int, message: str | None = None):
    """Leave at once: with a peer gone, tearing down process groups could block."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# gloo's and NCCL's words for a peer that died, hung or closed its connection
_LOST_PEER = re.compile(r"gloo/transport|[Cc]onnection (closed|reset|refused) by peer|Timed out waiting|[Ww]atchdog|"
                        r"collective operation timeout|NCCL communicator was aborted")


def peer_failure(error: BaseException) -> str | None:
    """What failed, in a few words, when `error` is a collective's failure caused by another
    rank (it died, hung or closed its connection: torch.distributed's DistError, or gloo's and
    NCCL's RuntimeErrors about connections and timeouts); None for any other error, whose
    traceback is kept."""
    import torch.distributed as dist

    from megalite.checkpoint.dcp.storage import dcp_failure

    error = dcp_failure(error)  # DCP gathers every rank's failure in a CheckpointException
    text = str(error)
    if not isinstance(error, dist.DistError) and not (isinstance(error, RuntimeError) and _LOST_PEER.search(text)):
        return None
    operation = next((f.name for f in reversed(traceback.extract_tb(error.__traceback__))
                      if re.search(r"torch[/\\]distributed|megalite[/\\]parallel", f.filename)
                      and not f.name.startswith("_") and f.name not in ("wrapper", "wait", "forward", "backward")), None)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(error).__name__)
    reason = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)  # gloo's source location
    reason = re.split(r"\.(\s|$)", reason)[0]
    return f"{operation} failed ({reason})" if operation else reason


def _failed(error: BaseException) -> None:
    """Leave after an unexpected error: one line for a peer rank's failure, else the traceback."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    lost = peer_failure(error)
    if lost is not None:
        _die(1, f"pretrain_gpt: rank {rank}: lost a peer rank: {lost}; stopping")
    _die(1, f"pretrain_gpt: rank {rank} failed:\n" + "".join(traceback.format_exception(error)))


def main(argv=None) -> int:
    with StopSignals() as signals:  # first of all: see the module's import note
        return _main(argv, signals)


def _main(argv, signals: StopSignals) -> int:
    import torch.distributed as dist

    from megalite.config.arguments import parse_args
    from megalite.config.megatron.engine import apply_logging_level
    from megalite.checkpoint.dcp.format import CheckpointError
    from megalite.training.rerun import RerunFault

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parse_args(argv)
    except ValueError as error:
        print(f"pretrain_gpt: error: {error}", file=sys.stderr)
        return 2
    apply_logging_level(args)
    if args.dry_run:
        from megalite.dryrun.cli import run_dry

        try:
            return run_dry(args, sys.argv[1:] if argv is None else list(argv))
        except ValueError as error:
            print(f"pretrain_gpt: error: {error}", file=sys.stderr)
            return 2
    if args.exit_reason_file and os.environ.get("RANK", "0") == "0":
        Path(args.exit_reason_file).unlink(missing_ok=True)  # a stale reason must not outlive a crash
    from megalite.training.loop import Trainer, agree
    from megalite.training.setup_run import build_run

    try:
        run = build_run(args)
        trainer = Trainer(run)
    except (ValueError, CheckpointError, FileNotFoundError) as error:
        _die(2, f"pretrain_gpt: error: {error}")
    except BaseException as error:  # noqa: BLE001 - report and leave without tearing down groups
        _failed(error)
    training, save_interval = run.config.training, run.config.checkpoint.save_interval
    try:
        # A signal any rank got during start-up stops every rank here, as the loop would at an
        # iteration boundary, but with nothing to save: no step was taken since the last checkpoint.
        early = agree(run, [float(signals.received)])[0]
        if early:
            reason = f"signal {signal_name(early)}"
            trainer.say(f"stopping at iteration {run.iteration} before training ({reason} during start-up); "
                        "nothing to save")
        else:
            reason = "skip-train" if training.skip_train else trainer.train(signals, PROCESS_START)
        if reason in ("done", "skip-train"):
            if reason == "done" and not (save_interval and run.iteration % save_interval == 0):
                trainer.save()
            if training.eval_iters > 0:
                if not (reason == "done" and training.eval_interval and run.iteration % training.eval_interval == 0):
                    trainer.evaluate("valid", trainer.valid_iter)
                trainer.evaluate("test", trainer.test_iter)
        elif not early:
            trainer.say(f"stopping at iteration {run.iteration} ({reason})")
        trainer.finish_pending_save()
        trainer.close()
    except CheckpointError as error:
        _die(2, f"pretrain_gpt: error: {error}")
    except RerunFault as error:  # Megatron's exit codes: 16 resume to diagnose, 17 failed validation
        _die(error.exit_code, f"pretrain_gpt: error: {error}")
    except BaseException as error:  # noqa: BLE001 - report and leave without tearing down groups
        _failed(error)
    dist.barrier()
    if args.exit_reason_file and dist.get_rank() == 0:
        from megalite.checkpoint.dcp.checkpoint import write_text_atomic

        Path(args.exit_reason_file).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.exit_reason_file), reason + "\n")
    # An orderly end: the model, optimizer and data go now (trainer.close() left them only
    # collectable references), then the process groups; each gloo group joins its worker
    # threads as it goes. Left to the interpreter's exit, a worker still releasing a tensor
    # needs the GIL after Python has torn it down, and the process aborts (status -6) after a
    # successful run.
    del trainer, run
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
