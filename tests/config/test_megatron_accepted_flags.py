"""Flags Megatron-LM accepts that megalite used to refuse (issue 24, item 2), each with the
Megatron behaviour it follows named in its test, and --recompute-* without recomputation.
Notes are the start-up lines (config.run_config.startup_notes); a flag that stopped giving its
line, or a check that stopped refusing, fails here."""

import pytest

from megalite.config.arguments import model_config_from_args
from megalite.config.run_config import CheckpointConfig, startup_notes
from tests.config.test_arguments import parsed, refused


def notes_for(extra: str, world_size: int = 1, prefix: str = "") -> list[str]:
    return [n for n in startup_notes(parsed(extra, world_size)) if n.startswith(prefix)]


def test_expert_tensor_parallel_size_on_a_dense_model():
    """Megatron (megatron/training/arguments.py validate_args; parallel_state.py
    initialize_model_parallel): ETP is accepted without experts and only shapes the expert
    groups, whose size ETP x EP x PP must divide the world size. Eight of its GPT functional
    tests (gpt3_mcore_te_tp2_pp2_cp2_etp4_*) give ETP 4 at TP 2."""
    args = parsed("--expert-tensor-parallel-size 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                  8)
    assert model_config_from_args(args, 100).moe is None
    assert [n for n in startup_notes(args) if n.startswith("--expert-tensor-parallel-size")] == [
        "--expert-tensor-parallel-size 4: no effect on a dense model (no --num-experts: there are no expert layers to "
        "split; Megatron accepts it there too)"]
    assert refused("--expert-tensor-parallel-size 4 --pipeline-model-parallel-size 2", 4) == (
        "--expert-tensor-parallel-size 4: the world size 4 is not divisible by it x --expert-model-parallel-size 1 x "
        "--pipeline-model-parallel-size 2 = 8 (Megatron's expert groups need it)")
    assert "needs --num-experts" in refused("--expert-model-parallel-size 2", 2)


def test_disable_gloo_process_groups_says_which_group_remains():
    """Megatron (megatron/training/arguments.py, --disable-gloo-process-groups ->
    use_gloo_process_groups False; parallel_state.initialize_model_parallel creates no Gloo
    groups). megalite creates none beside its backend's except --async-save's writer group."""
    assert notes_for("--disable-gloo-process-groups", prefix="--disable-gloo") == [
        "--disable-gloo-process-groups: megalite creates no Gloo groups beside its backend's (its optimizer "
        "checkpoints need none); the one exception is the group --async-save's background writes use on an NCCL run"]
    assert notes_for("--disable-gloo-process-groups --async-save --save /tmp/x",
                     prefix="--disable-gloo")[0].endswith("on an NCCL run, which this run has")


def test_test_mode_line_depends_on_qk_layernorm():
    """Megatron (megatron/core/transformer/attention.py, Attention.run_realtime_tests): with
    test_mode, the q/k layernorm weights are compared across DP and TP ranks; without
    --qk-layernorm it returns at once. The check itself: tests/training/test_test_mode.py."""
    assert notes_for("--test-mode --qk-layernorm", prefix="--test-mode")[0].startswith(
        "--test-mode: before every iteration the --qk-layernorm weights of every layer are compared")
    assert notes_for("--test-mode", prefix="--test-mode") == [
        "--test-mode: no effect without --qk-layernorm (Megatron's real-time test compares only the query/key "
        "layernorm weights)"]
    assert parsed("--test-mode", 1).test_mode is True


def test_verify_integrity_is_a_checkpoint_option():
    """Megatron (megatron/training/config/training_config.py, CheckpointConfig.__post_init__):
    verify_integrity needs the torch_dist format. The hashing: tests/checkpoint/test_integrity.py."""
    args = parsed("--verify-integrity --save /tmp/x", 1)
    assert CheckpointConfig.from_args(args).verify_integrity is True
    assert refused("--verify-integrity --save /tmp/x --ckpt-format torch") == (
        "--verify-integrity needs --ckpt-format torch_dist (Megatron hashes only torch_dist checkpoints)")
    assert refused("--verify-integrity") == "--verify-integrity needs --save or --load (there is no checkpoint to hash)"


@pytest.mark.parametrize("extra, line", [
    ("--async-save --save /tmp/x --async-strategy mcore --async-ckpt-use-cpu-shm",
     "--async-save (--async-strategy mcore, --async-ckpt-use-cpu-shm): megalite's background writer is PyTorch "
     "DCP's async_save"),
    ("--async-save --save /tmp/x --async-strategy nvrx", "--async-save (--async-strategy nvrx): megalite's"),
    ("--async-strategy mcore", "--async-strategy: no effect without --async-save (as in Megatron)"),
    ("--async-ckpt-use-cpu-shm", "--async-ckpt-use-cpu-shm: no effect without --async-save (as in Megatron)"),
])
def test_async_strategy_and_cpu_shm(extra, line):
    """Megatron (training_config.py __post_init__: async_strategy falls back to mcore without
    async_save; async_utils.py: cpu_shm_mode only with the nvrx strategy)."""
    assert [n for n in startup_notes(parsed(extra, 1)) if n.startswith(line)]
    assert not [n for n in startup_notes(parsed("--async-save --save /tmp/x", 1)) if "--async-strategy" in n]
    assert "is not one of" in refused("--async-strategy fast") or "invalid choice" in refused("--async-strategy fast")


def test_recompute_method_and_layers_without_recompute_are_named():
    """Megatron (megatron/core/transformer/transformer_config.py __post_init__) checks
    recompute_method / recompute_num_layers only when recompute_granularity is set, and ignores
    them otherwise (gpt3_mcore_reruns_resume_check_grads gives --recompute-num-layers 1 alone)."""
    assert notes_for("--recompute-num-layers 1 --recompute-method block", prefix="--recompute") == [
        "--recompute-method block and --recompute-num-layers 1: no effect without --recompute-granularity (nothing "
        "is recomputed; Megatron ignores them there too)"]
    assert model_config_from_args(parsed("--recompute-num-layers 1", 1), 100).recompute_granularity is None
    assert "needs --recompute-granularity full" in refused("--recompute-num-layers 1 --recompute-granularity selective")
