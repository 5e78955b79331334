"""The GEMMs of a linear layer, and where its weight gradient goes: the one place every
tensor-parallel linear's forward and backward multiply through.

    y     = x W^T        Gemm.fprop
    dgrad = dy W         Gemm.dgrad
    wgrad = dy^T x       Gemm.wgrad (a new tensor), Gemm.wgrad_accumulate (into main_grad)

`Gemm` is the 16-bit (or fp32) strategy. An FP8 strategy (issue 31: torch._scaled_mm, delayed
or tensorwise scaling) is another class with the same four methods, one instance per layer so
that it can hold its amax histories and scales: fprop quantizes x and W, dgrad dy and W^T,
wgrad dy^T and x, each a scaled GEMM with an fp32 or bf16 result; wgrad_accumulate asks that
GEMM for an fp32 result added to main_grad. A backward that runs both dgrad and wgrad first asks
`shared_grad` for what the two may share of dy (an FP8 strategy: one cast writing dy in both
layouts, its amax recorded once) and hands it to both. Nothing else changes: the layers, the collectives
around the GEMMs and the sink below are the same for both. Not yet routed through the
strategy (an FP8 one must be): --tp-comm-overlap's chunked fprop and dgrad GEMMs
(overlapped_linear.py) and the deferred output layer's dgrad (deferred_wgrad.py), which call
F.linear / matmul directly; their weight gradients do go through the sink.

`weight_gradient` is the sink. With gradient accumulation fusion (Megatron's default,
--no-gradient-accumulation-fusion turns it off) a weight whose data-parallel wrapper gave it
an fp32 main_grad and marked it `fuse_wgrad_accumulation` gets dy^T x added to main_grad inside
the weight-gradient GEMM, and autograd receives None for it: no separate weight gradient is
formed, param.grad stays None, and the wrapper's post-accumulate hook (which autograd still
calls) only marks the parameter ready. Otherwise the gradient is returned as autograd's
ordinary .grad (the wrapper's hook then adds it to main_grad, as without fusion).

Which weight gradients the running backward wants is asked of the autograd engine, not taken
from ctx.needs_input_grad (fixed at forward time): a zero-bubble input-gradient pass (B, an
autograd.grad that does not ask for the weights) must not add to main_grad, and its weight
pass (W, a backward restricted to the weights) need not form input gradients again.
"""

import torch
import torch.nn.functional as F


def _cuda_fp32_accumulation(main_grad: torch.Tensor, operand: torch.Tensor) -> bool:
    """Whether torch's addmm with out_dtype can add a 16-bit GEMM's fp32 result into main_grad
    (CUDA only in torch 2.13: aten::addmm.dtype_out has no CPU kernel)."""
    return (main_grad.is_cuda and main_grad.dtype == torch.float32
            and operand.dtype in (torch.bfloat16, torch.float16))


class Gemm:
    """The GEMMs of a linear layer in the inputs' own dtype (bf16, fp16 or fp32)."""

    name = "16-bit"

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def shared_grad(self, grad2d: torch.Tensor):
        """What dgrad and wgrad of one backward share of the output gradient grad2d [tokens, out],
        passed to both as `shared`: None here (each GEMM takes grad itself)."""
        return None

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor, shared=None) -> torch.Tensor:
        return grad.matmul(weight)

    def wgrad(self, grad2d: torch.Tensor, x2d: torch.Tensor, shared=None) -> torch.Tensor:
        """dy^T x, [out, in], in the operands' dtype."""
        return grad2d.t().mm(x2d)

    def wgrad_accumulate(self, main_grad: torch.Tensor, grad2d: torch.Tensor, x2d: torch.Tensor,
                         shared=None) -> None:
        """main_grad += dy^T x, accumulated in main_grad's dtype inside the GEMM.

        CUDA, 16-bit operands, fp32 main_grad: one addmm with out_dtype=float32 (the GEMM
        accumulates in fp32 and adds to main_grad in its epilogue; the 16-bit weight gradient
        never exists). Same dtype (fp32 training): addmm_ into main_grad. Otherwise (16-bit on
        CPU): the operands in main_grad's dtype, then addmm_, which is the fused GPU result's
        precision (no 16-bit rounding of the weight gradient), not today's unfused one."""
        if _cuda_fp32_accumulation(main_grad, x2d):
            torch.addmm(main_grad, grad2d.t(), x2d, out_dtype=main_grad.dtype, out=main_grad)
        elif main_grad.dtype == x2d.dtype == grad2d.dtype:
            main_grad.addmm_(grad2d.t(), x2d)
        else:
            main_grad.addmm_(grad2d.t().to(main_grad.dtype), x2d.to(main_grad.dtype))


DEFAULT_GEMM = Gemm()


def gradient_node(tensor: torch.Tensor):
    """The autograd node a backward reaches `tensor` through (its AccumulateGrad for a
    parameter), or None when it needs no gradient; take it in forward for `engine_wants`."""
    if not tensor.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(tensor).node


def engine_wants(node) -> bool | None:
    """Whether the running backward will execute `node`: True, False, or None when torch
    cannot tell (an autograd.grad that captures this leaf's gradient: then it is wanted, as a
    returned tensor, never accumulated into main_grad)."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def fuses_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether `weight`'s gradient is accumulated into its main_grad inside the GEMM (its
    data-parallel wrapper enabled gradient accumulation fusion and gave it a main_grad)."""
    return getattr(weight, "fuse_wgrad_accumulation", False) and getattr(weight, "main_grad", None) is not None


def weight_gradient(weight: torch.Tensor, wanted: bool | None, grad2d: torch.Tensor, x2d: torch.Tensor,
                    gemm: Gemm = DEFAULT_GEMM, shared=None) -> torch.Tensor | None:
    """What a linear's backward returns for `weight`. `wanted` is engine_wants(gradient_node(
    weight)), or None where the engine cannot be asked (torch.compile traces the backward):
    False: not formed (None). True and the weight fuses: added to main_grad here (None).
    Otherwise the weight gradient, for autograd. grad2d [tokens, out], x2d [tokens, in];
    `shared`: gemm.shared_grad(grad2d) when dgrad took it too."""
    if wanted is False:
        return None
    if wanted and fuses_into_main_grad(weight):
        gemm.wgrad_accumulate(weight.main_grad, grad2d, x2d, shared)
        weight.grad_added_to_main_grad = True
        return None
    return gemm.wgrad(grad2d, x2d, shared)
