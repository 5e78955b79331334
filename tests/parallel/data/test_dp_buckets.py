"""Gradient buffers, buckets and hooks in one process (DP = 1): layout in backward order,
bucket sizes, main-gradient and parameter-buffer views, hooks that accumulate and free .grad,
no_sync, the order in which overlapped buckets launch, and clear errors."""

import pytest
import torch
from torch import nn

from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.state import ParallelState
from tests.model.test_gpt_tp import batch, make_config

SINGLE = ParallelState.single()


def _model(family="gpt2", **overrides):
    return GPTModel(make_config(family, **overrides), SINGLE, init_seed=7)


def _loss(module, seed=0):
    tokens, labels, mask = batch(seed)
    return masked_mean_loss(module(tokens, labels=labels), mask)


def _inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= \
        start + buffer.numel() * buffer.element_size()


@pytest.mark.parametrize("dist_opt", [False, True])
def test_layout_is_backward_order_with_bounded_buckets(dist_opt):
    model = _model(params_dtype="bfloat16")
    params = [p for p in model.parameters()]
    ddp = DistributedDataParallel(model, SINGLE, bucket_size=10_000, use_distributed_optimizer=dist_opt)
    (buffer,) = ddp.buffers_
    assert buffer.grad_data.dtype == torch.float32 and buffer.param_dtype == torch.bfloat16
    laid_out = [p for bucket in buffer.buckets for p in bucket.params]
    assert laid_out == params[::-1]
    offsets = [buffer.grad_data.data_ptr()]
    for bucket in buffer.buckets:
        sizes = [hi - lo for lo, hi in bucket.param_ranges.values()]
        assert sum(sizes) >= 10_000 or bucket is buffer.buckets[-1]
        assert sum(sizes[:-1]) < 10_000, "a bucket kept growing past the bucket size"
        assert bucket.numel % (128 if dist_opt else 1) == 0
        assert bucket.numel - sum(sizes) < (128 if dist_opt else 1)
        assert bucket.grad_data.data_ptr() == offsets[-1]
        offsets.append(bucket.grad_data.data_ptr() + bucket.numel * 4)
    for p in params:
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
        assert _inside(p.main_grad, buffer.grad_data)
        assert _inside(p, buffer.param_data) if dist_opt else buffer.param_data is None


def test_parameter_buffer_keeps_values_and_model_output():
    reference = _model()
    model = _model()
    ddp = DistributedDataParallel(model, SINGLE, use_distributed_optimizer=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(_loss(ddp), _loss(reference))


def test_shared_embedding_sits_alone_at_a_bucket_start():
    model = nn.Sequential(nn.Linear(4, 300), nn.Linear(300, 4))
    model[0].weight.shared_embedding = True
    ddp = DistributedDataParallel(model, SINGLE, use_distributed_optimizer=True)
    (bucket,) = [b for b in ddp.buckets if model[0].weight in b.param_ranges]
    assert bucket.params == [model[0].weight] and bucket.param_ranges[model[0].weight] == (0, 1200)


def test_hooks_accumulate_into_main_grad_and_free_grad():
    reference, model = _model(), _model()
    ddp = DistributedDataParallel(model, SINGLE)
    for seed in (0, 1):
        _loss(reference, seed).backward()
        _loss(ddp, seed).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is None, name
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)
    ddp.zero_grad_buffer()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())


def test_overlap_launches_each_bucket_the_moment_its_last_gradient_is_ready_outside_no_sync():
    """At the launch of bucket i exactly the gradients of buckets 0..i are ready: the later
    buckets' parameters (the earlier layers, the embeddings last) still await theirs, so the
    collective starts during backward, not after it."""
    model = _model()
    ddp = DistributedDataParallel(model, SINGLE, bucket_size=10_000, overlap_grad_reduce=True)
    names = {p: n for n, p in model.named_parameters()}
    launched, ready_at_launch = [], []
    for bucket in ddp.buckets:
        original = bucket.start_grad_sync

        def record(async_op, bucket=bucket, original=original):
            if not bucket.grad_started:
                launched.append(bucket.index)
                ready_at_launch.append({names[p] for b in ddp.buckets for p in b.ready})
            original(async_op)
        bucket.start_grad_sync = record
    with ddp.no_sync():
        _loss(ddp).backward()
    assert launched == []
    _loss(ddp, 1).backward()
    assert len(launched) == len(ddp.buckets) > 2 and launched == sorted(launched)
    for index, ready in zip(launched, ready_at_launch):
        expected = {names[p] for b in ddp.buckets[:index + 1] for p in b.params}
        assert ready == expected, f"bucket {index} launched with {sorted(ready ^ expected)} differing from " \
                                  "buckets 0..i being exactly the ready ones"
    assert "embedding.word_embeddings.weight" not in ready_at_launch[-2]
    finalize_model_grads([ddp], SINGLE)
    assert all(not b.grad_started and not b.ready for b in ddp.buckets)


def test_second_synchronising_backward_is_refused():
    ddp = DistributedDataParallel(_model(), SINGLE, overlap_grad_reduce=True)
    _loss(ddp).backward()
    with pytest.raises(RuntimeError, match="ready twice.*no_sync"):
        _loss(ddp).backward()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--ddp-bucket-size"):
        DistributedDataParallel(_model(), SINGLE, bucket_size=0)
    ddp = DistributedDataParallel(_model(params_dtype="bfloat16"), SINGLE)
    with pytest.raises(ValueError, match="bfloat16"):
        build_optimizer([ddp], SINGLE, lr=1e-3)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        build_optimizer([ddp], SINGLE, lr=1e-3, bf16=True, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="contradict"):
        build_optimizer([ddp], SINGLE, lr=1e-3, bf16=True, fp16=True)
    with pytest.raises(ValueError, match="--overlap-param-gather"):
        build_optimizer([ddp], SINGLE, lr=1e-3, bf16=True, overlap_param_gather=True)
    with pytest.raises(TypeError, match="neither"):
        build_optimizer([_model()], SINGLE, lr=1e-3)
