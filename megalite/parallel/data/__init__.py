"""Data parallelism: contiguous gradient buffers split into buckets and their overlapped
all-reduce / reduce-scatter (grad_buffer.py), the DistributedDataParallel wrapper and
finalize_model_grads (ddp.py), and ZeRO-3 through PyTorch's FSDP2 (fsdp.py).

Imports megalite.parallel's shared modules only; the optimizer that shards its state over
these buffers is megalite.optimizer.
"""
