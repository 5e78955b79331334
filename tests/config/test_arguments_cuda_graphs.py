"""Megatron's CUDA-graph flags (--cuda-graph-impl, --cuda-graph-scope, --cuda-graph-warmup-steps,
the deprecated --enable-cuda-graph and --external-cuda-graph): parsed, Megatron's own refusals
(megatron-core 0.16's TransformerConfig and validate_args), megalite's refusals of what its local
graphs cannot capture, each one line naming the flag, and the typed config the loop receives."""

import pytest

from megalite.config.megatron import training as megatron_training
from megalite.config.run_config import run_config
from tests.config.test_arguments import parsed, refused

LOCAL = "--cuda-graph-impl local --attention-dropout 0"


@pytest.fixture
def on_gpu(monkeypatch):
    """Validation as on a machine with CUDA (CPU runs are refused: CUDA graphs need CUDA)."""
    monkeypatch.setattr(megatron_training, "on_cpu", lambda args: False)


def test_flags_parse_with_megatron_defaults():
    args = parsed()
    assert (args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_warmup_steps) == ("none", None, 3)
    assert not args.enable_cuda_graph and not args.external_cuda_graph
    args = parsed("--cuda-graph-impl local --cuda-graph-scope full --cuda-graph-warmup-steps 5")
    assert (args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_warmup_steps) == ("local", ["full"], 5)
    assert "invalid choice" in refused("--cuda-graph-impl graphs")


@pytest.mark.parametrize("extra, message", [
    ("--enable-cuda-graph --cuda-graph-impl local", "--enable-cuda-graph / --external-cuda-graph (deprecated) "
                                                    "and --cuda-graph-impl contradict each other"),
    ("--enable-cuda-graph --external-cuda-graph", "--enable-cuda-graph and --external-cuda-graph contradict"),
    ("--cuda-graph-impl local --cuda-graph-scope layers", "--cuda-graph-scope layers: unknown scope (choose from "
                                                          "full, attn,"),
    ("--cuda-graph-impl local --cuda-graph-scope full attn", "--cuda-graph-scope full (the whole layer) cannot be "
                                                             "combined with other scopes"),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope full_iteration",
     "--cuda-graph-scope full_iteration needs --cuda-graph-impl local, not transformer_engine"),
    ("--cuda-graph-impl local --cuda-graph-scope moe moe_router", "must not contain both moe and moe_router"),
    ("--cuda-graph-impl local --cuda-graph-scope moe_router", "they need --num-experts"),
    ("--cuda-graph-impl local --recompute-granularity full", "--recompute-granularity full with CUDA graphs needs "
                                                             "--cuda-graph-scope full_iteration"),
])
def test_megatron_refusals(extra, message):
    assert message in refused(extra)


@pytest.mark.parametrize("extra, message", [
    ("--cuda-graph-impl transformer_engine", "needs Transformer Engine, which megalite does not use"),
    ("--external-cuda-graph", "needs Transformer Engine, which megalite does not use"),
    (f"{LOCAL} --cuda-graph-scope attn mlp", "--cuda-graph-scope attn mlp: megalite's local CUDA graphs capture "
                                             "whole transformer layers only"),
    (f"{LOCAL} --cuda-graph-scope full_iteration", "--cuda-graph-scope full_iteration: megalite's local"),
    (f"{LOCAL} --cuda-graph-warmup-steps 0", "--cuda-graph-warmup-steps 0: megalite's local CUDA graphs take"),
    ("--cuda-graph-impl local", "not available with --attention-dropout 0.1"),
    ("--enable-cuda-graph", "not available with --attention-dropout 0.1"),
    (f"{LOCAL} --recompute-activations", "not available with --recompute-granularity selective"),
    (f"{LOCAL} --num-experts 4 --disable-bias-linear", "not available with --num-experts"),
    (f"{LOCAL} --use-torch-fsdp2", "not available with --use-torch-fsdp2"),
    (f"{LOCAL} --pipeline-schedule gpipe", "not available with --pipeline-schedule gpipe"),
    (f"{LOCAL} --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
     "not available with --overlap-param-gather"),
])
def test_megalite_refusals(extra, message, on_gpu):
    assert message in refused(extra)


@pytest.mark.parametrize("extra, message", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", "not available with --hidden-dropout with "
                                                           "--sequence-parallel"),
    ("--pipeline-model-parallel-size 2", "not available with --pipeline-model-parallel-size > 1"),
    ("--context-parallel-size 2", "not available with --context-parallel-size > 1"),
])
def test_layout_refusals(extra, message, on_gpu):
    assert message in refused(f"{LOCAL} {extra}", world_size=2)


def test_a_cpu_run_is_refused():
    assert "--cuda-graph-impl local is not available with a CPU run (CUDA graphs need CUDA)" in refused(LOCAL)


@pytest.mark.parametrize("extra, impl, scope, warmup", [
    ("", "none", (), 3),
    (f"{LOCAL} --cuda-graph-scope full --cuda-graph-warmup-steps 2", "local", (), 2),
    ("--enable-cuda-graph --attention-dropout 0", "local", (), 3),
])
def test_typed_config_carries_them(extra, impl, scope, warmup, on_gpu):
    training = run_config(parsed(extra), 1).training
    assert (training.cuda_graph_impl, training.cuda_graph_scope, training.cuda_graph_warmup_steps) == \
        (impl, scope, warmup)


def test_start_up_notes(on_gpu):
    notes = run_config(parsed("--enable-cuda-graph --attention-dropout 0"), 1).notes
    assert "--enable-cuda-graph is deprecated: running with --cuda-graph-impl local, as Megatron does" in notes
    notes = run_config(parsed("--cuda-graph-scope attn"), 1).notes
    assert "--cuda-graph-scope: no effect without --cuda-graph-impl local (Megatron ignores it too)" in notes


def test_validation_can_run_twice(on_gpu):
    args = parsed("--enable-cuda-graph --attention-dropout 0", world_size=1)
    parsed_again = run_config(args, 1)  # validates the validated options again
    assert parsed_again.training.cuda_graph_impl == "local"
