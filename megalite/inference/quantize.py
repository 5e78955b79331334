"""Weight-only INT8 / INT4 quantization of a loaded model for generation (`--quantize`).

torchao's quantize_ does the work: it replaces the weight of every ColumnParallelLinear and
RowParallelLinear of attention and MLP with a torchao tensor subclass (Int8Tensor: int8 values
and one scale per output row; INT4: groups of 128 input columns, packed for CUDA's tinygemm
kernel), whose F.linear dequantizes on the fly. megalite's linears call F.linear on their own
weight, so they need no wrapper. The embeddings and the output layer stay in the model's dtype
(torchao's default filter would skip megalite's embedding, and leaving the logits' GEMM in full
precision is what gpt-fast and torchao's LLaMA examples do too).

Where torchao 0.18 has no kernel, the choice is refused in one line: INT4 needs CUDA (its CPU
int4 path, IntxWeightOnlyConfig, stores int4 values unpacked in int8 bytes, so it saves nothing
over INT8) on a GPU of compute capability 8.0 or newer (tinygemm's tensor-core kernel, as torchao
checks). On CUDA INT4 is Int4WeightOnlyConfig with the tile_packed_to_4d layout and tinygemm's
asymmetric scale and zero point per group of 128 (`quantize_config`): the model is cast to bf16
first, tinygemm's only dtype; torchao pads rows and columns to its tile sizes itself. torchao's
inductor settings are left alone (set_inductor_config=False): generation is not compiled. TP > 1 is refused: the quantized shards have not been checked against TP = 1; so
are MoE models, whose experts' grouped weights are not TP linears.
"""

import torch
from torch import nn

from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

QUANTIZE_CHOICES = ("int8", "int4")
INT4_GROUP_SIZE = 128


def check_quantize(mode: str | None, device: torch.device, tp_size: int, has_experts: bool = False) -> None:
    """Raises ValueError, one line, where `--quantize mode` cannot run on this device / layout / model."""
    if mode is None:
        return
    if mode not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize {mode}: choose one of {', '.join(QUANTIZE_CHOICES)}")
    if has_experts:
        raise ValueError(f"--quantize {mode}: the checkpoint's model has MoE experts, whose grouped weights "
                         "it does not quantize (only attention and dense MLP linears): run without --quantize")
    if tp_size > 1:
        raise ValueError(f"--quantize {mode} runs with TP = 1 only (got TP = {tp_size}): "
                         "run generation in one process, or without --quantize")
    if mode == "int4" and device.type != "cuda":
        raise ValueError("--quantize int4 needs CUDA (torchao 0.18's int4 weight-only kernel is CUDA's tinygemm; "
                         "it has no packed int4 layout on CPU): use --quantize int8 on CPU")
    if mode == "int4" and cuda_capability(device) < (8, 0):
        raise ValueError(f"--quantize int4 needs a GPU of compute capability 8.0 or newer (tinygemm's tensor-core "
                         f"kernel); {device} has {'.'.join(map(str, cuda_capability(device)))}: use --quantize int8")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def quantize_config(mode: str):
    """The torchao config --quantize `mode` passes to quantize_."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if mode == "int4":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d",
                                    int4_choose_qparams_algorithm="tinygemm", set_inductor_config=False)
    return Int8WeightOnlyConfig(set_inductor_config=False)


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention and MLP linears --quantize converts: every TP linear but the output layer."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not name.endswith("output_layer")
            and module.weight is not None]


def quantize_weights(model: nn.Module, mode: str) -> nn.Module:
    """`model` with its attention and MLP weights quantized in place (see the module docstring)."""
    from torchao.quantization import quantize_

    targets = {id(module) for _, module in quantized_linears(model)}
    if mode == "int4":
        for name, module in quantized_linears(model):
            if module.weight.shape[1] % INT4_GROUP_SIZE:
                raise ValueError(f"--quantize int4: {name}'s input width {module.weight.shape[1]} is not a "
                                 f"multiple of the group size {INT4_GROUP_SIZE}")
        model.to(torch.bfloat16)  # tinygemm takes bf16 activations and weights
    quantize_(model, quantize_config(mode), filter_fn=lambda module, fqn: id(module) in targets)
    return model


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, counting every inner tensor of a torchao subclass (values and scales)."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all the model's parameters and buffers as they are stored."""
    return sum(tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
