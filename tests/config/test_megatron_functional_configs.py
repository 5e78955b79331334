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
ACCEPTED = 157  # of 161 in-scope configs at Megatron-LM d98e8a6 (108 before issues 24 and 25, 150 before FP8,
# 152 before Gated DeltaNet)

# What may still stop a config: (pattern of megalite's one-line refusal, why)
STILL_REFUSED = [
    (r"^unknown arguments: --dsa-indexer-n-heads", "DeepSeek sparse attention (its indexer) is not in megalite"),
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
                 "gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap",
                 "gpt3_mcore_te_tp2_pp1_gdn", "gpt3_mcore_te_tp2_pp1_gdn_1node", "gpt3_mcore_te_tp2_pp1_gdn_no_nvrx_async",
                 "gpt3_mcore_te_tp2_pp1_gdn_no_nvrx_async_mcore", "gpt3_mcore_te_tp2_pp1_gdn_no_nvrx_sync"):
        assert case in counted["accepted"], (case, counted["refused"].get(case))


MOE_ACCEPTED = 56  # of 59 in-scope MoE and Mixtral configs at Megatron-LM d98e8a6 (8 before issue 32, 45 before
# --use-flash-attn without flash_attn, global_aux_loss and --recompute-modules mla_up_proj, 54 before
# --fine-grained-activation-offloading)
# Every refused MoE config and why: (pattern of megalite's one-line refusal, why)
TE_CUDA_GRAPHS = (r"^--cuda-graph-impl transformer_engine .* needs Transformer Engine",
                  "Transformer Engine's CUDA graphs (megalite captures its own: --cuda-graph-impl local); the two "
                  "scoped_cudagraph configs get past their --fp8-recipe blockwise (served) to this")
MOE_REFUSED = dict.fromkeys(["gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph",
                             "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph",
                             "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph_1node"], TE_CUDA_GRAPHS)
FLASH_ATTN_CASES = (  # --use-flash-attn, served by scaled_dot_product_attention without flash_attn or CUDA
    "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release", "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm",
    "deepseekv3_proxy_flex_tp2pp2emp16etp1cp1_gb_200_release",
    "deepseekv3_proxy_flex_tp2pp2emp16etp1cp1_gb_200_release_sm", "mixtral_8x22b_tp2pp8ep8vpp1_release",
    "mixtral_8x7b_alltoall_tp2pp4ep4_release", "mixtral_8x7b_alltoall_tp2pp4ep4_release_sm",
    "mixtral_8x7b_tp1pp4ep8vpp8_release")


@pytest.fixture(scope="module")
def counted_moe():
    tool = _tool()
    return tool.count(tool.load(tool.SETS["moe"][2]))


def test_moe_configs_accepted_and_refused(counted_moe):
    """Megatron-LM's test_cases/moe and test_cases/mixtral: the accepted count, and every refused
    config with its reason (a config that starts to pass must be taken off MOE_REFUSED)."""
    assert len(counted_moe["accepted"]) + len(counted_moe["refused"]) == 59
    assert len(counted_moe["accepted"]) == MOE_ACCEPTED, sorted(counted_moe["refused"])
    assert sorted(counted_moe["refused"]) == sorted(MOE_REFUSED)
    wrong = {case: error for case, error in counted_moe["refused"].items() if not re.search(MOE_REFUSED[case][0], error)}
    assert wrong == {}
    for case in ("gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel",  # sinkhorn
                 "gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4",  # --overlap-moe-expert-parallel-comm
                 "gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",  # --moe-permute-fusion, --logging-level
                 "gpt3_mcore_te_tp1_pp1_te_4experts_groupedGEMM_op_fuser",  # --use-transformer-engine-op-fuser
                 "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon",  # Muon with experts
                 "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap",  # --save-interval without --save
                 "gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental",  # mla_up_proj
                 "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",  # --offload-modules
                 "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading",
                 *FLASH_ATTN_CASES):
        assert case in counted_moe["accepted"], (case, counted_moe["refused"].get(case))


def test_world_size_of_a_case_no_recipe_runs():
    """The fewest whole 8-GPU nodes that TP x PP x CP and ETP x EP x PP divide."""
    tool = _tool()
    assert tool.smallest_world_size("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8".split()) == 16
    assert tool.smallest_world_size("--pipeline-model-parallel-size 4 --expert-model-parallel-size 16 "
                                    "--expert-tensor-parallel-size 1".split()) == 64
    assert tool.smallest_world_size([]) == 8


def test_count_reports_both_sets_separately(capsys):
    tool = _tool()
    assert tool.main(["count"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert lines[0].startswith(f"gpt: {ACCEPTED} of 161 configs")
    assert lines[1].startswith(f"moe: {MOE_ACCEPTED} of 59 configs")


def test_command_lines_as_megatrons_run_training_script():
    """_run_training.sh: `true` alone, [a b] split, a value with spaces one quoted word."""
    tool = _tool()
    assert tool.command_line({"--bf16": True, "--lr": "1e-4", "--sizes": "[2 2]", "--schedule": "0:8 100:16",
                              "--cfg": "(a)"}) == ["--bf16", "--lr", "1e-4", "--sizes", "2", "2", "--schedule",
                                                   "0:8 100:16", "--cfg", "(a)"]
    assert tool.envsubst("${DATA_PATH}/x $UNSET ${REPEAT}") == "/mnt/artifacts/x $UNSET 1"


def test_blockwise_fp8_configs_stop_only_at_transformer_engines_cuda_graphs():
    """The two scoped_cudagraph configs (--fp8-format hybrid --fp8-recipe blockwise
    --first-last-layers-bf16) validate once their Transformer Engine CUDA-graph flags are taken
    out: blockwise FP8 is served, the CUDA graphs are what still stops them."""
    from megalite.config.arguments import parse_args
    from megalite.config.fp8 import fp8_recipe_from_args

    tool = _tool()
    configs = tool.load(tool.SETS["moe"][2])
    cases = [case for case in MOE_REFUSED if "scoped_cudagraph" in case]
    assert len(cases) == 2
    for case in cases:
        (_, worlds, argv), = configs[case]
        start = argv.index("--cuda-graph-impl")
        assert argv[start:start + 3] == ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules"]
        end = next(i for i in range(start + 3, len(argv)) if argv[i].startswith("--"))
        without_graphs = argv[:start] + argv[end:]
        assert tool.check(without_graphs, worlds[0]) is None, case
        recipe = fp8_recipe_from_args(parse_args(without_graphs))
        assert (recipe.scaling, recipe.format, recipe.bf16_layers_at_start) == ("blockwise", "hybrid", 1)
