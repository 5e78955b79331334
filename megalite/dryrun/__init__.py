"""Dry runs: one real training iteration of chosen ranks of any layout on fake tensors (a fake
CUDA device, the fake process group) in one process, measuring memory by category and bytes
moved per process group (`python -m megalite.pretrain_gpt --dry-run ...`)."""
