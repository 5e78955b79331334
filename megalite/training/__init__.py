"""Training: options (arguments*.py), LR schedules, metrics and FLOP/MFU accounting; the
training loop and checkpointing build on these."""
