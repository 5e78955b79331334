"""The planner's optimizer (--optimizer among the model's flags; megalite/planner/optimizer.py,
optimizer_step.py): the Muon weights it lists are those megalite's Muon takes from the built
model, shape for shape; its optimizer memory is within 5% of the dry run's measured optimizer
bytes for adam, sgd, muon with Adam and with Lion, on one rank and sharded (distributed
optimizer, FSDP2), the dry run itself equal to formulas.md; the Newton-Schulz FLOPs equal a hand
count and torch's FLOP counter on megalite's own orthogonalisation; optimizers megalite refuses
are refused in one line."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode

from megalite.config.arguments import parse_args, validate_args
from megalite.data.tokenizers import build_tokenizer
from megalite.dryrun import runner
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.optimizer.muon import Muon, MuonTarget, is_muon_param
from megalite.optimizer.muon_mixed import EMBEDDING_OR_OUTPUT
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.planner.cli import main
from megalite.planner.cluster import preset
from megalite.planner.layouts import Layout, Space, enumerate_layouts
from megalite.planner.memory import rank_memory
from megalite.planner.optimizer import rank_matrices
from megalite.planner.optimizer_step import newton_schulz_flops, newton_schulz_seconds, optimizer_step_seconds
from megalite.planner.workload import from_flags
from tests.planner.models import GPT, LLAMA, MOE
from tests.planner.test_mla_planner import VARIANTS as MLA_VARIANTS

MODEL = ("--tokenizer-type NullTokenizer --vocab-size 211 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
         "--group-query-attention --num-query-groups 2 --ffn-hidden-size 96 --swiglu --normalization RMSNorm "
         "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
         "--seq-length 32 --global-batch-size 4 --bf16").split()


def built_muon_shapes(config, t, p, v, pp_rank, ep):
    """Sorted (rows, cols, expert) of the parameters megalite's Muon takes on one rank."""
    world = t * p * ep
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        pstate = ParallelState.create(ParallelLayout(world, tensor=t, pipeline=p, virtual_pipeline=v))
        pstate.pp_rank = pp_rank
        if config.moe is not None:
            pstate.expert = ExpertState.create(pstate, ep, config.moe.num_experts)
        chunks = build_model_chunks(config, pstate, device="meta")
        return sorted((*q.shape, getattr(q, "expert_parallel", False)) for c in chunks
                      for name, q in c.named_parameters() if is_muon_param(name, q, name.endswith(EMBEDDING_OR_OUTPUT)))
    finally:
        dist.destroy_process_group()


def gdn_config():
    from megalite.model.gdn_config import GDNConfig
    return LLAMA.replace(gdn=GDNConfig(linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=16,
                                       linear_num_key_heads=2, linear_num_value_heads=4))


CONFIGS = {"gpt": (GPT, 1), "llama": (LLAMA, 1), "moe": (MOE, 2), "gdn": (gdn_config(), 1),
           "mla-moe-mtp": (MLA_VARIANTS["untied"], 2), "mla-learned": (MLA_VARIANTS["learned-positions-dense"], 1)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("t, p, v", [(1, 1, 1), (2, 2, 1), (1, 2, 2)])
def test_muon_weights_are_those_muon_takes_from_the_built_model(name, t, p, v):
    config, ep = CONFIGS[name]
    for rank in range(p):
        planned = sorted((m.rows, m.cols, m.expert) for m in rank_matrices(config, t, p, v, rank, ep)
                         for _ in range(m.count))
        assert planned == built_muon_shapes(config, t, p, v, rank, ep), (name, rank)


RUNS = [  # (extra flags, world, planner layout)
    ([], 1, Layout(1, 1, 1, micro_batch_size=2)),
    (["--optimizer", "sgd"], 1, Layout(1, 1, 1, micro_batch_size=2)),
    (["--optimizer", "muon"], 1, Layout(1, 1, 1, micro_batch_size=2)),
    (["--optimizer", "muon", "--muon-scalar-optimizer", "lion"], 1, Layout(1, 1, 1, micro_batch_size=2)),
    (["--optimizer", "muon", "--use-distributed-optimizer"], 2,
     Layout(1, 1, 2, micro_batch_size=2, distributed_optimizer=True)),
    (["--optimizer", "sgd", "--use-torch-fsdp2"], 2, Layout(1, 1, 2, micro_batch_size=2, fsdp2=True)),
]


@pytest.mark.parametrize("extra, world, layout", RUNS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_optimizer_memory_is_the_dry_runs(extra, world, layout):
    """The dry run (fake CPU device, in this process) holds formulas.md's bytes, and the planner's
    optimizer bytes for the same flags are within 5% of them."""
    args = parse_args(MODEL + extra + ["--mock-data", "--lr", "1e-3", "--train-iters", "1", "--micro-batch-size", "2",
                                       "--dry-run", "--dry-run-device", "cpu", "--dry-run-world-size", str(world)])
    validate_args(args, world)
    vocab = build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size).vocab_size
    report = runner.run_rank(args, vocab, 0, world, torch.device("cpu"))
    assert report.resident == report.formula
    planned = rank_memory(from_flags(MODEL + [f for f in extra if "fsdp2" not in f and "distributed" not in f]),
                          layout, 0).optimizer
    assert planned == pytest.approx(report.resident["optimizer"], rel=0.05), (extra, planned, report.resident)


def test_the_planner_charges_what_the_optimizer_holds_and_does():
    """Fails if --optimizer were ignored: per parameter on one bf16 rank, 4 bytes of fp32 main
    parameters plus Adam's 8, SGD's 4 (0 without momentum), Muon's 4 per matrix element; the
    steps differ in time (Muon's by its Newton-Schulz work)."""
    layout = Layout(1, 1, 1, micro_batch_size=2)
    kinds = {"adam": [], "sgd": ["--optimizer", "sgd"], "sgd0": ["--optimizer", "sgd", "--sgd-momentum", "0"],
             "muon": ["--optimizer", "muon"], "lion": ["--optimizer", "muon", "--muon-scalar-optimizer", "lion"]}
    work = {kind: from_flags(MODEL + flags) for kind, flags in kinds.items()}
    memory = {kind: rank_memory(w, layout, 0) for kind, w in work.items()}
    n = memory["adam"].num_parameters
    matrix = sum(m.numel for m in rank_matrices(work["muon"].config, 1, 1, 1, 0))
    assert 0 < matrix < n
    assert memory["adam"].optimizer == 12 * n and memory["sgd"].optimizer == 8 * n and memory["sgd0"].optimizer == 4 * n
    assert memory["muon"].optimizer == 8 * matrix + 12 * (n - matrix)
    assert memory["lion"].optimizer == 8 * n
    cluster = preset("h100", 1)
    times = {kind: optimizer_step_seconds(cluster, w, layout, 0) for kind, w in work.items()}
    assert len(set(times.values())) == len(times)
    compute, comm = newton_schulz_seconds(cluster, work["muon"], layout, 0)
    assert compute > 0 and comm == 0 and times["muon"] > times["adam"] + compute * 0.99


def hand_count(t: int, mode: str, split: bool) -> int:
    """Newton-Schulz FLOPs per step of GPT (4 layers, h 64, 4 heads, FFN 256, learned positions
    [128, 64]) on one rank: X [m, n] costs 4m²n + 2m³, m its Gram side."""
    def x(m, n):
        return 4 * m * m * n + 2 * m ** 3
    h, f = 64, 256
    if t == 1 or mode == "duplicated":  # whole matrices
        qkv = 3 * x(h, h) if split else x(h, 3 * h)
        layer = qkv + x(h, h) + 2 * x(h, f)
    elif mode == "blockwise":  # each shard alone: q, k, v [32, 64], proj [64, 32], fc1 [128, 64], fc2 [64, 128]
        qkv = 3 * x(h // 2, h) if split else x(h, 3 * h // 2)
        layer = qkv + x(h // 2, h) + 2 * x(h, f // 2)
    else:  # distributed: the Gram side is the unsplit one (h), X [h, local]
        qkv = 3 * x(h, h // 2) if split else x(h, 3 * h // 2)
        layer = qkv + x(h, h // 2) + 2 * x(h, f // 2)
    return 4 * layer + x(h, 128)


@pytest.mark.parametrize("t, mode, split", [
    (1, "duplicated", True), (1, "duplicated", False), (2, "duplicated", True), (2, "blockwise", True),
    (2, "distributed", True), (2, "distributed", False)])
def test_newton_schulz_flops_equal_a_hand_count(t, mode, split):
    flags = ("--tokenizer-type NullTokenizer --vocab-size 999 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 128 --global-batch-size 4 --bf16 --optimizer muon --muon-num-ns-steps 3 --muon-tp-mode "
             f"{mode}").split() + ([] if split else ["--muon-no-split-qkv"])
    work = from_flags(flags)
    layout = Layout(t, 1, 2, micro_batch_size=2)
    assert newton_schulz_flops(work, layout, 0) == 3 * hand_count(t, mode, split)
    # the distributed optimizer shards the momentum, not the orthogonalisation: every rank does every matrix
    sharded = Layout(t, 1, 2, micro_batch_size=2, distributed_optimizer=True)
    assert newton_schulz_flops(work, sharded, 0) == newton_schulz_flops(work, layout, 0)
    cluster = preset("h100", 2 * t)
    assert newton_schulz_seconds(cluster, work, sharded, 0)[1] > newton_schulz_seconds(cluster, work, layout, 0)[1]


def counted_flops(muon: Muon, local: torch.Tensor, target: MuonTarget) -> int:
    with FlopCounterMode(display=False) as counter:
        muon.orthogonalize(local, target)
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["duplicated", "blockwise", "distributed"])
def test_newton_schulz_flops_equal_torchs_count_of_megalites_muon(mode):
    """TP2 (the fake process group: the collectives do nothing, the GEMMs run) for column- and
    row-parallel shards and a fused QKV weight with and without split-qkv, and TP1."""
    from megalite.planner.optimizer import Matrix, OptimizerSpec
    from megalite.planner.optimizer_step import ns_parts
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cases = [((128, 64), 0, None), ((64, 96), 1, None), ((64, 32), 1, None), ((96, 64), 0, (32, 32, 32)),
                 ((48, 64), None, None)]
        for split in (True, False):
            muon = Muon([torch.zeros(1)], lr=1.0, steps=4, tp_mode=mode, split_qkv=split)
            spec = OptimizerSpec("muon", ns_steps=4, tp_mode=mode, split_qkv=split)
            for shape, pdim, qkv in cases:
                target = MuonTarget(shape, pdim, dist.group.WORLD if pdim is not None else None, qkv)
                expected = sum(4 * (4 * m * m * n + 2 * m ** 3)
                               for m, n, _ in ns_parts(Matrix(*shape, pdim, qkv_split=qkv), spec, 2))
                assert counted_flops(muon, torch.randn(shape), target) == expected, (shape, pdim, qkv, split)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lion"], "--optimizer lion is not implemented in megalite"),
    (["--optimizer", "soap"], "--optimizer soap is not implemented in megalite"),
    (["--optimizer", "adaptive_muon"], "--optimizer adaptive_muon is not implemented in megalite"),
    (["--optimizer", "dist_muon"], "--optimizer dist_muon is Megatron's deprecated"),
    (["--optimizer", "muon", "--fp16"], "--optimizer muon with --fp16 is not supported"),
    (["--optimizer", "muon", "--decoupled-lr", "1e-3"], "--optimizer muon with --decoupled-lr is not implemented"),
    (["--optimizer", "muon", "--apply-wd-to-qk-layernorm"], "--apply-wd-to-qk-layernorm with --optimizer muon"),
    (["--optimizer", "muon", "--use-mup"], "--use-mup with --optimizer muon is refused by megalite"),
])
def test_optimizers_megalite_refuses_are_refused_in_one_line(flags, message, capsys):
    model = [f for f in MODEL if f != "--bf16"] if "--fp16" in flags else MODEL
    assert main(["--cluster", "h100", "--num-gpus", "2", "--"] + model + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_every_muon_layout_is_one_pretrain_gpt_accepts():
    """Muon with the distributed optimizer, FSDP2, TP, PP and their flags: every layout the planner
    proposes for --optimizer muon passes pretrain_gpt's validation."""
    work = from_flags(MODEL + ["--optimizer", "muon"])
    layouts = list(enumerate_layouts(work, 4, Space()))
    assert {(lay.distributed_optimizer, lay.fsdp2) for lay in layouts} == {(False, False), (True, False), (False, True)}
    for lay in layouts:
        args = parse_args(work.model_flags + ["--seq-length", "32", "--global-batch-size", "4", "--mock-data", "--lr",
                                              "1e-4", "--train-iters", "1"] + lay.flags())
        validate_args(args, 4)
        assert args.optimizer == "muon" and args.use_distributed_optimizer == lay.distributed_optimizer, lay
