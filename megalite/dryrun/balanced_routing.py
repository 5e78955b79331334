"""MoE token counts in a dry run: the balanced-routing assumption.

Which expert a token goes to depends on the router's values, and a fake tensor has none, so
the number of rows each expert receives (and so every shape after the router) is unknown. A
dry run therefore assumes balanced routing: each of a rank's T tokens picks k experts and
every expert receives T*k/E rows from every rank (the remainder, when E does not divide T*k,
one more row to each of the first experts). Every rank of an ETP x EP block holds the same T, so
the counts each rank receives equal the counts it sends. The dispatchers below make the same
collectives as the real ones (megalite.parallel.expert.dispatch), with these counts in place
of the router's; a real run moves more or less as its routing is skewed.
"""

import torch

from megalite.parallel import comm
from megalite.parallel.expert.collectives import gather_rows, row_counts
from megalite.parallel.expert.dispatch import AllGatherDispatcher, AllToAllDispatcher

ASSUMPTION = ("MoE token counts: balanced routing assumed (every expert receives T*k/E rows of each rank's T "
              "tokens); a real run's counts follow its router")


def balanced_counts(rows: int, num_experts: int) -> list[int]:
    """`rows` (token, expert) pairs spread over `num_experts` experts as evenly as possible."""
    return [rows // num_experts + (e < rows % num_experts) for e in range(num_experts)]


def _balanced_permute(tokens, probs, topk: int, num_experts: int):
    """Rows grouped by expert as `permute` gives them, their probabilities and the per-expert
    counts, for balanced routing (which token a row copies does not matter to a fake tensor)."""
    n = tokens.shape[0] * topk
    token_ids = torch.arange(n, device=tokens.device) % tokens.shape[0]
    flat = torch.arange(n, device=tokens.device) * num_experts // n * tokens.shape[0] + token_ids
    row_probs = probs.t().reshape(-1).index_select(0, flat)
    return tokens.index_select(0, token_ids), token_ids, row_probs, balanced_counts(n, num_experts)


class BalancedAllToAll(AllToAllDispatcher):
    def __init__(self, real: AllToAllDispatcher, topk: int):
        self.__dict__.update(real.__dict__)
        self.topk = topk

    def dispatch(self, tokens, probs, routing_map):
        self.num_tokens = tokens.shape[0]
        rows, self.token_ids, self.row_probs, counts = _balanced_permute(tokens, probs, self.topk, self.num_experts)
        return self.send_rows(rows, counts)

    def exchange_counts(self, counts, device):
        self.count_collectives(counts, device)  # its bytes
        mine = counts[self.local_start:self.local_start + self.num_local]
        return [[mine] * self.ep_size] * self.etp_size  # every rank sends this rank's experts the same


class BalancedAllGather(AllGatherDispatcher):
    def __init__(self, real: AllGatherDispatcher, topk: int):
        self.__dict__.update(real.__dict__)
        self.topk = topk

    def dispatch(self, tokens, probs, routing_map):
        group = self.etp_ep_group
        row_counts(tokens.shape[0], group, tokens.device)  # its bytes; every rank holds the same T
        self.sizes = [tokens.shape[0]] * comm.group_size(group)
        tokens = gather_rows(tokens, self.sizes, group)
        probs = gather_rows(probs, self.sizes, group)
        gather_rows(routing_map.to(torch.uint8), self.sizes, group)
        self.num_tokens = tokens.shape[0]
        rows, self.token_ids, row_probs, counts = _balanced_permute(tokens, probs, self.topk, self.num_experts)
        local = slice(self.local_start, self.local_start + self.num_local)
        start, count = sum(counts[:local.start]), sum(counts[local])
        rows, self.token_ids = rows[start:start + count], self.token_ids[start:start + count]
        self.row_probs = row_probs[start:start + count]
        return rows, counts[local]


def assume_balanced_routing(models) -> int:
    """Give every MoE layer of `models` a balanced-routing dispatcher; returns how many."""
    from megalite.model.moe import moe_layers

    layers = moe_layers(models)
    for layer in layers:
        kind = BalancedAllToAll if isinstance(layer.dispatcher, AllToAllDispatcher) else BalancedAllGather
        layer.dispatcher = kind(layer.dispatcher, layer.moe.router_topk)
    return len(layers)


def alltoall_formula_bytes(micro_batches: int, moe_layers_held: int, tokens: int, topk: int, ep: int,
                           hidden: int, element_size: int) -> int:
    """tools/benchmarks/bench_moe.py's formula: tokens each rank sends to other EP ranks per
    step, dispatch and combine, forward and backward: 4 * m * L_moe * T * k * (EP-1)/EP * h * B."""
    return 4 * micro_batches * moe_layers_held * tokens * topk * (ep - 1) * hidden * element_size // ep
