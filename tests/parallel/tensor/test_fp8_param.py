"""--fp8-param-gather's FSDP2 hooks (megalite/parallel/tensor/fp8_param.py) without FSDP2: the shard
cast to FP8 (padded to FSDP2's shard rows, its amax recorded), the gathered FP8 weight multiplied
by the FP8 GEMM as it is, everything else refused, and the shard saved as a plain tensor. The
FSDP2 runs themselves: tests/parallel/test_fp8_layouts.py."""

import io

import pytest
import torch
from torch import nn

from megalite.parallel.tensor.fp8_gemm import Fp8Gemm, scaled_mm
from megalite.parallel.tensor.fp8_param import Fp8GatheredWeight, Fp8ShardedWeight
from megalite.parallel.tensor.fp8_scaling import INPUT, WEIGHT, DelayedScaling, Fp8Recipe, quantize

RECIPE = Fp8Recipe(format="hybrid")
E4M3 = torch.float8_e4m3fn


class _Mesh:  # what the hook asks of FSDP2's mesh; delayed scaling needs no group
    def size(self):
        return 2

    def get_group(self):
        return None


def _linear(weight_scale: float) -> nn.Module:
    linear = nn.Module()
    linear.gemm = Fp8Gemm(RECIPE, DelayedScaling(RECIPE), "column")
    linear.gemm.scaling.scales[WEIGHT] = weight_scale
    return linear


def test_pre_all_gather_casts_the_shard_pads_it_and_records_its_amax():
    torch.manual_seed(0)
    shard, linear = torch.randn(2, 4), _linear(8.0)
    (data,), (scale,) = Fp8ShardedWeight(shard).fsdp_pre_all_gather(_Mesh(), torch.Size([5, 4]), (4, 1), linear, None)
    assert data.dtype == E4M3 and data.shape == (3, 4)  # 5 rows over 2 ranks: FSDP2 pads shards to 3
    assert torch.equal(data[:2].float(), quantize(shard, torch.tensor(8.0), E4M3).float())
    assert not data[2].float().any() and scale.item() == 8.0
    assert linear.gemm.scaling.amax_history[0, WEIGHT].item() == shard.abs().max().item()


def test_the_gemm_multiplies_the_gathered_fp8_weight_as_it_is():
    torch.manual_seed(1)
    weight, x = torch.randn(6, 4), torch.randn(3, 4)
    linear = _linear(16.0)
    (data,), (scale,) = Fp8ShardedWeight(weight).fsdp_pre_all_gather(_Mesh(), torch.Size([12, 4]), (4, 1), linear, None)
    gathered, inner = Fp8ShardedWeight(weight).fsdp_post_all_gather((data,), (scale,), torch.float32)
    assert isinstance(gathered, Fp8GatheredWeight) and gathered.shape == (6, 4) and inner == (data,)
    y = linear.gemm.fprop(x, nn.Parameter(gathered), None)
    x_scale = linear.gemm.scaling.scales[INPUT]
    assert torch.equal(y, scaled_mm(quantize(x, x_scale, E4M3), x_scale, data.t(), scale, torch.float32))
    Fp8ShardedWeight(weight).fsdp_post_all_gather((data,), (torch.tensor(2.0),), torch.float32, out=gathered)
    assert gathered.fp8_scale.item() == 2.0  # a later gather: the same buffer, the new scale


def test_the_gathered_weight_refuses_any_other_computation():
    gathered = Fp8GatheredWeight(torch.zeros(2, 2, dtype=E4M3), torch.tensor(1.0), torch.bfloat16)
    with pytest.raises(NotImplementedError, match="--fp8-param-gather"):
        gathered + 1


def test_the_sharded_weight_is_saved_as_a_plain_tensor():
    shard = Fp8ShardedWeight(torch.arange(6.0).reshape(2, 3))
    buffer = io.BytesIO()
    torch.save({"w": shard}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, torch.arange(6.0).reshape(2, 3))
