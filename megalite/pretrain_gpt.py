"""Pretrain a GPT: `python -m megalite.pretrain_gpt [Megatron flags]`, under torchrun or srun.

Exit status: 0 when training finished or stopped on purpose (a signal, --exit-interval,
--exit-duration-in-mins) after saving; 2 for bad options or an unusable checkpoint (one line
naming the flag, file or tensor); 1 for any other failure, including a peer rank that died
(collectives time out after --distributed-timeout-minutes instead of hanging).
"""

import logging
import os
import sys
import traceback

import torch.distributed as dist

from megalite.training.arguments import parse_args
from megalite.training.checkpoint_format import CheckpointError


def _die(status: int, message: str | None = None):
    """Leave at once: with a peer gone, tearing down process groups could block."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parse_args(argv)
    except ValueError as error:
        print(f"pretrain_gpt: error: {error}", file=sys.stderr)
        return 2
    from megalite.training.loop import StopSignals, Trainer
    from megalite.training.setup_run import build_run

    with StopSignals() as signals:
        try:
            run = build_run(args)
            trainer = Trainer(run)
        except (ValueError, CheckpointError, FileNotFoundError) as error:
            _die(2, f"pretrain_gpt: error: {error}")
        try:
            reason = "skip-train" if args.skip_train else trainer.train(signals)
            if reason in ("done", "skip-train"):
                if reason == "done" and not (args.save_interval and run.iteration % args.save_interval == 0):
                    trainer.save()
                if args.eval_iters > 0:
                    if not (reason == "done" and args.eval_interval and run.iteration % args.eval_interval == 0):
                        trainer.evaluate("valid", trainer.valid_iter)
                    from megalite.training.setup_run import data_iterator

                    trainer.evaluate("test", data_iterator(run, trainer.test_ds, 0))
            else:
                trainer.say(f"stopping at iteration {run.iteration} ({reason})")
            trainer.finish_pending_save()
            trainer.logger.close()
        except CheckpointError as error:
            _die(2, f"pretrain_gpt: error: {error}")
        except BaseException:  # noqa: BLE001 - report and leave without tearing down groups
            _die(1, f"pretrain_gpt: rank {dist.get_rank() if dist.is_initialized() else 0} failed:\n"
                    + traceback.format_exc())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
