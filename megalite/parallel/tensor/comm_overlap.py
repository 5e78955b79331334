"""Which overlap each sequence-parallel linear uses under --tp-comm-overlap, named as
Transformer Engine's userbuffer configuration names them (Megatron's --tp-comm-overlap-cfg
YAML, read by megatron/training/initialize.py _initialize_tp_communicators):

    qkv_fprop / fc1_fprop      all-gather + GEMM        ring_exchange | pipeline
    proj_fprop / fc2_fprop     GEMM + reduce-scatter    ring_exchange | pipeline
    proj_dgrad / fc2_dgrad     all-gather + GEMM        ring_exchange | pipeline
    qkv_dgrad / fc1_dgrad      GEMM + reduce-scatter    bulk | ring_exchange | pipeline
    qkv_wgrad / fc1_wgrad      bulk (the reduce-scatter during the weight-gradient GEMM)

Defaults are TE's: ring_exchange for the all-gathers, pipeline in 4 chunks for the forward
reduce-scatters, bulk for the column-parallel backward. A section's `num_splits` sets the
pipeline's chunks; its GPU kernel settings (num_sm, cga_size, set_sm_margin, atomic_gemm,
aggregate, fp8_buf, ...) tune TE's userbuffer kernels and have nothing to act on here.

The layers are found by name (linear_qkv, linear_proj, linear_fc1, linear_fc2), as TE names
its buffers; other linears (the output layer, which Megatron builds without TE) keep the plain
path. The algorithms are in overlapped_linear.py.
"""

from dataclasses import dataclass

from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

ALL_GATHER_METHODS = ("ring_exchange", "pipeline")
LAYER_NAMES = {"linear_qkv": "qkv", "linear_fc1": "fc1", "linear_proj": "proj", "linear_fc2": "fc2"}
_KERNEL_SETTINGS = ("num_sm", "cga_size", "set_sm_margin", "atomic_gemm", "aggregate", "fp8_buf", "use_ce",
                    "pipeline_rs_overlap_first_gemm")


@dataclass(frozen=True)
class OverlapSetting:
    method: str
    num_splits: int = 4


@dataclass(frozen=True)
class LinearOverlap:
    """One layer's overlaps: of its forward collective and of its input gradient's."""

    fprop: OverlapSetting
    dgrad: OverlapSetting


_RING, _PIPELINE, _BULK = OverlapSetting("ring_exchange"), OverlapSetting("pipeline"), OverlapSetting("bulk")
DEFAULTS = {"qkv_fprop": _RING, "fc1_fprop": _RING, "proj_dgrad": _RING, "fc2_dgrad": _RING,
            "proj_fprop": _PIPELINE, "fc2_fprop": _PIPELINE,
            "qkv_dgrad": _BULK, "fc1_dgrad": _BULK, "qkv_wgrad": _BULK, "fc1_wgrad": _BULK}
_ALLOWED = {name: ALL_GATHER_METHODS + (("bulk",) if name in ("qkv_dgrad", "fc1_dgrad") else ())
            for name in DEFAULTS if not name.endswith("_wgrad")}
_ALLOWED.update(qkv_wgrad=("bulk",), fc1_wgrad=("bulk",))


def overlap_settings(sections: dict | None, where: str) -> dict[str, OverlapSetting]:
    """Every buffer's OverlapSetting from a --tp-comm-overlap-cfg mapping (None: TE's defaults);
    a ValueError naming `where` (the file) and the section for anything unknown or impossible."""
    settings = dict(DEFAULTS)
    if sections is None:
        return settings
    if not isinstance(sections, dict):
        raise ValueError(f"{where}: expected a mapping of buffer names (qkv_fprop, ...) to settings")
    for name, section in sections.items():
        if name not in _ALLOWED:
            raise ValueError(f"{where}: unknown section {name!r} (known: {', '.join(sorted(_ALLOWED))})")
        if not isinstance(section, dict):
            raise ValueError(f"{where}: section {name!r} must be a mapping (method: ..., num_splits: ...)")
        unknown = sorted(set(section) - {"method", "num_splits", *_KERNEL_SETTINGS})
        if unknown:
            raise ValueError(f"{where}: section {name!r} has unknown key {unknown[0]!r}")
        method = section.get("method", DEFAULTS[name].method)
        if method not in _ALLOWED[name]:
            raise ValueError(f"{where}: {name}.method {method!r} is not one of {', '.join(_ALLOWED[name])}")
        splits = section.get("num_splits", DEFAULTS[name].num_splits)
        if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
            raise ValueError(f"{where}: {name}.num_splits must be a positive integer, got {splits!r}")
        settings[name] = OverlapSetting(method, splits)
    return settings


def kernel_settings_given(sections: dict | None) -> list[str]:
    """'section.key' for every TE kernel setting in a --tp-comm-overlap-cfg mapping."""
    return [f"{name}.{key}" for name, section in (sections or {}).items() if isinstance(section, dict)
            for key in section if key in _KERNEL_SETTINGS]


def enable_tp_comm_overlap(model, settings: dict[str, OverlapSetting]) -> list[str]:
    """Give every sequence-parallel qkv / proj / fc1 / fc2 linear of `model` its LinearOverlap;
    returns the names of the layers that got one."""
    enabled = []
    for name, module in model.named_modules():
        short = LAYER_NAMES.get(name.rsplit(".", 1)[-1])
        if short is None or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if not module.sequence_parallel:
            continue
        module.comm_overlap = LinearOverlap(settings[f"{short}_fprop"], settings[f"{short}_dgrad"])
        enabled.append(name)
    return enabled
