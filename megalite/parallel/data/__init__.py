"""Data parallelism: contiguous gradient buffers split into buckets and their overlapped
all-reduce / reduce-scatter (grad_buffer.py; with several distributed-optimizer instances,
within an instance, then across), the DistributedDataParallel wrapper and
finalize_model_grads (ddp.py), and ZeRO-2/3 through PyTorch's FSDP2 (fsdp.py).

Imports megalite.parallel's shared modules, and megalite.parallel.tensor.deferred_wgrad (the
deferred weight gradients DistributedDataParallel computes before it reduces); the optimizer
that shards its state over these buffers is megalite.optimizer.
"""
