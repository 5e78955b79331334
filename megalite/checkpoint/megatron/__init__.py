"""Megatron-LM's checkpoints, read: torch (model_optim_rng.pt per rank) and torch_dist (DCP)
model weights (reader, names, names_mla, names_moe, names_gdn), the stored arguments turned into a
GPTConfig (args), the optimizer and distributed-optimizer state (optimizer, buckets, dp_reshardable)
and a run's resume (resume).
Every pickle goes through an allowlist (safe_pickle); nothing here runs code from a file."""
