"""Token dispatchers: send each (token, expert) pair to the EP rank holding that expert and bring
the expert outputs back, weighted by the routing probabilities and summed per token.

Experts are split over the EP group in order: rank r holds experts [r * E/ep, (r+1) * E/ep).
`dispatch(tokens [T, h], probs [T, E], routing_map bool [T, E])` returns this rank's expert
input, rows grouped by local expert (in expert order, each group's rows in source-rank then
token order), and the row count of each local expert; `combine(expert_output)` returns [T, h].
Token counts may differ per expert and per rank. Both are differentiable end to end.

- alltoall (`AllToAllDispatcher`): each rank sends exactly the rows its tokens route to the
  other ranks' experts (one all-to-all of counts, one of rows; the same back) and applies the
  probabilities on its own side.
- allgather (`AllGatherDispatcher`): every rank gathers all tokens of the EP group, runs its
  experts on those routed to them, and a reduce-scatter returns the weighted sums.
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.expert.collectives import all_to_all, gather_rows, reduce_scatter_rows, row_counts


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """Rows of `tokens` grouped by expert (columns of `routing_map`, in order; tokens in order
    within an expert), the token index of each row, and the rows per expert."""
    _, token_ids = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, token_ids), token_ids, routing_map.sum(0)


def unpermute(rows: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, num_tokens: int):
    """Sum of rows * weights per token: the inverse of `permute`, weighted."""
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, token_ids, rows * weights.to(rows.dtype).unsqueeze(-1))


def routed_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """probs[token, expert] of every routed pair, in `permute`'s row order."""
    return probs.t()[routing_map.t()]


class _Dispatcher:
    def __init__(self, num_experts: int, ep_group=None):
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = comm.group_size(ep_group), comm.group_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"--num-experts {num_experts} is not divisible by the EP size {self.ep_size}")
        self.num_experts, self.num_local = num_experts, num_experts // self.ep_size
        self.local_start = self.ep_rank * self.num_local
        self.traffic = [0]
        """Bytes of tokens this rank has sent to other ranks by all-to-all, forward and backward."""


class AllToAllDispatcher(_Dispatcher):
    def dispatch(self, tokens, probs, routing_map):
        ep, local = self.ep_size, self.num_local
        self.num_tokens = tokens.shape[0]
        rows, self.token_ids, counts = permute(tokens, routing_map)
        self.row_probs = routed_probs(probs, routing_map)
        if ep == 1:
            return rows, counts.tolist()
        counts = counts.view(ep, local)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.ep_group)
        self.input_splits = counts.sum(1).tolist()
        self.output_splits = received.sum(1).tolist()
        self.received = received.tolist()  # [source rank][local expert]
        x = all_to_all(rows, self.output_splits, self.input_splits, self.ep_group, self.traffic)
        by_source = x.split([n for per_rank in self.received for n in per_rank])
        x = torch.cat([by_source[r * local + e] for e in range(local) for r in range(ep)])
        return x, received.sum(0).tolist()

    def combine(self, expert_output):
        ep, local = self.ep_size, self.num_local
        if ep > 1:
            by_expert = expert_output.split([self.received[r][e] for e in range(local) for r in range(ep)])
            y = torch.cat([by_expert[e * ep + r] for r in range(ep) for e in range(local)])
            expert_output = all_to_all(y, self.input_splits, self.output_splits, self.ep_group, self.traffic)
        return unpermute(expert_output, self.token_ids, self.row_probs, self.num_tokens)


class AllGatherDispatcher(_Dispatcher):
    def dispatch(self, tokens, probs, routing_map):
        self.sizes = row_counts(tokens.shape[0], self.ep_group, tokens.device)
        tokens = gather_rows(tokens, self.sizes, self.ep_group)
        probs = gather_rows(probs, self.sizes, self.ep_group)
        routing_map = gather_rows(routing_map.to(torch.uint8), self.sizes, self.ep_group).bool()
        local = slice(self.local_start, self.local_start + self.num_local)
        rows, self.token_ids, counts = permute(tokens, routing_map[:, local])
        self.row_probs = routed_probs(probs[:, local], routing_map[:, local])
        self.num_tokens = tokens.shape[0]
        return rows, counts.tolist()

    def combine(self, expert_output):
        out = unpermute(expert_output, self.token_ids, self.row_probs, self.num_tokens)
        return reduce_scatter_rows(out, self.sizes, self.ep_group)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def build_dispatcher(kind: str, num_experts: int, ep_group=None):
    if kind not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {kind!r} is not one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[kind](num_experts, ep_group)
