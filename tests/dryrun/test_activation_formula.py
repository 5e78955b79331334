"""Korthikanti et al.'s activation memory (formulas.md) against what a dry run holds.

`layers_in_flight` counts what each pipeline schedule keeps (formulas.md's table: GPipe m
micro-batches, 1F1B p - r on stage r, interleaved 1F1B 1 + (p-1)/(p·v) times 1F1B's on stage 0).
The slow tests dry-run Llama-3 8B's layer shapes (GQA, SwiGLU, RMSNorm, rotary; bf16, s = 8192)
at TP=2 PP=2 with and without sequence parallelism on the fake CUDA device, where attention is
flash attention as on an H100, and find the most activations stage 0 holds within 10% of the
formula without the s x s scores term.
"""

import json
import sys

import pytest

from megalite.dryrun.formulas import layers_in_flight
from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env


def test_layers_in_flight_follow_formulas_md():
    assert [layers_in_flight("1f1b", 4, r, 8, [5]) for r in range(4)] == [20, 15, 10, 5]
    assert layers_in_flight("1f1b", 4, 0, 2, [5]) == 10  # fewer micro-batches than stages
    assert layers_in_flight("gpipe", 4, 0, 8, [5]) == 40
    assert layers_in_flight("none", 1, 0, 8, [5]) == 5
    # interleaved, p = 4, v = 2, one layer per chunk: 2 layers per rank x p x (1 + 3/8)
    assert layers_in_flight("interleaved_1f1b", 4, 0, 8, [1, 1]) == 2 * 4 * (1 + 3 / 8)
    # ZB-H1 frees a micro-batch's activations at its weight-gradient half, as 1F1B does at B
    assert layers_in_flight("zb_h1", 4, 0, 8, [5]) == 20


LLAMA_8B_LAYERS = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --hidden-size 4096 "
                   "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
                   "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
                   "--disable-bias-linear --untie-embeddings-and-output-weights --seq-length 8192 "
                   "--micro-batch-size 1 --lr 3e-4 --train-iters 1 --attention-dropout 0 --hidden-dropout 0 --bf16 "
                   "--use-distributed-optimizer --num-layers 16 --tensor-model-parallel-size 2 "
                   "--pipeline-model-parallel-size 2 --global-batch-size 4 --dry-run-world-size 4 --dry-run")


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_llama_activations_within_10_percent_of_korthikanti(sequence_parallel):
    argv = LLAMA_8B_LAYERS.split() + (["--sequence-parallel"] if sequence_parallel else [])
    out = program_server.run([sys.executable, "-m", "tests.dryrun.dry_run_json", *argv], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    first = json.loads(out.stdout)[0]
    assert first["coords"][2] == 0
    ratio = first["activation_peak"] / first["korthikanti"]
    assert 0.9 <= ratio <= 1.1, (ratio, first["activation_peak"], first["korthikanti"])
