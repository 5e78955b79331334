"""FP8 training (delayed scaling, hybrid, history 2, max) at every two-process layout against the
one-process FP8 run: TP2 with sequence parallelism, PP2 interleaved (two chunks per rank), CP2,
DP2 with the distributed optimizer, FSDP2 (fp32 weights gathered, each GEMM quantizing them),
FSDP2 with --fp8-param-gather (each weight shard cast to FP8 before the all-gather, the gathered
FP8 weight multiplied as it is: parallel/tensor/fp8_param.py), and EP2 over DP2 (MoE: attention
and the shared expert in FP8, the routed experts 16-bit). All layouts run in ONE spawn (a module
fixture), which also records what FSDP2's all-gathers move, runs the FP8 all-gather with
tensorwise scaling (against the same FSDP2 run gathering fp32 weights) and saves the FP8-gather
run's checkpoint, loaded into a bf16 model.

Model: tests/parallel/expert/ep_harness.py's tiny MoE GPT at 4 layers (no auxiliary losses),
6 Adam steps of 8 sequences. The amaxes of a step are MAX-reduced over TP, then DP x CP
(Megatron's amax reduction group), so every layout quantizes with the one-process run's scales.

The loss is per token (--calculate-per-token-loss) with two micro-batches per rank: the output
gradient that FP8 quantizes is then the same number on every layout (a DP rank's mean loss
would be over its own tokens, its gradients DP x the one-process run's; delayed scaling starts
at scale 1, where that factor changes which gradients underflow e5m2: 6% apart at the first
step, measured). The one-process run has two micro-batches of 4 sequences, each DP rank two of 2.

Tolerances (relative): scales SCALE_TOL; losses, first-step gradients (not under the
distributed optimizer or FSDP2) and final parameters TOL = 1e-4 (measured at most 4.2e-5, CP2;
others < 4e-7: the GEMMs sum in another order). The FP8 run's parameters differ from the fp32
run's by > 100 x TOL (0.49 measured with the mean loss). With --tp-only-amax-red (TP x CP only) the two DP ranks
keep their own scales: they differ (0.43 measured), so the DP reduction above is not a no-op.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megalite.checkpoint.dcp.checkpoint import load_checkpoint, save_checkpoint

from megalite.model.fp8 import enable_fp8_chunks
from megalite.model.moe import update_expert_bias
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor import fp8_param
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_param import Fp8ShardedWeight
from megalite.parallel.tensor.fp8_scaling import Fp8Recipe
from megalite.training.per_token_loss import PerTokenLoss
from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.expert.ep_harness import HIDDEN, MICRO, OPTIM, SEQ, compare, full_state, moe_model_config, rank_batches
from tests.parallel.train_step import train_step

STEPS, TOL, SCALE_TOL = 6, 1e-4, 1e-5
TENSORWISE_STEPS = 3  # the FSDP2 pair compared with each other (suite time)
RECIPE = Fp8Recipe(format="hybrid", amax_history_len=2, amax_compute_algo="max")
LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True),
    "pp2-interleaved": dict(pp=2, vp=2),
    "cp2": dict(cp=2),
    "dp2-distopt": dict(dist_opt=True),
    "fsdp2": dict(fsdp=True),
    "ep2": dict(ep=2),
    "dp2-tp-only-amax-red": dict(tp_only=True),
    "fsdp2-fp8-gather": dict(fsdp=True, fp8_gather=True),
    "fsdp2-tensorwise": dict(fsdp=True, tensorwise=True, steps=TENSORWISE_STEPS),
    "fsdp2-tensorwise-fp8-gather": dict(fsdp=True, tensorwise=True, fp8_gather=True, steps=TENSORWISE_STEPS),
}
NOT_ONE_PROCESS = ("dp2-tp-only-amax-red", "fsdp2-tensorwise", "fsdp2-tensorwise-fp8-gather")
TENSORWISE = dataclasses.replace(RECIPE, scaling="tensorwise", amax_history_len=1, amax_compute_algo="most_recent")
GRID = ("tp", "pp", "vp", "cp")
DATA_PARALLEL = ("dp2-distopt", "fsdp2", "ep2", "dp2-tp-only-amax-red") + NOT_ONE_PROCESS[1:] + ("fsdp2-fp8-gather",)


def _config(sequence_parallel=False):
    return moe_model_config("alltoall", "softmax", sequence_parallel=sequence_parallel, aux_loss_coeff=0.0,
                            z_loss_coeff=0.0).replace(num_layers=4)


def _batches(step: int, pstate: ParallelState, micro: int) -> list[dict]:
    """rank_batches' micro-batches of MICRO sequences, joined into micro-batches of `micro`."""
    parts = rank_batches(step, pstate.dp_rank, pstate.dp_size, pstate.cp_size, pstate.cp_rank)
    k = micro // MICRO
    return [{key: torch.cat([p[key] for p in parts[i:i + k]]) for key in parts[0]} for i in range(0, len(parts), k)]


def _train(pstate: ParallelState, recipe: Fp8Recipe | None, sp=False, dist_opt=False, fsdp=False,
           per_token=False, micro=MICRO, save_to=None, steps=STEPS) -> dict:
    config = _config(sp)
    models = build_model_chunks(config, pstate, init_seed=7)
    scaling = enable_fp8_chunks(models, recipe, config.num_layers, pstate)
    chunks = [apply_fsdp2(m, pstate) if fsdp else DistributedDataParallel(m, pstate, use_distributed_optimizer=dist_opt)
              for m in models]
    optimizer = build_optimizer(chunks, pstate, use_distributed_optimizer=dist_opt, **OPTIM)
    batches_of = lambda step: _batches(step, pstate, micro)  # noqa: E731
    forward_step = PerTokenLoss() if per_token else gpt_forward_step
    executor = None
    if pstate.pp_size > 1:
        executor = PipelineExecutor(chunks, pstate, "interleaved_1f1b" if pstate.vp_size > 1 else "1f1b",
                                    num_microbatches=len(batches_of(0)), seq_length=SEQ, micro_batch_size=micro,
                                    hidden_size=HIDDEN, sequence_parallel=sp, forward_step=forward_step)
    out = {"losses": [], "scales": []}
    for step in range(steps):
        optimizer.zero_grad()
        out["losses"].append(train_step(chunks, pstate, batches_of(step), forward_step, executor, per_token))
        if step == 0 and not (dist_opt or fsdp):
            out["grads"] = full_state(chunks, pstate, grads=True)
        optimizer.step()
        update_expert_bias(models, pstate.dp_cp_group)
        if scaling is not None:
            scaling.after_optimizer_step()
            out["scales"].append({k: s.scales.clone() for k, s in scaling.states.items()})
    out["params"] = full_state(chunks, pstate)
    if save_to is not None:
        save_checkpoint(save_to, STEPS, chunks=[c.module for c in chunks], optimizer=None, pstate=pstate, common={})
    return out


def _state(tp=1, pp=1, vp=1, cp=1, ep=1) -> ParallelState:
    world = torch.distributed.get_world_size()
    pstate = ParallelState.create(ParallelLayout(world, tensor=tp, pipeline=pp, virtual_pipeline=vp, context=cp))
    pstate.expert = ExpertState.create(pstate, ep, num_experts=8)
    return pstate


def _recipe(spec: dict) -> Fp8Recipe:
    return dataclasses.replace(TENSORWISE if spec.get("tensorwise") else RECIPE,
                               param_gather=spec.get("fp8_gather", False),
                               tp_only_amax_reduction=spec.get("tp_only", False))


def _record_fp8_gathers(seen: dict) -> None:
    """In this process: each FSDP2 all-gather's input bytes (seen["all_gather_bytes"]), each FP8
    weight's all-gather input (dtype, numel), the FP8 weights the GEMMs multiply (dtype) and the
    weights of each tensorwise weight-amax all-reduce."""
    all_gather, gemm_weight = dist.all_gather_single, Fp8Gemm._weight
    pre_all_gather = Fp8ShardedWeight.fsdp_pre_all_gather
    weight_scales = fp8_param.tensorwise_scales

    def recording_weight_scales(gemms, shards, groups):
        seen["tensorwise_reductions"].append(len(gemms))
        return weight_scales(gemms, shards, groups)

    def recording_all_gather(output, input, *args, **kwargs):
        seen["all_gather_bytes"].append(input.numel() * input.element_size())
        return all_gather(output, input, *args, **kwargs)

    def recording_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        seen["fp8_inputs"] += [(t.dtype, t.numel()) for t in inputs]
        return inputs, metadata

    def recording_weight(self, weight, record, **kwargs):
        wq, scale = gemm_weight(self, weight, record, **kwargs)
        seen["gemm_weights"].append((type(weight).__name__, wq.dtype))
        return wq, scale

    dist.all_gather_single, Fp8ShardedWeight.fsdp_pre_all_gather, Fp8Gemm._weight = (
        recording_all_gather, recording_pre_all_gather, recording_weight)
    fp8_param.tensorwise_scales = recording_weight_scales


def _bf16_load(root, pstate) -> dict:
    """The FP8-gather run's checkpoint loaded into a bf16 model (no FP8), and its saved dtypes."""
    saved = {k: str(v.properties.dtype) for k, v in FileSystemReader(f"{root}/iter_{STEPS:07d}").read_metadata()
             .state_dict_metadata.items() if hasattr(v, "properties") and k.startswith("model/")}
    model = build_model_chunks(_config().replace(params_dtype="bfloat16"), pstate, init_seed=8)[0]
    load_checkpoint(root, chunks=[model], pstate=pstate, load_rng=False)
    return {"saved_dtypes": saved, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def _worker(rank, world_size, root):
    out, seen = {}, {}
    _record_fp8_gathers(seen)
    for name, spec in LAYOUTS.items():
        seen.update(all_gather_bytes=[], fp8_inputs=[], gemm_weights=[], tensorwise_reductions=[])
        out[name] = _train(_state(**{k: v for k, v in spec.items() if k in GRID + ("ep",)}), _recipe(spec),
                           sp=spec.get("sp", False), dist_opt=spec.get("dist_opt", False), fsdp=spec.get("fsdp", False),
                           per_token=True, micro=MICRO if name in DATA_PARALLEL else 2 * MICRO,
                           save_to=root if name == "fsdp2-fp8-gather" else None, steps=spec.get("steps", STEPS))
        out[name]["gathers"] = {k: list(v) for k, v in seen.items()}
    out["bf16_load"] = _bf16_load(root, _state())
    return out


@pytest.fixture(scope="module")
def two_process(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("fp8_gather")), timeout=900)


@pytest.fixture(scope="module")
def one_process():
    def single(recipe, **options):
        pstate = ParallelState.single()
        pstate.expert = ExpertState.single()
        return _train(pstate, recipe, **options)
    return {"fp8": single(RECIPE, per_token=True, micro=2 * MICRO), "fp32": single(None, per_token=True, micro=2 * MICRO)}


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in NOT_ONE_PROCESS])
def test_fp8_layout_equals_the_one_process_fp8_run(two_process, one_process, layout):
    ref = one_process["fp8"]
    results = [r[layout] for r in two_process]
    problems = []
    for rank, run in enumerate(results):
        for step, (mine, want) in enumerate(zip(run["scales"], ref["scales"])):
            assert set(mine) <= set(want) and mine, (layout, rank, step, sorted(set(mine) - set(want)))
            for key, value in mine.items():
                if rel_error(value, want[key]) > SCALE_TOL:
                    problems.append((rank, step, key, value.tolist(), want[key].tolist()))
    covered = set().union(*(r["scales"][-1] for r in results))
    assert covered == set(ref["scales"][-1]), (layout, sorted(set(ref["scales"][-1]) - covered))
    differences = compare(results, ref, TOL)
    assert problems == [] and differences == [], (problems[:4], differences[:4])


def test_tp_only_amax_reduction_leaves_data_parallel_scales_apart(two_process, one_process):
    a, b = (r["dp2-tp-only-amax-red"]["scales"][-1] for r in two_process)
    assert a.keys() == b.keys() == one_process["fp8"]["scales"][-1].keys()
    assert max(rel_error(a[k], b[k]) for k in a) > 1e-3


def test_fp8_really_runs(one_process):
    fp8, fp32 = one_process["fp8"], one_process["fp32"]
    moved = max(rel_error(fp8["params"][k], v) for k, v in fp32["params"].items())
    assert moved > 100 * TOL, moved
    assert all((s != 1).all() for s in fp8["scales"][-1].values())


def test_fsdp2_fp8_gather_moves_fp8_bytes(two_process):
    """The FP8 weights' all-gather inputs are e4m3 (one byte), every FSDP2 all-gather moves 3
    bytes less per FP8 weight element than the same run gathering fp32 weights, and the GEMMs
    multiply the gathered FP8 weight itself."""
    for run in two_process:
        plain, fp8 = run["fsdp2"]["gathers"], run["fsdp2-fp8-gather"]["gathers"]
        assert plain["fp8_inputs"] == [] and fp8["fp8_inputs"], (len(plain["fp8_inputs"]), len(fp8["fp8_inputs"]))
        assert {dtype for dtype, _ in fp8["fp8_inputs"]} == {torch.float8_e4m3fn}
        fp8_elements = sum(numel for _, numel in fp8["fp8_inputs"])
        assert sum(plain["all_gather_bytes"]) - sum(fp8["all_gather_bytes"]) == 3 * fp8_elements > 0
        assert set(fp8["gemm_weights"]) == {("Fp8GatheredWeight", torch.float8_e4m3fn)}
        assert ("Fp8GatheredWeight", torch.float8_e4m3fn) not in set(plain["gemm_weights"])


def test_fsdp2_fp8_gather_tensorwise_equals_the_16_bit_gather(two_process):
    """Tensorwise: the input and gradient scales are per micro-batch (a DP rank's differ from one
    process's), so the reference is the same FSDP2 run gathering fp32 weights: the weight cast
    before the gather (global amax over FSDP2 x TP) must equal the weight cast after it."""
    for run in two_process:
        gathers = run["fsdp2-tensorwise-fp8-gather"]["gathers"]
        assert gathers["fp8_inputs"]
        # the first step reduces each weight's amax in its hook (no scale yet), every optimizer
        # step after it all weights' in one all-reduce (what the hooks then use)
        weights = max(gathers["tensorwise_reductions"])  # FP8 weights on this rank
        reductions = gathers["tensorwise_reductions"]
        assert reductions == [1] * weights + [weights] * TENSORWISE_STEPS, reductions
    reference = {"losses": torch.tensor([r["fsdp2-tensorwise"]["losses"] for r in two_process]).mean(0).tolist(),
                 "params": two_process[0]["fsdp2-tensorwise"]["params"]}
    differences = compare([r["fsdp2-tensorwise-fp8-gather"] for r in two_process], reference, TOL)
    assert differences == [], differences[:4]


def test_fsdp2_fp8_gather_checkpoint_keeps_fp32_weights(two_process):
    """The FP8-gather run's checkpoint holds its fp32 master weights and loads into a bf16 model."""
    loaded, trained = two_process[0]["bf16_load"], two_process[0]["fsdp2-fp8-gather"]["params"]
    assert loaded["saved_dtypes"] and set(loaded["saved_dtypes"].values()) == {"torch.float32"}, loaded["saved_dtypes"]
    fp8_weights = [n for n in trained if n.endswith(("linear_qkv.weight", "linear_proj.weight"))]
    assert fp8_weights and set(trained) <= set(loaded["params"])
    assert max(rel_error(loaded["params"][n], trained[n]) for n in trained) < 1e-2
