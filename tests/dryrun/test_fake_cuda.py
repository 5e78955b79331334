"""The fake CUDA device: on this CPU-only machine, fake tensors on "cuda" run forward and
backward, and the kernels take their fused (Triton) path there exactly as on a real GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.dryrun.fake_cuda import ENV_FLAG, shim_path

REPO = Path(__file__).resolve().parents[2]


def fake_cuda_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{ENV_FLAG: "1"})
    env["LD_PRELOAD"] = str(shim_path())
    env.pop("TRITON_INTERPRET", None)  # the compiled-kernel path, as on a GPU
    return env


def test_kernels_take_the_fused_path_on_fake_cuda():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-m", "tests.dryrun.fake_cuda_kernels"], env=fake_cuda_env(),
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


def test_compiled_model_with_fused_kernels_on_fake_cuda_has_no_graph_break():
    """torch.compile(fullgraph=True) of the whole model on fake CUDA: the kernels are custom
    operators (triton_op) with registered autograd, so Dynamo captures every layer, the loss and
    the backward in one graph each, with the kernels in them, and no autograd.Function to break on."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-m", "tests.dryrun.fake_cuda_compile", "gpt2", "llama"],
                         env=fake_cuda_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    family_kernels = {"gpt2": {"norm_forward", "bias_gelu_forward"}, "llama": {"norm_forward", "rotary", "swiglu_forward"}}
    for family, got in result.items():
        assert got["graph_breaks"] == 0 and got["graphs"] == [1, 1], (family, got)
        forward = family_kernels[family] | {"ce_local_stats", "cross_entropy_loss"}
        backward = {k.replace("_forward", "_backward") for k in family_kernels[family]} | {"ce_grad_logits"}
        assert forward <= set(got["kernels"]["forward"]), (family, got["kernels"])
        assert backward <= set(got["kernels"]["backward"]), (family, got["kernels"])
        assert got["loss"] == ["torch.float32", "cuda:0"] and got["grad_devices"] == ["cuda"], (family, got)
