"""A Gated DeltaNet hybrid (linear every other layer, gated attention, MoE) dry-runs at TP2 SP x CP2
with the distributed optimizer over DP2 on the fake process group without stopping (the linear layers'
fake-tensor kernels, the unequal TP blocks in the gradient buffers, their context-parallel
all-to-alls): bytes held equal formulas.md's and activations are measured. (PP2 with virtual stages
was run by hand: see notes.)"""

from tests.dryrun.dry_run_json import reports
from tests.dryrun.test_dry_run import SMALL

GDN = ("--experimental-attention-variant gdn --linear-attention-freq 2 --linear-key-head-dim 8 "
       "--linear-value-head-dim 8 --linear-num-key-heads 4 --linear-num-value-heads 8 --attention-output-gate "
       "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --dry-run-device cpu").split()


def _one_stage(argv):
    """SMALL without its pipeline: TP2 x CP2 x DP2, on two layers (one linear, one full) and one
    micro-batch per DP rank (global batch 4): what the assertions need, at half the dry run's ops."""
    out, skip = [], {"--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                     "--dry-run-world-size", "--num-layers", "--global-batch-size"}
    for i, word in enumerate(argv):
        if word in skip or (i and argv[i - 1] in skip):
            continue
        out.append(word)
    return out + ["--dry-run-world-size", "8", "--context-parallel-size", "2", "--num-layers", "2",
                  "--global-batch-size", "4"]


def test_gdn_hybrid_dry_run_holds_the_formula_bytes():
    got = reports(_one_stage(list(SMALL)) + GDN)
    assert [r.rank for r in got] == [0]
    for r in got:
        assert r.resident == r.formula
        assert r.peak["activations"] > 0
        assert r.comm[("cp", "all-to-all")] > 0  # the linear layers' (the full layers' ring sends)
