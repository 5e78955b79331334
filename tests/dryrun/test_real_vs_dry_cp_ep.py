"""The dry run of context- and expert-parallel layouts against the same iteration run for real
on CPU processes joined by gloo: bytes held equal exactly; with CP the bytes each process group
moves (independent of the data) equal exactly and peak memory per category is within 5%; with
EP, whose real routing is not the dry run's balanced one, held bytes equal exactly."""

import pytest
import torch

from megalite.data.tokenizers import build_tokenizer
from megalite.dryrun.runner import run_rank
from megalite.config.arguments import parse_args, validate_args
from tests.distributed import run_distributed
from tests.dryrun.dry_run_json import reports
from tests.dryrun.test_dry_run_cp_ep import BASE, MOE

TOL = 0.05


def _real(rank, world, argv):
    args = parse_args(argv)
    validate_args(args, world)
    vocab = build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size).vocab_size
    r = run_rank(args, vocab, rank, world, torch.device("cpu"), strict=False, real=True)
    return {"peak": r.peak, "resident": r.resident, "comm": {f"{g} {k}": b for (g, k), b in r.comm.items()}}


LAYOUTS = {
    "cp2-all_gather-dp2": BASE + "--context-parallel-size 2 --cp-comm-type all_gather --dry-run-world-size 4 "
                                 "--global-batch-size 4".split(),
    "cp2-p2p-pp2": [a for a in BASE if a != "--use-distributed-optimizer"] + "--context-parallel-size 2 --cp-comm-type p2p --pipeline-model-parallel-size 2 "
                          "--dry-run-world-size 4 --global-batch-size 4".split(),
    "ep2-alltoall-dp4": BASE + MOE + "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
                                     "--dry-run-world-size 4 --global-batch-size 8".split(),
    "ep2-allgather-dp4": BASE + MOE + "--moe-token-dispatcher-type allgather --expert-model-parallel-size 2 "
                                      "--dry-run-world-size 4 --global-batch-size 8".split(),
    "ep2-etp1-tp2-alltoall": BASE + MOE + "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
                                          "--expert-tensor-parallel-size 1 --tensor-model-parallel-size 2 "
                                          "--sequence-parallel --dry-run-world-size 4 --global-batch-size 8".split(),
    "ep2-cp2-allgather": BASE + MOE + "--moe-token-dispatcher-type allgather --expert-model-parallel-size 2 "
                                      "--context-parallel-size 2 --dry-run-world-size 4 --global-batch-size 8".split(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_ep_dry_run_matches_real_run(name):
    argv = LAYOUTS[name]
    dry = reports(argv)
    real = run_distributed(_real, parse_args(argv).dry_run_world_size, argv, timeout=900)
    for d in dry:
        r = real[d.rank]
        print(f"{name} rank {d.rank}: dry {d.peak} real {r['peak']}")
        assert r["resident"] == d.resident == d.formula, (name, d.rank)
        if name.startswith("cp"):
            assert r["comm"] == {f"{g} {k}": b for (g, k), b in d.comm.items()}, (name, d.rank)
            for category, value in d.peak.items():
                assert abs(value - r["peak"][category]) <= TOL * max(r["peak"][category], 1), \
                    (name, d.rank, category, value, r["peak"][category])
