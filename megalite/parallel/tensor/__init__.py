"""Tensor parallelism (with Megatron's sequence parallelism): column- and row-parallel linears
and the vocab-parallel embedding (layers.py), and the vocab-parallel cross-entropy
(cross_entropy.py); the one autograd Function every linear multiplies through, which under
sequence parallelism keeps only its input's shard (linear_function.py); the GEMM strategy and
the weight-gradient sink that accumulates into main_grad with gradient accumulation fusion
(gemm.py); the sequence-parallel all-gather and reduce-scatter overlapped with the GEMM in
chunks or around the TP ring (overlapped_linear.py, chosen per layer by comm_overlap.py:
--tp-comm-overlap), and the output layer's deferred weight gradient (deferred_wgrad.py:
--defer-embedding-wgrad-compute).

Imports megalite.parallel's shared modules (comm, sharding) and megalite.kernels only.
"""
