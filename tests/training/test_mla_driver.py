"""A DeepSeek-V3-shaped model through the training driver (`python -m megalite.pretrain_gpt`,
rank processes on gloo): multi-latent attention with YaRN and latent norms, sigmoid
group-limited MoE with expert bias after a dense layer, one multi-token prediction depth.

Its MTP loss is logged beside the lm loss (log line and metrics file) at every iteration, and
the MoE auxiliary loss of the MTP depth's experts with the others'. A run stopped after 2
iterations at PP=2 (MTP and a copy of the embedding on the last stage) and resumed at TP=2 with
sequence parallelism (resharding weights, expert biases and Adam states) continues as an
uninterrupted TP=2 run does: every iteration's lm and MTP losses within 1e-5 relative."""

import pytest

from megalite.training.metrics import read_metrics
from tests.training.launch import run

ITERS = 4
DEEPSEEK = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "211",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
    "--yarn-original-max-position-embeddings", "8",
    "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-layer-freq", "[0]*1+[1]*3",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "1e-2", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-dtype", "fp32", "--moe-shared-expert-intermediate-size", "32", "--moe-router-load-balancing-type",
    "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
    "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "3e-4",
    "--eval-iters", "0", "--eval-interval", "1000",
    "--log-interval", "1", "--num-workers", "0", "--distributed-backend", "gloo", "--seed", "7",
]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _records(path):
    return read_metrics(str(path))[0]


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    ranks = run(DEEPSEEK + TP2_SP + ["--metrics-file", str(tmp / "metrics.jsonl")], 2, tmp / "logs")
    return _records(tmp / "metrics.jsonl"), ranks.output()


def test_mtp_loss_logged_beside_lm_loss(uninterrupted):
    records, output = uninterrupted
    assert sorted(records) == list(range(1, ITERS + 1))
    for record in records.values():
        assert record["mtp_1 loss"] > 0 and record["lm_loss"] > 0
        assert record["seq_load_balancing_loss/layer_4"] > 0  # the MTP depth's experts
    line = next(line for line in output.splitlines() if "iteration        2/" in line)
    assert "lm loss:" in line and " mtp_1 loss: " in line


def test_resume_at_another_layout_continues_the_run(tmp_path, uninterrupted):
    records = uninterrupted[0]
    ckpt = str(tmp_path / "ckpt")
    metrics = ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    run(DEEPSEEK + PP2 + metrics + ["--save", ckpt, "--exit-interval", "2"], 2, tmp_path / "logs")
    run(DEEPSEEK + TP2_SP + metrics + ["--load", ckpt, "--save", ckpt], 2, tmp_path / "logs2")
    resumed = _records(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, ITERS + 1))
    for it in records:
        for key in ("lm_loss", "mtp_1 loss"):
            assert _close(resumed[it][key], records[it][key]), (it, key, resumed[it][key], records[it][key])
