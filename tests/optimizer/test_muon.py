"""Muon (megalite/optimizer/muon.py) against Megatron-Core's TensorParallelMuon
(tests/optimizer/muon_oracle.py) at TP = 2 in two spawned gloo processes, for each
--muon-tp-mode: a column-parallel weight, a row-parallel one, a fused QKV weight (split
and not) and an unsplit one, two steps from the same weights and gradients, within 1e-6.
"""

import pytest
import torch
import torch.distributed as dist

from megalite.optimizer.muon import TP_MODES, Muon, MuonTarget, muon_scale, newton_schulz, ns_coefficients
from tests.distributed import run_distributed

TOL = 1e-6
QKV_SPLIT = (2 * 4, 4, 4)  # 2 query heads per group, head dim 4
# name: (full shape, partition dim or None, fused qkv)
WEIGHTS = {"column": ((24, 16), 0, False), "row": ((16, 40), 1, False),
           "qkv": ((4 * sum(QKV_SPLIT), 16), 0, True), "plain": ((12, 8), None, False)}
OPTIONS = [dict(nesterov=True, scale_mode="spectral", coefficient_type="quintic", fp32_matmul_prec="high"),
           dict(nesterov=False, scale_mode="unit_rms_norm", coefficient_type="polar_express", split_qkv=False,
                fp32_matmul_prec="high"),
           dict(nesterov=True, scale_mode="shape_scaling", coefficient_type="simple", extra_scale_factor=0.5,
                fp32_matmul_prec="medium")]
STEPS = 2


def _full(seed: int, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _local(full: torch.Tensor, dim, rank, tp) -> torch.Tensor:
    return full.clone() if dim is None else full.chunk(tp, dim=dim)[rank].clone()


def _run(make, rank, tp, tp_group, megatron_attrs: bool):
    params, targets = {}, {}
    for i, (name, (shape, dim, qkv)) in enumerate(WEIGHTS.items()):
        p = torch.nn.Parameter(_local(_full(i, shape), dim, rank, tp))
        if megatron_attrs:
            p.partition_dim = -1 if dim is None else dim
            p.is_qkv = qkv
        targets[p] = MuonTarget(tuple(p.shape), dim, tp_group if dim is not None else None,
                                QKV_SPLIT if qkv else None)
        params[name] = p
    optimizer = make(list(params.values()), targets)
    for step in range(STEPS):
        for i, (name, (shape, dim, _)) in enumerate(WEIGHTS.items()):
            params[name].grad = _local(_full(100 * (step + 1) + i, shape), dim, rank, tp)
        optimizer.step()
    return {name: p.detach().clone() for name, p in params.items()}


def _worker(rank, world_size):
    from tests.optimizer.muon_oracle import megatron_muon_optimizer

    group = dist.group.WORLD
    out = {}
    for mode in TP_MODES:
        for k, options in enumerate(OPTIONS):
            kw = dict(dict(lr=0.02, weight_decay=0.1, num_ns_steps=5, split_qkv=True), **options)
            ours_kw = {**{k: v for k, v in kw.items() if k != "num_ns_steps"}, "steps": kw["num_ns_steps"],
                       "tp_mode": mode}
            kw["use_nesterov"] = kw.pop("nesterov")
            ours = _run(lambda ps, targets: Muon(ps, momentum=0.9, targets=targets, **ours_kw),
                        rank, world_size, group, False)
            theirs = _run(lambda ps, targets: megatron_muon_optimizer(
                ps, group, momentum_beta=0.9, qkv_split_shapes=QKV_SPLIT, mode=mode, **kw),
                rank, world_size, group, True)
            out[(mode, k)] = {n: (ours[n] - theirs[n]).abs().max().item() for n in ours}
            out[(mode, k, "ours")] = ours
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize("k", range(len(OPTIONS)))
def test_two_steps_equal_megatron_core_muon_at_tp2(spawned, mode, k):
    for rank in range(2):
        errors = spawned[rank][(mode, k)]
        assert max(errors.values()) <= TOL, (rank, errors)


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_duplicated_and_distributed_are_tp_invariant_and_blockwise_is_not(spawned, mode):
    """duplicated/distributed at TP 2 update each shard as one process updates the full matrix
    (the fp32 options); blockwise orthogonalises each shard alone, which differs."""
    single = _run(lambda ps, targets: Muon(ps, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True,
                                           fp32_matmul_prec="high", targets=targets), 0, 1, None, False)
    for rank in range(2):
        for tp_mode, tol, equal in ((mode, 1e-5, True), ("blockwise", 1e-4, False)):
            ours = spawned[rank][(tp_mode, 0, "ours")]
            for name, (shape, dim, _) in WEIGHTS.items():
                if dim is None:
                    continue
                diff = (ours[name] - _local(single[name], dim, rank, 2)).abs().max().item()
                assert (diff <= tol) == equal, (tp_mode, name, rank, diff)


def test_newton_schulz_orthogonalises_and_scales():
    x = _full(7, (16, 48))
    out = newton_schulz(x, 5, "quintic")
    singular = torch.linalg.svdvals(out)
    assert 0.6 < singular.min() and singular.max() < 1.25  # the quintic's noisy ~1 band
    assert torch.allclose(newton_schulz(x.T.contiguous(), 5, "quintic"), out.T, atol=1e-6)
    assert muon_scale(16, 48, "spectral") == 48 ** 0.5 and muon_scale(48, 16, "shape_scaling") == 3 ** 0.5
    assert ns_coefficients("polar_express", 10)[-1] == ns_coefficients("polar_express", 8)[-1]
    assert ns_coefficients("quintic", 6)[5] == ns_coefficients("quintic", 1)[0]
    for bad, match in ((dict(steps=0), "--muon-num-ns-steps"), (dict(tp_mode="rows"), "--muon-tp-mode"),
                       (dict(fp32_matmul_prec="low"), "--muon-fp32-matmul-prec"),
                       (dict(coefficient_type="cubic"), "--muon-coefficient-type"),
                       (dict(scale_mode="rms"), "--muon-scale-mode")):
        with pytest.raises(ValueError, match=match):
            Muon([torch.nn.Parameter(x)], lr=0.1, **bad)
