"""Tensor parallelism (with Megatron's sequence parallelism): column- and row-parallel linears
and the vocab-parallel embedding (layers.py), and the vocab-parallel cross-entropy
(cross_entropy.py).

Imports megalite.parallel's shared modules (comm, sharding) and megalite.kernels only.
"""
