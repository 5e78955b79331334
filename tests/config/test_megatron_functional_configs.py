"""Megatron-LM's GPT functional-test configs (tests/functional_tests/test_cases/gpt/*/model_config.yaml
at the commit tests/config/megatron_gpt_functional_configs.json names, vendored as the command
lines Megatron's _run_training.sh builds and the world sizes of their recipes, by
tools/megatron_functional_configs.py extract): every config parses and validates for its own world
size unless it stops on a flag from the list below, each with the reason megalite refuses it.
A refusal for any other reason fails, and so does a count of accepted configs below ACCEPTED."""

import importlib.util
import re
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "megatron_functional_configs.py"
ACCEPTED = 152  # of 161 in-scope configs at Megatron-LM d98e8a6 (108 before issues 24 and 25, 150 before FP8)

# What may still stop a config: (pattern of megalite's one-line refusal, why)
STILL_REFUSED = [
    (r"--experimental-attention-variant", "the gated-delta-net attention variant and DeepSeek sparse attention "
     "(its indexer) are not in megalite"),
    (r"--export-te-mcore-model", "ModelOpt knowledge distillation (not in megalite)"),
    (r"^--hierarchical-context-parallel-sizes expects integers, got '2 2'$",
     "the YAML value '2 2' reaches Megatron as one word, which its argparse (type=int) refuses too"),
]


def _tool():
    spec = importlib.util.spec_from_file_location("megatron_functional_configs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def counted():
    tool = _tool()
    return tool.count(tool.load())


def test_every_refusal_is_a_known_one(counted):
    unexplained = {case: error for case, error in counted["refused"].items()
                   if not any(re.search(pattern, error) for pattern, _ in STILL_REFUSED)}
    assert unexplained == {}


def test_accepted_count(counted):
    total = len(counted["accepted"]) + len(counted["refused"])
    assert total == 161
    assert len(counted["accepted"]) >= ACCEPTED, sorted(counted["refused"])
    # the configs of this flags are among them
    for case in ("gpt3_mcore_te_tp2_pp2_cp2_etp4_dp_last", "gpt3_mcore_reruns_transient",
                 "gpt3_mcore_reruns_persistent_1", "gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset",
                 "gpt3_mcore_te_tp1_pp1_mup", "gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode",
                 "gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split",
                 "gpt3_mcore_te_tp2_pp2_resume_torch_dist", "gpt3_mcore_reruns_resume_check_grads",
                 "gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances", "gpt3_mcore_te_tp2_pp2_mla",
                 "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer",
                 "gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute", "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor",
                 "gpt3_15b_8t_release_gb200",
                 "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap",
                 "gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap"):
        assert case in counted["accepted"], (case, counted["refused"].get(case))


def test_command_lines_as_megatrons_run_training_script():
    """_run_training.sh: `true` alone, [a b] split, a value with spaces one quoted word."""
    tool = _tool()
    assert tool.command_line({"--bf16": True, "--lr": "1e-4", "--sizes": "[2 2]", "--schedule": "0:8 100:16",
                              "--cfg": "(a)"}) == ["--bf16", "--lr", "1e-4", "--sizes", "2", "2", "--schedule",
                                                   "0:8 100:16", "--cfg", "(a)"]
    assert tool.envsubst("${DATA_PATH}/x $UNSET ${REPEAT}") == "/mnt/artifacts/x $UNSET 1"
