"""--load of a Megatron checkpoint (torch and torch_dist) into a run whose model arguments differ
from the ones its stored args describe: refused in one line naming the flag before any tensor is
read, as for megalite's own checkpoints (megalite.checkpoint.model_match); noted under
--finetune. Before this check only the tensor shapes were compared, so 4 heads of 4 channels
loaded a checkpoint of 2 heads of 8 and computed another model."""

import pytest
import torch

from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.megatron.args import config_from_megatron_args
from megalite.checkpoint.model_match import model_differences
from megalite.checkpoint.run_load import load_for_run
from megalite.config.arguments import model_config_from_args, parse_args
from megalite.config.run_config import CheckpointConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from tests.checkpoint.megatron_files import CONFIG, megatron_args, write_megatron_torch, write_megatron_torch_dist

WRITERS = {"torch": write_megatron_torch, "torch_dist": write_megatron_torch_dist}


def _load(load_dir, config, *flags):
    model = GPTModel(config, init_seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = parse_args(["--load", str(load_dir), "--auto-detect-ckpt-format", "--no-load-optim", *flags])
    return model, before, load_for_run(CheckpointConfig.from_args(args), [model], ParallelState.single(), None)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_more_heads_of_the_same_shape_are_refused_naming_the_flag(tmp_path, fmt, capsys):
    """2 heads of 8 channels stored, 4 heads of 4 asked: every tensor has the stored shape."""
    WRITERS[fmt](tmp_path / "ckpt")
    run = CONFIG.replace(num_attention_heads=4, num_query_groups=None, kv_channels=None)
    assert run.kv_channels == 4
    model = GPTModel(run, init_seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = parse_args(["--load", str(tmp_path / "ckpt"), "--auto-detect-ckpt-format", "--no-load-optim"])
    with pytest.raises(CheckpointError) as error:
        load_for_run(CheckpointConfig.from_args(args), [model], ParallelState.single(), None)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--load ") and (
        "the checkpoint's model has num_attention_heads=2 but this run's has 4 (--num-attention-heads) (and 2 more): "
        "its weights would compute another model") in message
    for name, tensor in model.named_parameters():  # refused before any tensor was loaded
        assert torch.equal(tensor, before[name]), name

    model, before, common = _load(tmp_path / "ckpt", run, "--finetune")
    assert common["finetune"] is False and common["iteration"] == 3
    out = capsys.readouterr().out
    assert "num_attention_heads was 2 in the checkpoint, 4 in this run (--num-attention-heads; a new run from " \
           "these weights)" in out


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_another_epsilon_is_refused_and_the_same_model_loads(tmp_path, fmt):
    WRITERS[fmt](tmp_path / "ckpt", args=megatron_args(norm_epsilon=1e-6))
    with pytest.raises(CheckpointError, match=r"norm_epsilon=1e-06 but this run's has 1e-05 \(--norm-epsilon\)"):
        _load(tmp_path / "ckpt", CONFIG)
    model, _, common = _load(tmp_path / "ckpt", CONFIG.replace(norm_epsilon=1e-6))
    assert common["iteration"] == 3


def test_a_megatron_gpt2_run_matches_megalite_flags_for_the_same_model():
    """Megatron's validate_args turns add_qkv_bias on with biases and its MLP computes tanh-GeLU
    under the default bias-GeLU fusion: the same Megatron flags given to megalite build the model
    the stored args describe, so nothing is refused; --no-bias-gelu-fusion on one side only is."""
    stored_args = megatron_args(swiglu=False, add_bias_linear=True, add_qkv_bias=True, normalization="LayerNorm",
                                position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
                                bias_gelu_fusion=True)
    stored = config_from_megatron_args(stored_args, 64, "ckpt").to_dict()
    flags = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
             "--ffn-hidden-size", "32", "--make-vocab-size-divisible-by", "8"]
    run = model_config_from_args(parse_args(flags), 64)
    assert model_differences(stored, run) == []
    exact = model_config_from_args(parse_args([*flags, "--no-bias-gelu-fusion"]), 64)
    assert [d[:4] for d in model_differences(stored, exact)] == [
        ("activation", "--swiglu / --squared-relu / --openai-gelu / --no-bias-gelu-fusion", "openai_gelu", "gelu")]
