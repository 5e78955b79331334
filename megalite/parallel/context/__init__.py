"""Context parallelism: each sequence split over the ranks of a CP group.

What lives here: the load-balanced split of a sequence into 2N chunks (rank i holds chunks i
and 2N-1-i, so causal attention costs every rank the same), and causal self-attention across
the CP group in three ways: `p2p` (ring attention, key/value blocks passed around a ring,
partial results merged by their log-sum-exp, the backward pass a ring too), `all_gather`
(keys and values gathered), `a2a` (Ulysses: heads scattered, sequence gathered) and
`a2a+p2p` (hierarchical.py: a2a inside groups of CP ranks, a ring across them); each with
document masks (--reset-attention-mask: each rank's query rows of the whole sequence's mask)
and attention dropout (dropout.py: masks hashed from positions, the same at every CP size).
The block attention is plain torch (blocks.py) or flash_attn's kernels (flash_blocks.py).
channels.py serves layers that need the whole sequence (Gated DeltaNet): an all-to-all to whole
sequences and split channel blocks, and back.

Imports: torch and megalite.parallel's shared modules (comm, state) only; never
megalite.model, megalite.training or megalite.optimizer.
"""

from megalite.parallel.context.attention import CP_COMM_TYPES, context_parallel_attention
from megalite.parallel.context.split import gather_sequence, local_positions, split_sequence

__all__ = ["CP_COMM_TYPES", "context_parallel_attention", "gather_sequence", "local_positions",
           "split_sequence"]
