"""Expert parallelism: expert-parallel and expert-data-parallel groups carved from the
data-parallel ranks (groups.py), token dispatchers that move each token to the ranks holding
its experts and back with variable token counts per rank (dispatch.py, over the collectives in
collectives.py), and the grouped matmul the experts run (grouped_gemm.py).

Imports megalite.parallel's shared modules (state, comm) and torch only.
"""
