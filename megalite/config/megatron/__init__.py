"""Option families that exist for Megatron-LM's scripts: its flag names and defaults for
checkpoints (checkpoint), data (data), fill-in-the-middle (fim), logging (logs), model variants
(model) and training (training), each accepted with its meaning or refused by name. megalite's
own option families live one level up."""
