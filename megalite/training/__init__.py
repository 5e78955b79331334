"""Training: the loop, the step, metrics and logging, FLOP/MFU accounting, the learning-rate
schedule. Options come from megalite.config, checkpoints from megalite.checkpoint."""
