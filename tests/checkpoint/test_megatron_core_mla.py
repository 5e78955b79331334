"""A multi-latent attention + MTP checkpoint written by Megatron-Core itself
(megatron_core_mla_fixture.py: TP=2, torch_dist, YaRN with mscale, latent norms, one MTP depth)
converted with convert.py --loader megatron: megalite at TP=1 and TP=2 computes Megatron-Core's
per-token losses and its MTP depth's loss within 1e-5 (fp32); the Hugging Face export gives
transformers' DeepseekV3ForCausalLM the main losses too."""

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from tests.checkpoint.megatron_core_fixture import tokens
from tests.checkpoint.megatron_core_mla_fixture import ITERATION, VOCAB, labels_and_mask, write_mla_checkpoint
from tests.distributed import run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core builds and saves in about a minute on 2 shared cores


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_mla")
    run_distributed(write_mla_checkpoint, 2, str(out), timeout=600)
    return out


def _megalite_losses(rank, world, load_dir):
    """(per-token losses [b, s], MTP depth losses) of the converted checkpoint at TP=world."""
    from megalite.checkpoint.dcp.checkpoint import load_checkpoint
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout, ParallelState

    pstate = ParallelState.create(ParallelLayout(world, tensor=world))
    config = MegaliteCheckpoint(load_dir).config
    [model] = build_model_chunks(config, pstate, init_seed=5)
    load_checkpoint(load_dir, chunks=[model], pstate=pstate, load_rng=False)
    labels, mask = labels_and_mask()
    losses = model(tokens(), labels=labels, loss_mask=mask)  # training mode: the MTP depth runs
    return losses.detach(), [total / calls for total, calls in model.mtp.logged]


@pytest.fixture(scope="module")
def converted(megatron_dir, tmp_path_factory):
    from megalite.convert.cli import main

    out = tmp_path_factory.mktemp("converted")
    assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(megatron_dir / "torch_dist"),
                 "--save-dir", str(out / "tp2"), "--target-tensor-parallel-size", "2"]) == 0
    return out / "tp2"


def test_the_checkpoint_reads_as_mla_with_mtp(megatron_dir):
    checkpoint = MegatronCheckpoint(megatron_dir / "torch_dist")
    config = checkpoint.config
    assert config.mla is not None and config.mla.q_lora_rank == 24 and config.mla.rope_type == "yarn"
    assert config.mla.original_max_position_embeddings == 4096 and config.mtp_num_layers == 1
    checkpoint.check_all_used()  # every stored tensor has a place, the MTP layer's included


@pytest.mark.parametrize("tp", [1, 2])
def test_megalite_gives_megatron_core_losses(megatron_dir, converted, tp):
    reference = torch.load(megatron_dir / "reference.pt", weights_only=True)
    for losses, mtp in run_distributed(_megalite_losses, tp, str(converted)):
        torch.testing.assert_close(losses, reference["losses"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mtp, dtype=torch.float64), reference["mtp"].double(), rtol=1e-5, atol=1e-5)


def test_converted_checkpoint_keeps_iteration(converted):
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

    assert MegaliteCheckpoint(converted).iteration == ITERATION


def test_hf_export_gives_transformers_the_same_losses(megatron_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megalite.convert.cli import main

    hf = tmp_path / "hf"
    assert main(["--loader", "megatron", "--saver", "hf", "--load-dir", str(megatron_dir / "torch_dist"),
                 "--save-dir", str(hf)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    labels, _ = labels_and_mask()
    with torch.no_grad():
        logits = model(tokens()).logits
    assert logits.shape[-1] == VOCAB
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    reference = torch.load(megatron_dir / "reference.pt", weights_only=True)["losses"]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)
