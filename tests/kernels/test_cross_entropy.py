"""Cross-entropy (Triton kernels and the chunked torch path) vs F.cross_entropy, unsharded and
vocab-parallel at TP=2 over gloo, with padding columns and label smoothing, value and gradient."""

import pytest
import torch
import torch.nn.functional as F

from megalite.kernels import cross_entropy
from megalite.kernels.cross_entropy_torch import torch_grad_logits, torch_local_stats
from tests.distributed import run_distributed
from tests.kernels.checks import FP32_TOL, assert_close, assert_grad_close

DTYPES = [torch.float32, torch.bfloat16]
# (rows, local vocab, valid vocab): padding columns beyond `valid` in all but the square cases.
SHAPES = [(1, 1, 1), (3, 7, 5), (17, 33, 33), (17, 130, 100), (3, 5000, 4999)]
PADDING_LOGIT = 40.0  # padding columns hold large logits: any leak into the softmax shows


def _logits(rows, vocab, valid, dtype, g, device):
    logits = 4 * torch.randn((rows, vocab), generator=g)
    logits[:, valid:] = PADDING_LOGIT
    return logits.to(device=device, dtype=dtype)


def _expected(logits, target, valid, eps, grad_loss):
    """fp64 loss and gradient of F.cross_entropy over the valid columns (0 gradient on padding)."""
    z = logits.detach()[:, :valid].double().requires_grad_()
    loss = F.cross_entropy(z, target, reduction="none", label_smoothing=eps)
    (grad,) = torch.autograd.grad(loss, [z], grad_loss.double())
    full = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    full[:, :valid] = grad
    return loss.detach(), full


def _check(name, logits, target, valid, eps, impl, grad_loss, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    loss = cross_entropy(leaf, target, valid_vocab=valid, label_smoothing=eps, impl=impl, **kwargs)
    assert loss.dtype == torch.float32, f"{name}: loss dtype {loss.dtype}"
    expected_loss, expected_grad = _expected(logits, target, valid, eps, grad_loss)
    assert_close(loss, expected_loss, name=f"{name} loss", **FP32_TOL)
    (grad,) = torch.autograd.grad(loss, [leaf], grad_loss)
    assert_grad_close(grad, expected_grad, logits.dtype, f"{name} grad")


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["eps0", "eps0.1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cross_entropy(shape, dtype, eps, impl, device):
    rows, vocab, valid = shape
    g = torch.Generator().manual_seed(sum(shape))
    logits = _logits(rows, vocab, valid, dtype, g, device)
    target = torch.randint(0, valid, (rows,), generator=g).to(device)
    grad_loss = torch.rand(rows, generator=g).to(device)
    _check(f"cross_entropy {shape} {dtype} eps={eps} {impl}", logits, target, valid, eps, impl, grad_loss)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cross_entropy_3d_and_inplace_backward(impl, device):
    """logits [b, s, V] with target [b, s]; the in-place backward writes the gradient into the logits buffer."""
    g = torch.Generator().manual_seed(3)
    logits = _logits(2 * 5, 40, 37, torch.bfloat16, g, device)
    target = torch.randint(0, 37, (10,), generator=g).to(device)
    grad_loss = torch.rand(10, generator=g).to(device)
    expected_loss, expected_grad = _expected(logits, target, 37, 0.1, grad_loss)

    buffer = logits.clone().view(2, 5, 40).requires_grad_()
    loss = cross_entropy(buffer, target.view(2, 5), valid_vocab=37, label_smoothing=0.1, inplace_backward=True,
                         impl=impl)
    assert loss.shape == (2, 5)
    assert_close(loss.view(-1), expected_loss, name="3d loss", **FP32_TOL)
    (grad,) = torch.autograd.grad(loss, [buffer], grad_loss.view(2, 5))
    assert grad.data_ptr() == buffer.data_ptr(), "in-place backward did not write into the logits buffer"
    assert_grad_close(grad.view(10, 40), expected_grad, torch.bfloat16, "3d in-place grad")


def test_torch_path_in_small_chunks():
    """The torch path's row chunking (forced down to 1-3 rows per chunk) changes nothing."""
    g = torch.Generator().manual_seed(9)
    logits = _logits(7, 20, 18, torch.float32, g, "cpu")
    local_target = torch.tensor([0, 5, -1, 17, 3, -1, 9])
    whole = torch_local_stats(logits, local_target, 18, True)
    for chunk in (18, 40, 54):
        assert torch.equal(torch_local_stats(logits, local_target, 18, True, chunk_elements=chunk), whole)
    row_max, log_sum = whole[0], whole[1].log()
    smooth = torch.tensor([0.1 / 18])
    grad_loss = torch.rand(7, generator=g)
    whole_grad = torch_grad_logits(logits, local_target, row_max, log_sum, grad_loss, 18, 0.1, smooth, False)
    assert torch.equal(torch_grad_logits(logits, local_target, row_max, log_sum, grad_loss, 18, 0.1, smooth, False,
                                         chunk_elements=40), whole_grad)


def test_vocab_start_offsets_the_targets(device):
    """Unsharded, a shard starting at vocab_start takes global ids."""
    g = torch.Generator().manual_seed(4)
    logits = _logits(6, 30, 30, torch.float32, g, device)
    target = torch.randint(0, 30, (6,), generator=g).to(device)
    for impl in ("triton", "torch"):
        loss = cross_entropy(logits, target + 1000, vocab_start=1000, impl=impl)
        assert_close(loss, F.cross_entropy(logits, target, reduction="none"), name=f"offset {impl}", **FP32_TOL)


def test_bad_inputs_are_named():
    logits = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="target must be integer ids of shape"):
        cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="valid_vocab must be in"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), valid_vocab=11)
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
    with pytest.raises(ValueError, match="impl must be one of"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), impl="cuda")


def _vocab_parallel_worker(rank, world_size):
    """Every configuration at once, on TP ranks sharing one set of global logits."""
    import torch.distributed as dist

    group = dist.group.WORLD
    checked = 0
    # (true vocabulary, padded vocabulary): padding on the last rank, then a last rank that is all padding.
    for true_vocab, padded_vocab in ((13, 16), (7, 16)):
        local_vocab = padded_vocab // world_size
        vocab_start = rank * local_vocab
        valid = max(0, min(local_vocab, true_vocab - vocab_start))
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(true_vocab)
            rows = 9
            full = _logits(rows, padded_vocab, true_vocab, dtype, g, "cpu")
            target = torch.randint(0, true_vocab, (rows,), generator=g)
            grad_loss = torch.rand(rows, generator=g)
            for eps in (0.0, 0.1):
                expected_loss, expected_grad = _expected(full, target, true_vocab, eps, grad_loss)
                shard = slice(vocab_start, vocab_start + local_vocab)
                for impl in ("triton", "torch"):
                    name = f"TP={world_size} rank {rank} V={true_vocab}/{padded_vocab} {dtype} eps={eps} {impl}"
                    leaf = full[:, shard].clone().requires_grad_()
                    loss = cross_entropy(leaf, target, vocab_start=vocab_start, valid_vocab=valid, group=group,
                                         label_smoothing=eps, impl=impl)
                    assert_close(loss, expected_loss, name=f"{name} loss", **FP32_TOL)
                    (grad,) = torch.autograd.grad(loss, [leaf], grad_loss)
                    assert_grad_close(grad, expected_grad[:, shard], dtype, f"{name} grad")
                    checked += 1
    return checked


def test_vocab_parallel_tp2(device):
    if device != "cpu":
        pytest.skip("the TP=2 check runs on CPU with gloo")
    assert run_distributed(_vocab_parallel_worker, 2) == [16, 16]
