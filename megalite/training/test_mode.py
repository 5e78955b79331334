"""--test-mode: Megatron's real-time consistency test (megatron/core/transformer/attention.py,
Attention.run_realtime_tests): the query and key layernorm weights (--qk-layernorm), which
every data- and tensor-parallel rank holds whole, must be bit-identical across those ranks;
a difference (memory corrupted while loading a checkpoint, a corrupted transfer) stops the run
naming the layer, the parameter and the ranks. Megatron checks in every attention forward;
megalite before every iteration, when the weights are what every forward of the step uses.
"""

import torch
import torch.distributed as dist


def qk_layernorm_parameters(models) -> list[tuple[str, torch.Tensor]]:
    """(name, local tensor) of every q/k layernorm parameter of this rank's chunks, in order."""
    found = []
    for model in models:
        for name, param in model.named_parameters():
            if ".q_layernorm." in f".{name}" or ".k_layernorm." in f".{name}":
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                found.append((name, full.detach()))
    return found


def _compare(params, group, size: int, kind: str, rank_in_group: int, iteration: int) -> None:
    if size == 1 or not params:
        return
    mine = torch.cat([p.reshape(-1).float() for _, p in params])
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    for other, theirs in enumerate(gathered):
        if torch.equal(theirs, mine):
            continue
        offset = 0
        for name, p in params:
            n = p.numel()
            if not torch.equal(theirs[offset:offset + n], mine[offset:offset + n]):
                difference = torch.linalg.vector_norm(theirs[offset:offset + n] - mine[offset:offset + n]).item()
                raise RuntimeError(f"--test-mode: at iteration {iteration} {name} differs between {kind} ranks "
                                   f"{other} and {rank_in_group} (norm of the difference {difference:.3e})")
            offset += n


def check_qk_layernorm_replicas(models, pstate, iteration: int) -> None:
    """Raise naming the layer and ranks when a q/k layernorm weight differs across DP or TP."""
    params = qk_layernorm_parameters(models)
    if pstate.dp_group is not None:
        _compare(params, pstate.dp_group, pstate.dp_size, "data-parallel", pstate.dp_rank, iteration)
    if pstate.tp_group is not None:
        _compare(params, pstate.tp_group, pstate.tp_size, "tensor-parallel", pstate.tp_rank, iteration)
