"""Options for building a model's shards without the full model (meta-device construction).

megalite's own options (Megatron has none of these).
"""

from dataclasses import dataclass

from megalite.training.arguments_field import MEGALITE, arg


@dataclass
class DryRunArgs:
    """Shard initialisation."""

    init_on_shard: bool = arg(
        False, "Draw each tensor-parallel shard directly from (seed, parameter, TP rank) instead of "
        "slicing a full draw: no rank ever holds a full weight tensor, but the shards are then not "
        "slices of the TP=1 initialisation (a TP=2 run starts from different weights than TP=1).",
        origin=MEGALITE)


def check_dry_run_args(args, fail) -> None:
    """Nothing to refuse yet: every value of these options can run."""
