"""The training driver with context parallelism (`python -m megalite.pretrain_gpt`, four rank
processes on gloo): five iterations' losses at CP = 2 with TP = 2 and sequence parallelism,
with PP = 2 interleaved, with DP = 2 and the distributed optimizer, and at CP = 4, each equal
to the single-process run within 1e-5; a checkpoint saved at CP = 2 resumes at CP = 1 and at
CP = 4 with the uninterrupted run's losses. Also: documents split across chunks
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
], ids=["cp2-tp2-sp-p2p", "cp2-pp2-interleaved-a2a", "cp2-dp2-distopt-all_gather", "cp4-a2a"])
def test_training_losses_equal_single_process(tmp_path, single_process, layout):
    run(COMMON + layout + ["--metrics-file", str(tmp_path / "metrics.jsonl")], 4, tmp_path / "logs")
    _close(train_losses(tmp_path / "metrics.jsonl"), single_process, range(1, ITERS + 1))


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path, single_process):
    saved = tmp_path / "cp2"
    run(COMMON + ["--context-parallel-size", "2", "--use-distributed-optimizer", "--save", str(saved / "ckpt"),
                  "--save-interval", "3", "--exit-interval", "3",
                  "--metrics-file", str(saved / "metrics.jsonl")], 4, saved / "logs")
    _close(train_losses(saved / "metrics.jsonl"), single_process, range(1, 4))
    for world, cp in ((1, "1"), (4, "4")):
        resumed = tmp_path / f"cp{cp}"
        shutil.copytree(saved / "ckpt", resumed / "ckpt")
        extra = ["--use-distributed-optimizer"] if world > 1 else []
        run(COMMON + extra + ["--context-parallel-size", cp, "--load", str(resumed / "ckpt"),
                              "--metrics-file", str(resumed / "metrics.jsonl")], world, resumed / "logs")
        _close(train_losses(resumed / "metrics.jsonl"), single_process, range(4, ITERS + 1))


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
