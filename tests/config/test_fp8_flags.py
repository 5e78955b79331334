"""Megatron's FP8 / FP4 flags (megalite/config/fp8.py): the served ones reach the run's
Fp8Recipe with Megatron's defaults and meaning; the others stop in one line naming the flag and
what it needs (mxfp8 / NVFP4: Blackwell; blockwise: Hopper, and not with FP8 all-gathers under
FSDP2; FP8 attention: an FP8 attention kernel), never accepted and ignored; --fp8-param-gather is served with one line (FP8
all-gathers under FSDP2: tests/parallel/test_fp8_layouts.py)."""

import pytest

from megalite.config.fp8 import fp8_notes, fp8_recipe_from_args
from megalite.parallel.tensor.fp8_scaling import Fp8Recipe
from tests.config.test_arguments import parsed, refused


def test_megatron_defaults():
    assert fp8_recipe_from_args(parsed("", 1)) is None
    assert fp8_recipe_from_args(parsed("--fp8-format e4m3", 1)) == Fp8Recipe(
        format="e4m3", scaling="delayed", margin=0, amax_history_len=1, amax_compute_algo="most_recent",
        wgrad=True, tp_only_amax_reduction=False, bf16_layers_at_start=0, bf16_layers_at_end=0)


@pytest.mark.parametrize("extra, field, value", [
    ("--fp8-format hybrid", "format", "hybrid"),
    ("--fp8-format e4m3 --fp8-recipe tensorwise", "scaling", "tensorwise"),
    ("--fp8-format hybrid --fp8-recipe blockwise", "scaling", "blockwise"),
    ("--fp8-format hybrid --fp8-recipe blockwise --no-fp8-wgrad", "wgrad", False),
    ("--fp8-format e4m3 --fp8-recipe delayed", "scaling", "delayed"),
    ("--fp8-format e4m3 --fp8-margin 2", "margin", 2),
    ("--fp8-format e4m3 --fp8-amax-history-len 1024", "amax_history_len", 1024),
    ("--fp8-format e4m3 --fp8-amax-compute-algo max", "amax_compute_algo", "max"),
    ("--fp8-format e4m3 --no-fp8-wgrad", "wgrad", False),
    ("--fp8-format e4m3 --tp-only-amax-red", "tp_only_amax_reduction", True),
    ("--fp8-format e4m3 --first-last-layers-bf16", "bf16_layers_at_start", 1),
    ("--fp8-format e4m3 --first-last-layers-bf16", "bf16_layers_at_end", 1),
    ("--fp8-format e4m3 --first-last-layers-bf16 --num-layers-at-start-in-bf16 0", "bf16_layers_at_start", 0),
    ("--fp8-format e4m3 --first-last-layers-bf16 --num-layers-at-end-in-bf16 2", "bf16_layers_at_end", 2),
])
def test_served_flags_reach_the_recipe(extra, field, value):
    assert getattr(fp8_recipe_from_args(parsed(extra, 1)), field) == value


def test_torch_compile_is_served_with_fp8():
    """tests/parallel/tensor/test_fp8_model.py checks the compiled FP8 run against the eager one."""
    assert parsed("--fp8-format hybrid --torch-compile", 1).torch_compile


def test_fp8_interval_is_accepted_with_its_deprecation_line():
    notes = fp8_notes(parsed("--fp8-format hybrid --fp8-interval 4", 1))
    assert len(notes) == 1 and notes[0].startswith("--fp8-interval 4: deprecated")


def test_fp8_param_gather_is_served_with_one_line_under_the_distributed_optimizer():
    """The distributed optimizer gathers the 16-bit weights, each GEMM quantizing them; the recipe is
    the one without the flag."""
    args = parsed("--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer", 2)
    notes = fp8_notes(args)
    assert len(notes) == 1 and notes[0].startswith("--fp8-param-gather: the parameters stay 16-bit"), notes
    assert fp8_recipe_from_args(args) == fp8_recipe_from_args(parsed("--fp8-format hybrid --use-distributed-optimizer", 2))


def test_fp8_param_gather_under_fsdp2_gathers_fp8_weights():
    args = parsed("--fp8-format hybrid --fp8-param-gather --use-torch-fsdp2", 2)
    notes = fp8_notes(args)
    assert len(notes) == 1 and notes[0].startswith("--fp8-param-gather with --use-torch-fsdp2: each FP8 linear's "
                                                   "weight shard is cast to FP8"), notes
    assert fp8_recipe_from_args(args).param_gather
    assert not fp8_recipe_from_args(parsed("--fp8-format hybrid --use-torch-fsdp2", 2)).param_gather


def test_moe_runs_say_which_gemms_stay_16_bit():
    notes = fp8_notes(parsed("--fp8-format hybrid --num-experts 4 --disable-bias-linear", 1))
    assert any("--num-experts" in n and "routed experts" in n for n in notes), notes


@pytest.mark.parametrize("extra, words", [
    ("--fp8-format e4m3 --fp8-recipe mxfp8", ["--fp8-recipe mxfp8", "Blackwell", "Hopper"]),
    ("--fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather --use-torch-fsdp2",
     ["--fp8-param-gather with --fp8-recipe blockwise under --use-torch-fsdp2", "128x128"]),
    ("--fp8-format e4m3 --fp8-recipe blockwise --fp8-margin 0", ["--fp8-margin", "delayed only"]),
    ("--fp8-format e4m3 --fp8-recipe custom", ["--fp8-recipe custom", "--fp8-quantizer-factory"]),
    ("--fp4-format e2m1", ["--fp4-format", "Blackwell", "Hopper"]),
    ("--fp4-recipe nvfp4", ["--fp4-recipe", "Blackwell"]),
    ("--fp4-param-gather", ["--fp4-param-gather", "Blackwell"]),
    ("--fp8-format hybrid --fp8-param-gather", ["--fp8-param-gather", "--use-distributed-optimizer"]),
    ("--fp8-param-gather --use-distributed-optimizer", ["--fp8-param-gather", "needs --fp8-format"]),
    ("--fp8-format hybrid --fp8-param-gather --use-torch-fsdp2 --tp-only-amax-red",
     ["--tp-only-amax-red with --fp8-param-gather under --use-torch-fsdp2", "DP x CP"]),
    ("--fp8-format hybrid --fp8-param-gather --use-torch-fsdp2 --torch-compile",
     ["--torch-compile with --fp8-param-gather under --use-torch-fsdp2", "eager"]),
    ("--fp8-format hybrid --fp8-dot-product-attention", ["--fp8-dot-product-attention", "FP8 attention kernel"]),
    ("--fp8-format hybrid --fp8-multi-head-attention", ["--fp8-multi-head-attention", "FP8 attention kernel"]),
    ("--fp8-margin 0", ["--fp8-margin needs --fp8-format"]),
    ("--fp8-interval 1", ["--fp8-interval needs --fp8-format"]),
    ("--fp8-recipe delayed", ["--fp8-recipe needs --fp8-format"]),
    ("--no-fp8-wgrad", ["--no-fp8-wgrad needs --fp8-format"]),
    ("--first-last-layers-bf16", ["--first-last-layers-bf16 needs --fp8-format"]),
    ("--tp-only-amax-red", ["--tp-only-amax-red needs --fp8-format"]),
    ("--fp8-format e4m3 --fp8-recipe tensorwise --fp8-amax-history-len 16", ["--fp8-amax-history-len", "delayed only"]),
    ("--fp8-format e4m3 --fp8-recipe tensorwise --fp8-margin 0", ["--fp8-margin", "delayed only"]),
    ("--fp8-format e4m3 --fp8-recipe tensorwise --tp-only-amax-red", ["--tp-only-amax-red", "delayed only"]),
    ("--fp8-format e4m3 --fp8-amax-history-len 0", ["--fp8-amax-history-len", "at least 1"]),
    ("--fp8-format e4m3 --fp8-margin -1", ["--fp8-margin", "negative"]),
    ("--fp8-format e4m3 --num-layers-at-start-in-bf16 1", ["--num-layers-at-start-in-bf16", "--first-last-layers-bf16"]),
    ("--fp8-format e4m3 --first-last-layers-bf16 --num-layers-at-end-in-bf16 99", ["--num-layers-at-end-in-bf16 99"]),
])
def test_refused_in_one_line_naming_the_flag(extra, words):
    message = refused(extra)
    assert all(w in message for w in words), message


def test_blockwise_says_where_its_gemms_run(monkeypatch):
    """CPU: emulated; Hopper: torch's kernel, emulated where a reduction dimension is not a
    multiple of 128; another GPU: emulated. Below Hopper: refused."""
    import torch

    from megalite.config import fp8

    def note(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        return [n for n in fp8_notes(parsed("--fp8-format hybrid --fp8-recipe blockwise", 1)) if "blockwise" in n]

    assert note((9, 0)) == ["--fp8-recipe blockwise on CPU: the block-scaled GEMMs are emulated (the operands "
                            "dequantized with their block scales, multiplied in fp32)"]
    monkeypatch.setattr(fp8, "on_cpu", lambda args: False)
    assert len(note((9, 0))) == 1 and "not a multiple of 128 are emulated" in note((9, 0))[0]
    assert len(note((10, 0))) == 1 and "Hopper (9.0) only; on this GPU the GEMMs are emulated" in note((10, 0))[0]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    message = refused("--fp8-format hybrid --fp8-recipe blockwise")
    assert message.startswith("--fp8-recipe blockwise: block-scaled FP8 GEMMs need Hopper") and "8.9" in message
    assert fp8.fp8_recipe_from_args(parsed("--fp8-format hybrid --fp8-recipe tensorwise", 1)).scaling == "tensorwise"


def test_tp_comm_overlap_with_fp8_runs_without_the_overlap_and_says_so():
    from megalite.config.dist_opt import tp_comm_overlap_settings

    flags = "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
    args = parsed("--fp8-format hybrid " + flags, 2)
    assert tp_comm_overlap_settings(args) is None
    assert any(n.startswith("--tp-comm-overlap with --fp8-format: the FP8 linears run without the overlap")
               for n in fp8_notes(args)), fp8_notes(args)
    assert tp_comm_overlap_settings(parsed(flags, 2)) is not None


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    import torch

    from megalite.config import fp8

    monkeypatch.setattr(fp8, "on_cpu", lambda args: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    message = refused("--fp8-format hybrid")
    assert "compute capability 8.9" in message and "A100" in message and "8.0" in message, message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fp8.fp8_recipe_from_args(parsed("--fp8-format hybrid", 1)).format == "hybrid"
