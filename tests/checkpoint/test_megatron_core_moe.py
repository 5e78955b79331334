"""Mixture-of-experts checkpoints written by Megatron-Core itself (megatron_core_moe_fixture.py:
TP=2, EP=2, ETP=1, --moe-layer-freq [0,1], torch_dist; "plain" softmax routing and "shared":
sigmoid routing with the expert bias and a gated shared expert) converted with convert.py
--loader megatron: megalite at target EP=1 and EP=2 (TP=2, and ETP 1 or 2) gives Megatron-Core's
logits within 1e-5 (fp32), and so does --load of the Megatron checkpoint itself, in `torch_dist`
and in the legacy `torch` format (mp_rank_TT_EEE files: Megatron-Core's per-rank state dicts). One spawn writes both kinds; one spawn per kind reads every target."""

import pytest
import torch

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.checkpoint.publish import ConversionError
from tests.checkpoint.megatron_core_fixture import megalite_logits
from tests.checkpoint.megatron_core_moe_fixture import ITERATION, KINDS, megatron_args, write_moe_checkpoints
from tests.distributed import run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core builds and saves both kinds in about a minute on 2 shared cores
TARGETS = {"ep1": ["--target-expert-parallel-size", "1"],
           "ep2": ["--target-expert-parallel-size", "2", "--target-expert-tensor-parallel-size", "1"]}


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_moe")
    run_distributed(write_moe_checkpoints, 4, str(out), timeout=600)
    return out


@pytest.fixture(scope="module")
def converted(megatron_dir, tmp_path_factory):
    """{(kind, target): converted megalite checkpoint} at TP=2."""
    from megalite.convert.cli import main

    out, dirs = tmp_path_factory.mktemp("moe_converted"), {}
    for kind in KINDS:
        for target, flags in TARGETS.items():
            dirs[kind, target] = out / f"{kind}_{target}"
            assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(megatron_dir / kind),
                         "--save-dir", str(dirs[kind, target]), "--target-tensor-parallel-size", "2", *flags]) == 0
    return dirs


def _megalite_logits(rank, world, load_dirs, megatron_dirs):
    """Full logits of each converted checkpoint, at the layout it was converted for, then of
    the Megatron checkpoints themselves (torch_dist, torch) given to --load (--finetune) at TP2
    EP2 ETP1."""
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from megalite.parallel.expert.groups import ExpertState
    from megalite.parallel.state import ParallelLayout, ParallelState

    out = []
    for load_dir in [*load_dirs, *megatron_dirs]:
        from_megatron = load_dir in megatron_dirs
        source = MegatronCheckpoint(load_dir) if from_megatron else MegaliteCheckpoint(load_dir)
        layout = {"ep": 2, "etp": 1} if from_megatron else source.common["layout"]
        pstate = ParallelState.create(ParallelLayout(world, tensor=2))
        pstate.expert = ExpertState.create(pstate, layout.get("ep", 1), source.config.moe.num_experts, None,
                                           layout.get("etp", 2))
        out.append(megalite_logits(source, load_dir, from_megatron, pstate, 2))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_megalite_gives_megatron_core_logits(megatron_dir, converted, kind):
    reference = torch.load(megatron_dir / kind / "logits.pt", weights_only=True)
    dirs = [str(converted[kind, t]) for t in TARGETS]
    loads = [str(megatron_dir / kind), str(megatron_dir / f"{kind}_torch")]
    for per_rank in run_distributed(_megalite_logits, 4, dirs, loads):
        assert len(per_rank) == len(TARGETS) + 2
        for target, logits in zip([*TARGETS, "--load torch_dist", "--load torch"], per_rank):
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{target}: {m}")


def test_the_checkpoint_reads_as_moe(megatron_dir):
    shared = MegatronCheckpoint(megatron_dir / "shared")
    moe = shared.config.moe
    assert moe.num_experts == 4 and moe.layer_pattern(2) == [0, 1] and moe.enable_expert_bias
    assert moe.shared_expert_gate and moe.score_function == "sigmoid"
    shared.check_all_used()  # the router, its expert bias, every expert and the shared expert have a place
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in shared.stored
    assert not any(n.startswith("decoder.layers.0.mlp.experts") for n in shared.stored)  # layer 0 is dense
    legacy = MegatronCheckpoint(megatron_dir / "shared_torch")
    assert sorted(p.parent.name for p in legacy.files.all_paths.values()) == ["mp_rank_00_000", "mp_rank_01_001"]
    legacy.check_all_used()
    for name in shared.names():
        torch.testing.assert_close(legacy.get(name), shared.get(name), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    bias = shared.get("layers.1.mlp.router.expert_bias")
    torch.testing.assert_close(bias, torch.linspace(-0.2, 0.3, 4))


def test_hf_export_of_a_family_hugging_face_lacks_is_refused_in_one_line(megatron_dir, tmp_path):
    """Sigmoid routing with an expert bias but no MLA is no Hugging Face family megalite writes:
    refused naming the router, nothing written."""
    from megalite.convert.megatron_converters import megatron_to_hf

    with pytest.raises(ConversionError, match="cannot be a Hugging Face model: .*router"):
        megatron_to_hf(megatron_dir / "shared", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
