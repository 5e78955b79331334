"""The training driver with context parallelism (`python -m megalite.pretrain_gpt`, four rank
processes on gloo): five iterations' losses at CP = 2 with TP = 2 and sequence parallelism,
with PP = 2 interleaved, with DP = 2 and the distributed optimizer, with TP = 2 and FSDP2, and
at CP = 4 (one comm type, and one per layer), each equal to the single-process run within 1e-5; a checkpoint saved at CP = 2 x
DP = 2 with the distributed optimizer (its state sharded over DP x CP, d = 4) resumes at CP = 1
(one process), at CP = 2 x DP = 1 (d = 2) and at CP = 4 (d = 4 on other ranks) with the
uninterrupted run's losses; one saved at CP = 2 x DP = 2 with FSDP2 (sharded over DP x CP)
resumes with FSDP2 at CP = 1 x DP = 2 and at CP = 4. Also: documents split across chunks
(--reset-attention-mask --reset-position-ids, CP = 2 with TP = 2) and a2a+p2p (CP = 4 as 2 x 2)
equal their single-process runs; with attention dropout on, CP = 2 and CP = 4 draw the same
masks (equal losses), which differ from dropout off."""

import shutil

import pytest

from tests.training.launch import BASE, run, train_losses

ITERS = 5
COMMON = BASE + ["--train-iters", str(ITERS), "--eval-iters", "0", "--eval-interval", "1000",
                 "--hidden-dropout", "0", "--attention-dropout", "0"]


def _close(losses, reference, iterations):
    assert sorted(losses) == list(iterations), losses
    for it in iterations:
        assert abs(losses[it] - reference[it]) <= 1e-5 * abs(reference[it]), (it, losses[it], reference[it])


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp1")
    run(COMMON + ["--metrics-file", str(tmp / "metrics.jsonl")], 1, tmp / "logs")
    return train_losses(tmp / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--num-virtual-stages-per-pipeline-rank", "2", "--cp-comm-type", "a2a"],
    ["--context-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
     "--cp-comm-type", "all_gather"],
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
    ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-torch-fsdp2"],
    ["--context-parallel-size", "4", "--cp-comm-type", "p2p", "a2a", "all_gather", "a2a+p2p",
     "--hierarchical-context-parallel-sizes", "2", "2"],
], ids=["cp2-tp2-sp-p2p", "cp2-pp2-interleaved-a2a", "cp2-dp2-distopt-all_gather", "cp4-a2a", "cp2-tp2-sp-fsdp2",
        "cp4-per-layer"])
def test_training_losses_equal_single_process(tmp_path, single_process, layout):
    run(COMMON + layout + ["--metrics-file", str(tmp_path / "metrics.jsonl")], 4, tmp_path / "logs")
    _close(train_losses(tmp_path / "metrics.jsonl"), single_process, range(1, ITERS + 1))


def _saved_at_cp2(tmp, single_process, flags) -> object:
    """A checkpoint saved after 3 of the 5 iterations at CP = 2 x DP = 2 with `flags`."""
    run(COMMON + flags + ["--context-parallel-size", "2", "--save", str(tmp / "ckpt"), "--save-interval", "3",
                          "--exit-interval", "3", "--metrics-file", str(tmp / "metrics.jsonl")], 4, tmp / "logs")
    _close(train_losses(tmp / "metrics.jsonl"), single_process, range(1, 4))
    return tmp / "ckpt"


def _resumes(tmp, checkpoint, single_process, world, cp, flags) -> None:
    shutil.copytree(checkpoint, tmp / "ckpt")
    run(COMMON + flags + ["--context-parallel-size", str(cp), "--load", str(tmp / "ckpt"),
                          "--metrics-file", str(tmp / "metrics.jsonl")], world, tmp / "logs")
    _close(train_losses(tmp / "metrics.jsonl"), single_process, range(4, ITERS + 1))


@pytest.fixture(scope="module")
def distopt_checkpoint(tmp_path_factory, single_process):
    return _saved_at_cp2(tmp_path_factory.mktemp("distopt_cp2"), single_process, ["--use-distributed-optimizer"])


@pytest.mark.parametrize("world, cp", [(1, 1), pytest.param(2, 2, marks=pytest.mark.slow), pytest.param(4, 4, marks=pytest.mark.slow)],
                         ids=["cp1-single", "cp2-dp1", "cp4"])
def test_distributed_optimizer_checkpoint_at_cp2_resumes_at_other_cp_sizes(tmp_path, single_process,
                                                                           distopt_checkpoint, world, cp):
    _resumes(tmp_path, distopt_checkpoint, single_process, world, cp,
             ["--use-distributed-optimizer"] if world > 1 else [])


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory, single_process):
    return _saved_at_cp2(tmp_path_factory.mktemp("fsdp2_cp2"), single_process, ["--use-torch-fsdp2"])


@pytest.mark.slow
@pytest.mark.parametrize("world, cp", [(2, 1), (4, 4)], ids=["cp1-dp2", "cp4"])
def test_fsdp2_checkpoint_at_cp2_resumes_at_other_cp_sizes(tmp_path, single_process, fsdp2_checkpoint, world, cp):
    _resumes(tmp_path, fsdp2_checkpoint, single_process, world, cp, ["--use-torch-fsdp2"])


@pytest.mark.slow
def test_document_masks_and_hierarchical_equal_single_process(tmp_path, single_process):
    docs = ["--reset-attention-mask", "--reset-position-ids"]
    run(COMMON + docs + ["--metrics-file", str(tmp_path / "docs1.jsonl")], 1, tmp_path / "logs_docs1")
    run(COMMON + docs + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--metrics-file", str(tmp_path / "docs2.jsonl")], 4, tmp_path / "logs_docs2")
    reference = train_losses(tmp_path / "docs1.jsonl")
    _close(train_losses(tmp_path / "docs2.jsonl"), reference, range(1, ITERS + 1))
    assert any(abs(reference[it] - single_process[it]) > 1e-4 for it in reference)  # the masks mattered
    run(COMMON + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                  "2", "2", "--metrics-file", str(tmp_path / "hier.jsonl")], 4, tmp_path / "logs_hier")
    _close(train_losses(tmp_path / "hier.jsonl"), single_process, range(1, ITERS + 1))


@pytest.mark.slow
def test_attention_dropout_same_masks_at_cp2_and_cp4(tmp_path, single_process):
    losses = {}
    for world, cp, comm in ((2, "2", "p2p"), (4, "4", "a2a")):
        out = tmp_path / f"cp{cp}.jsonl"
        assert COMMON[-2:] == ["--attention-dropout", "0"]
        run(COMMON[:-1] + ["0.2", "--context-parallel-size", cp, "--cp-comm-type", comm,
                      "--metrics-file", str(out)], world, tmp_path / f"logs{cp}")
        losses[cp] = train_losses(out)
    _close(losses["4"], losses["2"], range(1, ITERS + 1))
    assert any(abs(losses["2"][it] - single_process[it]) > 1e-4 for it in losses["2"])  # dropout was on
