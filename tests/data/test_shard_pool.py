"""shard_pool.ordered_results: every process tokenises, results come in input order, and a
failing or dying worker stops the run with a clear error."""

import os
import re
import sys
import time
from types import SimpleNamespace

import pytest

from megalite.data.shard_pool import ordered_results

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork start method")


class FakeWorker:
    """run((index, behaviour)) records which process ran it; in a worker process the
    behaviours 'raise' and 'die' fail, 'error' returns a result with an error."""

    def __init__(self):
        self.parent = os.getpid()

    def run(self, shard):
        index, behaviour = shard
        time.sleep(0.02 if os.getpid() == self.parent else 0.002)  # so that workers, once started, take shards
        if behaviour == "raise" and os.getpid() != self.parent:
            raise OSError("disk full in a worker")
        if behaviour == "die" and os.getpid() != self.parent:
            os._exit(3)
        return SimpleNamespace(index=index, error="bad" if behaviour == "error" else None, pid=os.getpid())


def test_results_arrive_in_order_from_every_process():
    worker = FakeWorker()
    results = list(ordered_results(worker, [(i, None) for i in range(60)], 3))
    assert [r.index for r in results] == list(range(60))
    assert len({r.pid for r in results}) == 3 and worker.parent in {r.pid for r in results}


def test_an_error_result_is_the_last_and_stops_handing_out_shards():
    worker = FakeWorker()
    shards = [(i, "error" if i == 7 else None) for i in range(200)]
    assert [r.index for r in ordered_results(worker, shards, 2)] == list(range(8))


@pytest.mark.parametrize("behaviour, message", [("raise", "disk full in a worker"), ("die", "died (exit code 3)")])
def test_a_failing_worker_stops_the_run(behaviour, message):
    shards = [(i, behaviour if i % 2 else None) for i in range(40)]
    with pytest.raises((OSError, RuntimeError), match=re.escape(message)):
        list(ordered_results(FakeWorker(), shards, 2))
