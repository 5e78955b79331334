"""megalite: Megatron-style GPT pretraining in plain PyTorch."""

__version__ = "0.1.0"
