"""`python tests/training/fork_watch.py DELAY PRETRAIN_ARGS...`: one pretrain_gpt rank that exits
with status 3 when a DataLoader forks its worker processes while an --async-save checkpoint is
being written in the background, the moment whose forked workers deadlocked (issue 24, item 5:
a test-set worker stuck in torch.set_num_threads, the checkpoint left as iter_*.tmp). Each
background write first sleeps DELAY seconds, so that such a fork cannot slip past unseen."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.utils.data import dataloader  # noqa: E402

from megalite import pretrain_gpt  # noqa: E402
from megalite.checkpoint.dcp.storage import CheckedFileSystemWriter  # noqa: E402

FORKED_DURING_SAVE = 3


def watch(delay: float) -> None:
    writes = []  # the futures of this rank's background saves
    async_save, write_data = dcp.async_save, CheckedFileSystemWriter.write_data
    start_workers = dataloader._MultiProcessingDataLoaderIter.__init__

    def recorded_async_save(*args, **kwargs):
        future = async_save(*args, **kwargs)
        writes.append(future)
        return future

    def slow_write_data(self, plan, planner):
        time.sleep(delay)
        return write_data(self, plan, planner)

    def checked_start_workers(self, loader):
        if any(not future.done() for future in writes):
            print("fork_watch: DataLoader workers forked while a checkpoint was being written in the background",
                  file=sys.stderr, flush=True)
            os._exit(FORKED_DURING_SAVE)
        start_workers(self, loader)

    dcp.async_save = recorded_async_save
    CheckedFileSystemWriter.write_data = slow_write_data
    dataloader._MultiProcessingDataLoaderIter.__init__ = checked_start_workers


if __name__ == "__main__":
    watch(float(sys.argv[1]))
    sys.exit(pretrain_gpt.main(sys.argv[2:]))
