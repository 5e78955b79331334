"""--tp-comm-overlap: sequence-parallel linears whose all-gather / reduce-scatter is split and
overlapped with the GEMM (megalite.parallel.tensor.overlapped_linear), against their unsharded
twin nn.Linear and against the plain sequence-parallel path, fp32, 1e-5 relative, at TP = 2 and
4 in spawned gloo processes; and a GPT model with the overlap on every qkv/proj/fc1/fc2 linear
against the same model without it.

Megatron's behaviour: megatron/training/initialize.py _initialize_tp_communicators hands
--tp-comm-overlap-cfg to Transformer Engine's initialize_ub, whose userbuffers split the
tensor-parallel all-gather and reduce-scatter of the qkv/proj/fc1/fc2 GEMMs (methods
ring_exchange, pipeline with num_splits, bulk); megatron/training/arguments.py validate_args
asserts it runs with sequence parallelism.
"""

import pytest
import torch
import torch.distributed as dist

from megalite.model.gpt import masked_mean_loss
from megalite.parallel import comm
from megalite.parallel.sharding import all_reduce_sequence_parallel_grads, shard_of_full
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor.comm_overlap import (DEFAULTS, LinearOverlap, OverlapSetting, enable_tp_comm_overlap,
                                                   kernel_settings_given, overlap_settings)
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config
from tests.parallel.data.test_data_parallel import global_batch, make_model
from tests.numerics import rel_error
from tests.parallel.tensor.test_tp_layers import _gather

TOL = 1e-5
S, B, IN, OUT = 16, 2, 12, 16
METHODS = [OverlapSetting("ring_exchange"), OverlapSetting("pipeline", 3), OverlapSetting("pipeline", 8)]
COLUMN_DGRAD = [OverlapSetting("bulk"), *METHODS]


class _Counter:
    """Counts the point-to-point batches and chunked collectives torch.distributed runs."""

    def __init__(self):
        self.calls = {"p2p": 0, "all_gather": 0, "reduce_scatter": 0}
        self._saved = {}

    def __enter__(self):
        for name, key in (("batch_isend_irecv", "p2p"), ("all_gather_single", "all_gather"),
                          ("reduce_scatter", "reduce_scatter")):
            real = getattr(dist, name)
            self._saved[name] = real

            def counting(*args, _real=real, _key=key, **kwargs):
                self.calls[_key] += 1
                return _real(*args, **kwargs)
            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _bias(kind):
    return torch.randn(OUT if kind == "column" else IN, generator=torch.Generator().manual_seed(4))


def _run(layer, kind, x_full, gy_full, group):
    """(output, input gradient, weight gradient, bias gradient) of this rank: the output and
    the weight gradient as this rank's shards, the input and bias gradients full."""
    rank, tp = comm.group_rank(group), comm.group_size(group)
    x = comm.split_dim(x_full, 0 if kind == "column" else -1, group).clone().requires_grad_(True)
    y = layer(x)
    gy = shard_of_full(gy_full, 2, 1, rank, tp) if kind == "column" else comm.split_dim(gy_full, 0, group)
    (y * gy).sum().backward()
    all_reduce_sequence_parallel_grads(layer.parameters(), group)
    gx = _gather(x.grad, group, 0 if kind == "column" else -1)
    gb = _gather(layer.bias.grad, group, 0) if kind == "column" else layer.bias.grad
    return y, gx, layer.weight.grad, gb


def _layers(kind, group):
    rank, tp = comm.group_rank(group), comm.group_size(group)
    if kind == "column":
        layer = ColumnParallelLinear(IN, OUT, tp_group=group, sequence_parallel=True)
    else:
        layer = RowParallelLinear(OUT, IN, tp_group=group, sequence_parallel=True)
    layer.reset_parameters(torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.bias.copy_(shard_of_full(_bias(kind), 0, 1, rank, tp) if kind == "column" else _bias(kind))
    return layer


def _reference(kind):
    """nn.Linear with the full (TP = 1) weight and bias the shards come from."""
    full = ColumnParallelLinear(IN, OUT) if kind == "column" else RowParallelLinear(OUT, IN)
    full.reset_parameters(torch.Generator().manual_seed(3))
    ref = torch.nn.Linear(*((IN, OUT) if kind == "column" else (OUT, IN)))
    with torch.no_grad():
        ref.weight.copy_(full.weight)
        ref.bias.copy_(_bias(kind))
    return ref


def _layer_cases(group):
    """{case: relative error} of every overlap method against nn.Linear and the plain path."""
    tp = comm.group_size(group)
    g = torch.Generator().manual_seed(1)
    errors, counts = {}, {}
    for kind in ("column", "row"):
        x = torch.randn(S, B, IN if kind == "column" else OUT, generator=g)
        gy = torch.randn(S, B, OUT if kind == "column" else IN, generator=g)
        plain = _run(_layers(kind, group), kind, x, gy, group)
        ref_layer = _reference(kind)
        x_ref = x.clone().requires_grad_(True)
        y_ref = ref_layer(x_ref)
        (y_ref * gy).sum().backward()
        dgrads = COLUMN_DGRAD if kind == "column" else METHODS
        for fprop in METHODS:
            for dgrad in dgrads:
                case = f"tp{tp}/{kind}/fprop={fprop.method}{fprop.num_splits}/dgrad={dgrad.method}{dgrad.num_splits}"
                layer = _layers(kind, group)
                layer.comm_overlap = LinearOverlap(fprop, dgrad)
                with _Counter() as counter:
                    ours = _run(layer, kind, x, gy, group)
                counts[case] = counter.calls
                for what, a, b in zip(("out", "grad_x", "grad_w", "grad_b"), ours, plain):
                    errors[f"{case}/{what}/vs_plain"] = rel_error(a, b)
                dim = 0 if kind == "column" else 1
                errors[f"{case}/grad_x/vs_nn_linear"] = rel_error(ours[1], x_ref.grad)
                errors[f"{case}/grad_w/vs_nn_linear"] = rel_error(_gather(ours[2], group, dim), ref_layer.weight.grad)
                errors[f"{case}/grad_b/vs_nn_linear"] = rel_error(ours[3], ref_layer.bias.grad)
                y_full = _gather(ours[0], group, 0) if kind == "row" else _gather(ours[0], group, -1)
                errors[f"{case}/out/vs_nn_linear"] = rel_error(y_full, y_ref)
    return errors, counts


def _gpt_case(pstate):
    """A sequence-parallel GPT (TP = 2) with and without overlap on every qkv/proj/fc1/fc2."""
    config = make_config("llama", sequence_parallel=True)
    tokens, labels, mask = (t[:2] for t in global_batch(0))
    results = {}
    for overlap in (False, True):
        model = make_model(config, pstate)
        enabled = enable_tp_comm_overlap(model, overlap_settings(None, "defaults")) if overlap else []
        with _Counter() as counter:
            loss = masked_mean_loss(model(tokens, labels=labels), mask)
            loss.backward()
        all_reduce_sequence_parallel_grads(model.parameters(), pstate.tp_group)
        results[overlap] = {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                            "enabled": enabled, "p2p": counter.calls["p2p"]}
    return {"loss": rel_error(results[True]["loss"], results[False]["loss"]),
            "grads": max(rel_error(g, results[False]["grads"][n]) for n, g in results[True]["grads"].items()),
            "enabled": results[True]["enabled"], "p2p": (results[False]["p2p"], results[True]["p2p"])}


def _worker(rank, world_size):
    torch.manual_seed(0)
    out = {}
    for tp in (2, 4):
        pstate = ParallelState.create(ParallelLayout(world_size, tensor=tp))
        errors, counts = _layer_cases(pstate.tp_group)
        out[f"errors_tp{tp}"], out[f"counts_tp{tp}"] = errors, counts
    out["gpt"] = _gpt_case(ParallelState.create(ParallelLayout(world_size, tensor=2)))
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_linears_equal_nn_linear_and_the_plain_path(spawned, tp):
    for rank, result in enumerate(spawned):
        bad = {k: v for k, v in result[f"errors_tp{tp}"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: {sorted(bad.items())[:6]}"
        assert len(result[f"errors_tp{tp}"]) == 8 * (len(METHODS) * len(COLUMN_DGRAD) + len(METHODS) ** 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_method_splits_its_collective(spawned, tp):
    """Fails if the overlap setting is ignored: the plain path runs one all-gather and one
    reduce-scatter per direction and no point-to-point transfer."""
    counts = spawned[0][f"counts_tp{tp}"]
    for case, calls in counts.items():
        kind, fprop, dgrad = case.split("/")[1:4]
        rings = [m for m in (fprop, dgrad) if "ring_exchange" in m]
        assert calls["p2p"] == (tp - 1) * len(rings), (case, calls)
        if "fprop=pipeline8" in case and kind == "column":
            assert calls["all_gather"] >= 8 // tp, (case, calls)  # 8 / t rows per rank: one chunk each
        if "fprop=pipeline3" in case and kind == "row":
            assert calls["reduce_scatter"] >= 3, (case, calls)


def test_gpt_with_tp_comm_overlap_equals_the_plain_model(spawned):
    for rank, result in enumerate(spawned):
        gpt = result["gpt"]
        assert gpt["loss"] <= TOL and gpt["grads"] <= TOL, (rank, gpt)
        assert sorted({n.rsplit(".", 1)[-1] for n in gpt["enabled"]}) == [
            "linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"], gpt["enabled"]
        plain_p2p, overlapped_p2p = gpt["p2p"]
        assert plain_p2p == 0 and overlapped_p2p > 0, gpt["p2p"]


def test_cfg_is_read_as_transformer_engine_names_it():
    sections = {"qkv_fprop": {"method": "ring_exchange", "aggregate": 1},
                "proj_fprop": {"method": "pipeline", "num_sm": 4, "num_splits": 2, "set_sm_margin": 0},
                "fc1_dgrad": {"method": "bulk", "num_sm": 2}}
    settings = overlap_settings(sections, "cfg.yaml")
    assert settings["proj_fprop"] == OverlapSetting("pipeline", 2)
    assert settings["fc2_fprop"] == DEFAULTS["fc2_fprop"] == OverlapSetting("pipeline", 4)
    assert settings["fc1_dgrad"].method == "bulk" and settings["qkv_fprop"].method == "ring_exchange"
    assert kernel_settings_given(sections) == ["qkv_fprop.aggregate", "proj_fprop.num_sm", "proj_fprop.set_sm_margin",
                                               "fc1_dgrad.num_sm"]


@pytest.mark.parametrize("sections, message", [
    ({"qkv_fprop": {"method": "bulk"}}, "cfg.yaml: qkv_fprop.method 'bulk' is not one of ring_exchange, pipeline"),
    ({"attn_fprop": {"method": "pipeline"}}, "cfg.yaml: unknown section 'attn_fprop'"),
    ({"fc2_fprop": {"method": "pipeline", "num_splits": 0}}, "cfg.yaml: fc2_fprop.num_splits must be a positive"),
    ({"fc2_fprop": {"method": "pipeline", "splits": 2}}, "cfg.yaml: section 'fc2_fprop' has unknown key 'splits'"),
    ({"qkv_wgrad": {"method": "pipeline"}}, "cfg.yaml: qkv_wgrad.method 'pipeline' is not one of bulk"),
])
def test_cfg_refuses_what_it_cannot_do(sections, message):
    with pytest.raises(ValueError) as error:
        overlap_settings(sections, "cfg.yaml")
    assert str(error.value).startswith(message), error.value
