"""The fake CUDA device: on this CPU-only machine, fake tensors on "cuda" run forward and
backward, and the kernels take their fused (Triton) path there exactly as on a real GPU."""

import json
import os
import sys
from pathlib import Path

import pytest

from megalite.dryrun.fake_cuda import ENV_FLAG, shim_path
from tests import program_server

REPO = Path(__file__).resolve().parents[2]


def fake_cuda_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{ENV_FLAG: "1"})
    env["LD_PRELOAD"] = str(shim_path())
    env.pop("TRITON_INTERPRET", None)  # the compiled-kernel path, as on a GPU
    return env


def test_kernels_take_the_fused_path_on_fake_cuda():
    pytest.importorskip("triton")
    out = program_server.run([sys.executable, "-m", "tests.dryrun.fake_cuda_kernels"], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    auto, ref = result["auto"], result["torch"]
    assert auto["auto_is_triton"]
    assert set(auto["ops"]) >= {"norm_forward", "norm_backward", "rotary", "swiglu_forward", "swiglu_backward",
                                "bias_gelu_forward", "bias_gelu_backward", "ce_local_stats"}, auto["ops"]
    assert ref["ops"] == []
    assert auto["out"] == ref["out"]
    assert all(device == "cuda:0" for _, _, device in auto["out"])


def test_compiled_regions_with_fused_kernels_on_fake_cuda_have_no_graph_break():
    """--torch-compile's regions (GPTModel.compile_regions) each compiled with fullgraph=True on
    fake CUDA: the kernels are custom operators (triton_op) with registered autograd and the
    TP collectives map to functional collectives, so Dynamo captures the embedding, one layer
    graph serving every layer, and the head with its loss, forward and backward, with no graph
    break; the kernels end up in the graphs as user-defined Triton kernels, the form inductor
    compiles, the Triton cross-entropy among them; at TP = 2 with sequence parallelism as at
    TP = 1. With the reference loss (no --cross-entropy-loss-fusion) no cross-entropy kernel is
    left. Each family at TP = 1 and at TP = 2, the fused loss at both, the reference loss once (the
    head's loss does not depend on the family): four captures, not all six pairs."""
    pytest.importorskip("triton")
    cases = ["gpt2/tp1-reference-loss", "gpt2/tp2-sp", "llama/tp1", "llama/tp2-sp"]
    out = program_server.run([sys.executable, "-m", "tests.dryrun.fake_cuda_compile", *cases],
                             env=fake_cuda_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    family_kernels = {"gpt2": {"_norm_fwd_kernel", "_bias_gelu_fwd_kernel"},
                      "llama": {"_norm_fwd_kernel", "_rotary_kernel", "_swiglu_fwd_kernel"}}
    cross_entropy = {"_ce_stats_kernel", "cross_entropy_loss", "_ce_grad_kernel"}
    assert list(result) == cases
    for name, got in result.items():
        family, case = name.split("/")
        assert got["graph_breaks"] == 0 and got["graphs"] == [3, 3], (name, got)
        forward, backward = set(got["kernels"]["forward"]), set(got["kernels"]["backward"])
        assert family_kernels[family] <= forward, (name, got["kernels"])
        assert {k.replace("_fwd", "_bwd") for k in family_kernels[family]} <= backward, (name, got["kernels"])
        if case == "tp1-reference-loss":
            assert not cross_entropy & (forward | backward), (name, got["kernels"])
        else:
            assert {"_ce_stats_kernel", "cross_entropy_loss"} <= forward and "_ce_grad_kernel" in backward, \
                (name, got["kernels"])
        assert got["loss"] == ["torch.float32", "cuda:0"] and got["grad_devices"] == ["cuda"], (name, got)
        assert bool(got["collectives"]) == case.startswith("tp2"), (name, got["collectives"])
