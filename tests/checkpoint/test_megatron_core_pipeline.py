"""Megatron-Core's own checkpoints with virtual pipeline stages (model0 / model1 in each
model_optim_rng.pt; the chunks' sharded state dicts in torch_dist) and its `release` checkpoints
(tests/checkpoint/megatron_core_pipeline.py: GPTModel at TP=1 PP=2 with 2 virtual stages on CPU)
load into megalite at PP=2, with and without virtual stages, and give Megatron-Core's logits
within 1e-5 in fp32. A release checkpoint starts at iteration 0 and gives the weights only, as
Megatron loads it."""

import pytest
import torch

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from tests.checkpoint.megatron_core_fixture import ITERATION
from tests.checkpoint.megatron_core_pipeline import megalite_pipeline_logits, write_megatron_vp_checkpoints
from tests.distributed import run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core builds and saves in about 1 min on 2 shared cores
FORMATS = {"torch": ITERATION, "torch_dist": ITERATION, "release": 0}


@pytest.fixture(scope="module")
def megatron_vp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_vp")
    run_distributed(write_megatron_vp_checkpoints, 2, str(out), "llama", timeout=900)
    return out


def test_the_files_are_megatron_virtual_stage_files(megatron_vp_dir):
    legacy = MegatronCheckpoint(megatron_vp_dir / "torch")
    assert legacy.files.chunk_keys == ["model0", "model1"] and (legacy.files.tp, legacy.files.pp) == (1, 2)
    # chunk-major: Megatron's rank p chunk c holds global layer 2c + p
    assert legacy.files.layers == [(0, "model0", 0), (1, "model0", 0), (0, "model1", 0), (1, "model1", 0)]
    release = MegatronCheckpoint(megatron_vp_dir / "release")
    assert release.path.name == "release" and release.iteration == 0
    for name in legacy.names():
        assert torch.equal(legacy.get(name), release.get(name)), name


@pytest.mark.parametrize("vp", [1, 2])
def test_megalite_pipeline_gives_megatron_core_logits(megatron_vp_dir, vp):
    reference = torch.load(megatron_vp_dir / "logits.pt", weights_only=True)
    results = run_distributed(megalite_pipeline_logits, 2, [str(megatron_vp_dir / f) for f in FORMATS], vp)
    assert all(logits is None for logits, _ in results[0])  # only the last stage has logits
    for (fmt, iteration), (logits, loaded) in zip(FORMATS.items(), results[1]):
        assert loaded == iteration, fmt
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")
