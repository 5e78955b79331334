"""Megatron's fusion, Transformer Engine, MoE-schedule and logging flags from its MoE functional
tests (megalite/config/megatron/engine.py), and --recompute-modules: each is served with one
start-up line, or refused by name with Megatron's own checks first."""

import logging

import pytest

import megalite.dryrun.cli
from megalite import pretrain_gpt
from megalite.config.arguments import model_config_from_args
from megalite.config.megatron.engine import apply_logging_level
from megalite.config.run_config import startup_notes
from tests.config.test_arguments import BASE, parsed, refused

MOE = "--num-experts 8 --disable-bias-linear"
EP_OVERLAP = MOE + " --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --bf16"


def lines(extra: str, world_size: int = 1, prefix: str = "--") -> list[str]:
    return [n for n in startup_notes(parsed(extra, world_size)) if n.startswith(prefix)]


@pytest.mark.parametrize("flag, line", [
    ("--moe-permute-fusion", "--moe-permute-fusion: megalite's dispatcher permutes tokens with torch index operations"),
    ("--moe-router-fusion", "--moe-router-fusion: megalite's router computes the top-k and its losses in plain torch"),
    ("--use-transformer-engine-op-fuser", "--use-transformer-engine-op-fuser: megalite's own kernels"),
    ("--te-rng-tracker", "--te-rng-tracker: megalite's own tracker of the tensor-parallel RNG streams"),
    ("--enable-experimental", "--enable-experimental: megalite gates no feature"),
    ("--no-use-layer-wise-param-layout", "--no-use-layer-wise-param-layout: no effect without Megatron's layer-wise"),
    ("--logging-level 40", "--logging-level 40: the root Python logger's level (megalite's ERROR and above"),
    ("--outer-dp-sharding-strategy no_shard", "--outer-dp-sharding-strategy no_shard: Megatron's default, effective "
                                              "only with Megatron-FSDP's hybrid sharding"),
    (EP_OVERLAP + " --overlap-moe-expert-parallel-comm", "--overlap-moe-expert-parallel-comm: megalite runs each "
                                                         "micro-batch's expert-parallel all-to-alls in order"),
    (EP_OVERLAP + " --overlap-moe-expert-parallel-comm --delay-wgrad-compute",
     "--delay-wgrad-compute: megalite computes weight gradients with the data gradients"),
    ("--cuda-graph-modules attn", "--cuda-graph-modules: Megatron's new name of --cuda-graph-scope"),
])
def test_served_with_one_line(flag, line):
    world = 2 if "--expert-model-parallel-size 2" in flag else 1
    flag_name = line.split(":")[0].split()[0]
    got = lines(flag, world, flag_name)
    assert len(got) == 1 and got[0].startswith(line), got
    assert not lines(MOE if world == 2 else "", 1, flag_name)  # and no line without it


def test_flex_dispatcher_is_served_by_alltoall():
    args = parsed(MOE + " --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep", 1)
    assert model_config_from_args(args, 100).moe.token_dispatcher_type == "alltoall"
    assert lines(MOE + " --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep", 1,
                 "--moe-token-dispatcher-type flex") == [
        "--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend hybridep): served by megalite's all-to-all "
        "dispatcher (the same tokens reach the same experts); DeepEP, HybridEP and NCCL EP kernels need multi-GPU "
        "NVLink nodes and are not used"]
    assert lines(MOE + " --moe-flex-dispatcher-backend hybridep", 1, "--moe-flex") == [
        "--moe-flex-dispatcher-backend hybridep: no effect without --moe-token-dispatcher-type flex (as in Megatron)"]
    assert refused(MOE + " --moe-flex-dispatcher-backend ncclep") == (
        "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex (as in Megatron)")


@pytest.mark.parametrize("extra, world, need", [
    (MOE + " --overlap-moe-expert-parallel-comm --bf16", 1, "--expert-model-parallel-size > 1"),
    (MOE + " --expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm --bf16", 2,
     "--moe-token-dispatcher-type alltoall or flex"),
    (EP_OVERLAP.replace(" --bf16", "") + " --overlap-moe-expert-parallel-comm", 2, "--bf16 or --fp16"),
    (EP_OVERLAP + " --overlap-moe-expert-parallel-comm --recompute-granularity full", 2,
     "no full recompute (--recompute-granularity full, --recompute-method, --recompute-num-layers)"),
    (EP_OVERLAP + " --overlap-moe-expert-parallel-comm --recompute-granularity selective --recompute-modules moe", 2,
     "no moe in --recompute-modules"),
    (EP_OVERLAP + " --overlap-moe-expert-parallel-comm --pipeline-model-parallel-size 2", 4,
     "virtual pipeline stages at --pipeline-model-parallel-size > 1"),
])
def test_expert_overlap_refused_as_megatron_asserts(extra, world, need):
    assert refused(extra, world) == f"--overlap-moe-expert-parallel-comm needs {need} (as in Megatron)"


def test_refused_by_name():
    assert refused(EP_OVERLAP + " --delay-wgrad-compute", 2) == (
        "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (as in Megatron)")
    assert refused("--outer-dp-sharding-strategy optim").startswith(
        "--outer-dp-sharding-strategy optim: Megatron-FSDP's hybrid sharding (HSDP) is not implemented")
    assert refused("--logging-level -1") == "--logging-level must not be negative, got -1"


def test_cuda_graph_modules_is_cuda_graph_scope():
    args = parsed("--cuda-graph-modules full", 1)
    assert args.cuda_graph_scope == ["full"]
    assert refused("--cuda-graph-modules attn --cuda-graph-impl local --attention-dropout 0").startswith(
        "--cuda-graph-modules attn: megalite's local CUDA graphs capture whole transformer layers only")
    assert refused("--cuda-graph-modules attn --cuda-graph-scope full") == (
        "--cuda-graph-modules and --cuda-graph-scope (its deprecated name) contradict each other (give one)")


def test_logging_level_sets_the_root_logger(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    apply_logging_level(parsed("--logging-level 40"))
    assert root.level == logging.ERROR
    apply_logging_level(parsed(""))  # not given: unchanged
    assert root.level == logging.ERROR
    monkeypatch.setattr(megalite.dryrun.cli, "run_dry", lambda args, argv: 0)
    assert pretrain_gpt.main(BASE + ["--logging-level", "10", "--dry-run"]) == 0
    assert root.level == logging.DEBUG


def test_recompute_modules():
    selective = "--recompute-granularity selective --recompute-modules "
    assert model_config_from_args(parsed("--recompute-granularity selective", 1), 100).recompute_modules == (
        "core_attn",)  # Megatron's default
    config = model_config_from_args(parsed(MOE + " --moe-grouped-gemm " + selective + "layernorm mlp moe_act", 1), 100)
    assert config.recompute_modules == ("layernorm", "mlp", "moe_act") and config.recomputes("moe_act")
    assert not config.recomputes("core_attn")
    assert refused(selective + "attention") .startswith("--recompute-modules attention: unknown module")
    assert refused(MOE + " " + selective + "moe_act") == (
        "--recompute-modules moe_act needs --moe-grouped-gemm (as in Megatron)")
    assert refused(selective + "mla_up_proj") == (
        "--recompute-modules mla_up_proj needs --multi-latent-attention (as in Megatron)")
    assert refused(selective + "mhc").startswith("--recompute-modules mhc: not implemented in megalite")
    assert refused(selective + "layernorm --torch-compile").startswith(
        "--recompute-modules layernorm with --torch-compile")
    assert lines("--recompute-modules mlp", 1, "--recompute-modules") == [
        "--recompute-modules mlp: no effect without --recompute-granularity selective (as in Megatron)"]
