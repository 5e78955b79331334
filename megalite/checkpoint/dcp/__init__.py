"""megalite's own checkpoint format, torch.distributed.checkpoint (DCP) files: a training run's
save and resharding load (checkpoint), the safe metadata reader (format), the files on disk
(storage), offline single-tensor writers (writer) and target layouts (target_layout), each rank's
RNG states (rng_state) and SHA-256 manifests (integrity). Imports no other format."""
