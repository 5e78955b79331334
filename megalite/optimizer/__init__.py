"""The optimizer, beside model/ and training/ as in Megatron-Core: fp32 main parameters behind
16-bit model parameters, Adam or SGD with weight-decay groups and global-norm clipping
(mixed_precision.py, build_optimizer), the distributed optimizer's shards over the data-parallel
gradient buckets and FSDP2's shards (distributed.py), its checkpoint form of per-rank shards
(sharded_state.py), fp16 loss scaling (loss_scaler.py), and the per-rank memory report against
formulas.md (memory_report.py).

Imports megalite.parallel (state, comm, data) only; never megalite.model or megalite.training.
"""
