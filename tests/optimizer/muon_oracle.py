"""Megatron-Core 0.16.1's TensorParallelMuon (megatron/core/optimizer/muon.py) over NVIDIA's
emerging-optimizers 0.3.0, the oracle of tests/optimizer/test_muon.py. Two gaps are bridged
here, neither touching the arithmetic: emerging-optimizers 0.3.0 declares Python >= 3.12 and
imports typing.override (3.12's; typing_extensions has the same decorator); and it renamed two
keywords megatron-core 0.16.1 still passes: OrthogonalizedOptimizer's `use_nesterov` (now
`nesterov`) and newton_schulz_tp's `mode` (now `tp_mode`). Install: pip install --no-deps --ignore-requires-python emerging-optimizers==0.3.0
(its dependencies, torch and absl-py, are already in the dev environment).
"""

import sys
import typing
from types import SimpleNamespace

import typing_extensions

if sys.version_info < (3, 12) and not hasattr(typing, "override"):
    typing.override = typing_extensions.override

from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer  # noqa: E402
from emerging_optimizers.orthogonalized_optimizers import muon_utils  # noqa: E402
from megatron.core.optimizer import muon as megatron_muon  # noqa: E402

if not megatron_muon.HAVE_EMERGING_OPTIMIZERS:
    raise ImportError("megatron.core.optimizer.muon did not find emerging_optimizers (see this module's docstring)")


def _newton_schulz_tp(*args, mode, **kwargs):
    return muon_utils.newton_schulz_tp(*args, tp_mode=mode, **kwargs)


megatron_muon.newton_schulz_tp = _newton_schulz_tp


class _NesterovKeyword(OrthogonalizedOptimizer):
    def __init__(self, *args, use_nesterov: bool, **kwargs):
        super().__init__(*args, nesterov=use_nesterov, **kwargs)


class MegatronMuon(megatron_muon.TensorParallelMuon, _NesterovKeyword):
    """TensorParallelMuon, whose super().__init__ lands in _NesterovKeyword."""


def megatron_muon_optimizer(params, tp_group, expt_tp_group=None, **kwargs):
    """TensorParallelMuon over `params`; parameters flagged expert_tp (as get_megatron_muon_optimizer
    flags those named '*experts*' but not '*shared*') use `expt_tp_group` (default: `tp_group`)."""
    expt_tp = tp_group if expt_tp_group is None else expt_tp_group
    return MegatronMuon(params, pg_collection=SimpleNamespace(tp=tp_group, expt_tp=expt_tp),
                        is_qkv_fn=lambda p: getattr(p, "is_qkv", False), **kwargs)
