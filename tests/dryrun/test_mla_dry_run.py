"""Multi-latent attention and multi-token prediction on the fake CUDA device (a dry run, as an
H100 would run them: values narrower than queries take memory-efficient attention there, the
flash kernel needing one head width): the most activations each pipeline stage holds against
the activation formula with MLA's terms, and each MTP depth counted on the last stage
(megalite/dryrun/README.md, "FLOPs and memory of MLA and MTP"), within 10%; held bytes equal formulas.md's, the routers'
expert biases included. A dense MLA model (DeepSeek-V3's head widths and latent ranks scaled
down, Korthikanti's MLP term being a dense MLP's) at TP=2 PP=2, with and without sequence
parallelism."""

import json
import sys

import pytest

from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env

MLA_LAYERS = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 4 --hidden-size 1024 "
              "--num-attention-heads 16 --swiglu --normalization RMSNorm --position-embedding-type rope "
              "--disable-bias-linear --untie-embeddings-and-output-weights --multi-latent-attention --q-lora-rank 256 "
              "--kv-lora-rank 128 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
              "--rope-type yarn --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 "
              "--seq-length 2048 --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 1 "
              "--attention-dropout 0 --hidden-dropout 0 --bf16 --use-distributed-optimizer "
              "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --dry-run --dry-run-world-size 4")


@pytest.mark.slow  # two dry runs of about 45 s on 2 shared cores
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_mla_and_mtp_activations_within_10_percent_of_the_formula(sequence_parallel):
    argv = MLA_LAYERS.split() + (["--sequence-parallel"] if sequence_parallel else [])
    out = program_server.run([sys.executable, "-m", "tests.dryrun.dry_run_json", *argv], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    stages = json.loads(out.stdout)
    assert [r["coords"][2] for r in stages] == [0, 1]
    for report in stages:
        assert report["resident"] == report["formula"], report["rank"]
        ratio = report["activation_peak"] / report["korthikanti"]
        assert 0.9 <= ratio <= 1.1, (report["rank"], ratio, report["activation_peak"], report["korthikanti"])
