"""The model variants a Megatron-LM checkpoint's args select, on checkpoints Megatron-Core itself
writes (tests/checkpoint/megatron_core_variants.py: TP=2, torch_dist, CPU, gloo): converted by
convert.py --loader megatron, and loaded by pretrain_gpt's --load with the flags the conversion
prints, megalite gives Megatron-Core's logits within 1e-5; each check fails when the variant's
argument is dropped (the logits then move by more than 1e-3).

qk_layernorm, use_rope_scaling, rotary_interleaved, squared_relu and position_embedding_type
'none' (refused before), rotary_seq_len_interpolation_factor as HEAD's builder passes it (dropped
before) and as core_v0.16.1's gpt_builder drops it, the tanh GeLU of Megatron's bias-GeLU fusion,
and layernorm_epsilon under its core_v0.16 name. Two run in the default suite, the rest are slow
(Megatron-Core starts in about 25 s on 2 shared cores, then 2-3 s a variant).
"""

import dataclasses

import pytest
import torch

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.config.arguments import Arguments, model_config_from_args, parse_args
from megalite.convert.cli import main
from megalite.convert.hints import model_flags
from megalite.model.config import GPTConfig
from tests.checkpoint.megatron_core_fixture import ITERATION, VOCAB, tokens
from tests.checkpoint.megatron_core_variants import VARIANTS, write_variant_checkpoints
from tests.distributed import run_distributed

pytest.importorskip("megatron.core")

DEFAULT = ["rotary_seq_len_interpolation_factor", "qk_layernorm"]
SLOW = [name for name in VARIANTS if name not in DEFAULT]
# What the model would be with the variant's argument dropped (or, for a factor Megatron-LM's
# builder did not pass, applied).
DROPPED = {
    "qk_layernorm": {"qk_layernorm": False},
    "use_rope_scaling": {"use_rope_scaling": False},
    "rotary_interleaved": {"rotary_interleaved": False},
    "squared_relu": {"activation": "gelu"},
    "position_embedding_type_none": {"position_embedding_type": "rope"},
    "rotary_seq_len_interpolation_factor": {"rotary_seq_len_interpolation_factor": None},
    "rotary_seq_len_interpolation_factor_0.16.1": {"rotary_seq_len_interpolation_factor": 4.0},
    "bias_gelu_fusion": {"activation": "gelu"},
    "layernorm_epsilon": {"norm_epsilon": 1e-5},
}
NOTES = {"rotary_seq_len_interpolation_factor_0.16.1": "rotary_seq_len_interpolation_factor=4 is not converted"}


def _write(tmp_path_factory, names):
    out = tmp_path_factory.mktemp("megatron_variants")
    run_distributed(write_variant_checkpoints, 2, str(out), names, timeout=600)
    return out


@pytest.fixture(scope="module")
def default_variants(tmp_path_factory):
    return _write(tmp_path_factory, DEFAULT)


@pytest.fixture(scope="module")
def slow_variants(tmp_path_factory):
    return _write(tmp_path_factory, SLOW)


def _megalite_logits(config: GPTConfig, get) -> torch.Tensor:
    """megalite's logits at TP=1 with every full tensor from `get(name)`."""
    from megalite.model.gpt import GPTModel

    model = GPTModel(config, init_seed=0)
    for name, tensor in model.state_dict().items():
        full = get(name)
        tensor.zero_()[: full.shape[0]].copy_(full)  # vocabulary tensors: padding rows stay zero
    model.eval()
    with torch.no_grad():
        return model(tokens())[..., :VOCAB]


def _check_converted(out, name, tmp_path, capsys):
    saved = tmp_path / name
    assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(out / name),
                 "--save-dir", str(saved), "--target-tensor-parallel-size", "2"]) == 0
    printed = capsys.readouterr().out
    if name in NOTES:
        assert NOTES[name] in printed
    converted = MegaliteCheckpoint(saved)
    config = GPTConfig.from_dict(converted.common["model_config"])
    assert converted.iteration == ITERATION
    # The printed flags (common.json's args are what they parse to) rebuild the same model.
    assert model_config_from_args(Arguments.from_dict(converted.common["args"]), config.vocab_size) == config
    reference = torch.load(out / name / "logits.pt", weights_only=True)
    logits = _megalite_logits(config, lambda n: converted.get(f"model/{n}"))
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    dropped = _megalite_logits(dataclasses.replace(config, **DROPPED[name]), lambda n: converted.get(f"model/{n}"))
    assert (dropped - reference).abs().max() > 1e-3, f"{name}: the check could not see the argument dropped"


def _load_and_run(rank, world, checkpoints):
    """pretrain_gpt's --load of each Megatron checkpoint (directory, variant) into a model built
    from the printed flags, at TP = world; the full logits by variant."""
    from megalite.checkpoint.run_load import load_for_run
    from megalite.config.run_config import CheckpointConfig
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout, ParallelState

    pstate = ParallelState.create(ParallelLayout(world, tensor=world))
    results = {}
    for out, name in checkpoints:
        load_dir = f"{out}/{name}"
        source = MegatronCheckpoint(load_dir).config
        config = model_config_from_args(parse_args(model_flags(source)), source.vocab_size)
        [model] = build_model_chunks(config, pstate, init_seed=5)
        args = parse_args(["--load", load_dir, "--finetune", "--auto-detect-ckpt-format"])
        load_for_run(CheckpointConfig.from_args(args), [model], pstate, None)
        model.eval()
        with torch.no_grad():
            local = model(tokens()).contiguous()  # vocab-parallel logits [b, s, V/t]
        pieces = [local]
        if world > 1:
            pieces = [torch.empty_like(local) for _ in range(world)]
            torch.distributed.all_gather(pieces, local, group=pstate.tp_group)
        results[name] = torch.cat(pieces, dim=-1)[..., :VOCAB]
    return results


def _check_loaded(checkpoints, results):
    for out, name in checkpoints:
        reference = torch.load(out / name / "logits.pt", weights_only=True)
        torch.testing.assert_close(results[name], reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", DEFAULT)
def test_converted_variant_gives_megatron_core_logits(default_variants, name, tmp_path, capsys):
    _check_converted(default_variants, name, tmp_path, capsys)


def test_loaded_variants_give_megatron_core_logits(default_variants):
    """--load at TP=1, in this process."""
    checkpoints = [(default_variants, name) for name in DEFAULT]
    _check_loaded(checkpoints, _load_and_run(0, 1, checkpoints))


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_converted_variant_gives_megatron_core_logits_slow(slow_variants, name, tmp_path, capsys):
    _check_converted(slow_variants, name, tmp_path, capsys)


@pytest.mark.slow
def test_every_variant_loaded_at_tp2_gives_megatron_core_logits(default_variants, slow_variants):
    checkpoints = [(default_variants, name) for name in DEFAULT] + [(slow_variants, name) for name in SLOW]
    _check_loaded(checkpoints, run_distributed(_load_and_run, 2, checkpoints)[0])
