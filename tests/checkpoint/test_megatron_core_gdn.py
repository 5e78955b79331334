"""A Gated DeltaNet hybrid checkpoint written by Megatron-Core itself (megatron_core_gdn_fixture.py:
TP=2, a GatedDeltaNet layer then a gated full-attention layer, `torch_dist` and `torch`)
converted with convert.py --loader megatron: megalite at TP=1 and TP=2 gives Megatron-Core's
logits within 1e-5 (fp32), and so does --load of the Megatron checkpoint itself.

Megatron-Core's GatedDeltaNet needs flash-linear-attention (`fla`), whose chunked kernel does
not run on this CPU: the fixture supplies a stand-in `fla` (tests/checkpoint/fla_standin: plain
torch l2norm) and runs Megatron-Core in deterministic_mode, where the delta rule is Megatron's own
torch_chunk_gated_delta_rule. The fast check of the same name mapping (hand-built checkpoints in
Megatron's names and shapes, both formats, Transformer Engine's fused norm name):
test_megatron_gdn_names.py."""

import pytest
import torch

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from tests.checkpoint.megatron_core_fixture import megalite_logits
from tests.checkpoint.megatron_core_gdn_fixture import ITERATION, write_gdn_checkpoints
from tests.distributed import run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core builds and saves in about two minutes on 2 shared cores
TARGETS = {("torch_dist", 2), ("torch_dist", 1), ("torch", 2)}


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_gdn")
    keys = run_distributed(write_gdn_checkpoints, 2, str(out), timeout=900)[0]
    assert "decoder.layers.0.self_attention.in_proj.weight" in keys  # layer 0 is Megatron's GatedDeltaNet
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in keys
    return out


@pytest.fixture(scope="module")
def converted(megatron_dir, tmp_path_factory):
    """{(format, target TP): converted megalite checkpoint}."""
    from megalite.convert.cli import main

    out, dirs = tmp_path_factory.mktemp("gdn_converted"), {}
    for fmt, tp in sorted(TARGETS):
        dirs[fmt, tp] = out / f"{fmt}_tp{tp}"
        assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(megatron_dir / fmt),
                     "--save-dir", str(dirs[fmt, tp]), "--target-tensor-parallel-size", str(tp)]) == 0
    return dirs


def _megalite_logits(rank, world, load_dirs, megatron_dir):
    """Full logits of each converted checkpoint at TP=world (those converted for TP=world), then
    of the Megatron checkpoint itself given to --load (--finetune)."""
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from megalite.parallel.state import ParallelLayout, ParallelState

    out = []
    pstate = ParallelState.create(ParallelLayout(world, tensor=world))
    for load_dir in [*load_dirs, megatron_dir]:
        from_megatron = load_dir == megatron_dir
        source = MegatronCheckpoint(load_dir) if from_megatron else MegaliteCheckpoint(load_dir)
        out.append(megalite_logits(source, load_dir, from_megatron, pstate, world))
    return out


def test_the_checkpoint_reads_as_a_gdn_hybrid(megatron_dir):
    for fmt in ("torch_dist", "torch"):
        checkpoint = MegatronCheckpoint(megatron_dir / fmt)
        config = checkpoint.config
        assert config.gdn.layer_pattern(2) == (1, 0) and config.attention_output_gate
        assert (config.gdn.linear_num_key_heads, config.gdn.linear_num_value_heads) == (2, 4)
        checkpoint.check_all_used()  # every block of in_proj and conv1d, A_log, dt_bias, out_norm has a place
    stored = MegatronCheckpoint(megatron_dir / "torch_dist").stored
    assert "decoder.layers.0.self_attention.in_proj.weight.alpha" in stored  # Megatron's split blocks


@pytest.mark.parametrize("tp", [1, 2])
def test_megalite_gives_megatron_core_logits(megatron_dir, converted, tp):
    reference = torch.load(megatron_dir / "logits.pt", weights_only=True)
    names = [(fmt, t) for fmt, t in sorted(TARGETS) if t == tp]
    dirs = [str(converted[key]) for key in names]
    for per_rank in run_distributed(_megalite_logits, tp, dirs, str(megatron_dir / "torch_dist")):
        for name, logits in zip([*names, "--load torch_dist"], per_rank):
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_converted_checkpoint_keeps_iteration(converted):
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

    assert MegaliteCheckpoint(converted["torch_dist", 2]).iteration == ITERATION
