"""Token dispatchers: send each (token, expert) pair to the EP rank holding that expert and bring
the expert outputs back, weighted by the routing probabilities and summed per token.

Experts are split over the EP group in order: rank r holds experts [r * E/ep, (r+1) * E/ep),
each expert's weights split over the ETP group (see groups.py); every rank of an ETP x EP block
brings its own tokens. `dispatch(tokens [T, h], probs [T, E], routing_map bool [T, E])` returns
this rank's expert input, rows grouped by local expert (in expert order), and the row count of
each local expert; `combine(expert_output)` takes the experts' outputs on those rows (partial
sums over the ETP ranks' weight shards) and returns [T, h]. Token counts may differ per expert
and per rank. Both are differentiable end to end.

- alltoall (`AllToAllDispatcher`): each rank sends exactly the rows its tokens route to the
  other EP ranks' experts (one all-to-all of counts, one of rows; the same back), an all-gather
  over ETP completes each expert's input, and the probabilities apply on the sender's side.
- allgather (`AllGatherDispatcher`): every rank gathers all tokens of its ETP x EP block, runs
  its experts on those routed to them, and a reduce-scatter returns the weighted sums.
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
    def __init__(self, num_experts: int, expert_state=None):
        """`expert_state`: an ExpertState (megalite.parallel.expert.groups); None for one rank."""
        groups = dict(ep=None, etp=None, etp_ep=None) if expert_state is None else dict(
            ep=expert_state.ep_group, etp=expert_state.etp_group, etp_ep=expert_state.etp_ep_group)
        self.ep_group, self.etp_group, self.etp_ep_group = groups["ep"], groups["etp"], groups["etp_ep"]
        self.ep_size, self.ep_rank = comm.group_size(self.ep_group), comm.group_rank(self.ep_group)
        self.etp_size = comm.group_size(self.etp_group)
        if num_experts % self.ep_size:
            raise ValueError(f"--num-experts {num_experts} is not divisible by the EP size {self.ep_size}")
        self.num_experts, self.num_local = num_experts, num_experts // self.ep_size
        self.local_start = self.ep_rank * self.num_local
        self.traffic = [0]
        """Bytes of tokens this rank has sent to other ranks by all-to-all, forward and backward."""


class AllToAllDispatcher(_Dispatcher):
    """Megatron's MoEAlltoAllTokenDispatcher: an all-to-all over EP sends each rank's rows to
    the EP rank holding their expert, an all-gather over ETP gives every ETP rank of that
    expert all of them (the experts' weights are split over ETP); the way back is a
    reduce-scatter over ETP (summing the ETP ranks' partial outputs) and the reverse all-to-all."""

    def dispatch(self, tokens, probs, routing_map):
        self.num_tokens = tokens.shape[0]
        rows, self.token_ids, counts = permute(tokens, routing_map)
        self.row_probs = routed_probs(probs, routing_map)
        return self.send_rows(rows, counts.tolist())

    def count_collectives(self, counts: list[int], device) -> torch.Tensor:
        """[ETP rank q, EP rank r, local expert e]: rows for local expert e that EP rank r sent
        ETP rank q of this rank's block, from every rank's per-expert `counts` (collectives
        over EP and ETP)."""
        sent = torch.tensor(counts, dtype=torch.long, device=device).view(self.ep_size, self.num_local)
        received = sent
        if self.ep_size > 1:
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=self.ep_group)
        return comm.all_gather_dim0(received.unsqueeze(0), self.etp_group)

    def exchange_counts(self, counts: list[int], device) -> list:
        """count_collectives as nested lists table[q][r][e]."""
        return self.count_collectives(counts, device).tolist()

    def send_rows(self, rows, counts: list[int]):
        """This rank's expert input, rows grouped by local expert (each expert's rows in ETP
        rank, EP rank, token order), and the rows per local expert."""
        ep, local = self.ep_size, self.num_local
        if ep * self.etp_size == 1:
            self.table = [[counts]]
            return rows, counts
        self.table = self.exchange_counts(counts, rows.device)
        self.input_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
        self.output_splits = [sum(per_expert) for per_expert in self.table[comm.group_rank(self.etp_group)]]
        x = all_to_all(rows, self.output_splits, self.input_splits, self.ep_group, self.traffic)
        x = gather_rows(x, [sum(map(sum, per_source)) for per_source in self.table], self.etp_group)
        x = torch.cat(self._reorder(x.split(self._chunk_sizes("source")), "source"))
        return x, [sum(self.table[q][r][e] for q in range(self.etp_size) for r in range(ep)) for e in range(local)]

    def _order(self, major: str):
        ranges = {"q": range(self.etp_size), "r": range(self.ep_size), "e": range(self.num_local)}
        names = "qre" if major == "source" else "eqr"
        out = [{}]
        for name in names:
            out = [{**c, name: i} for c in out for i in ranges[name]]
        return [(c["q"], c["r"], c["e"]) for c in out]

    def _chunk_sizes(self, major: str) -> list[int]:
        return [self.table[q][r][e] for q, r, e in self._order(major)]

    def _reorder(self, chunks, major: str):
        """Chunks in `major` order ('source': ETP rank, EP rank, expert; 'expert': expert, ETP
        rank, EP rank) rearranged into the other order."""
        index = {key: i for i, key in enumerate(self._order(major))}
        other = "expert" if major == "source" else "source"
        return [chunks[index[key]] for key in self._order(other)]

    def combine(self, expert_output):
        if self.ep_size * self.etp_size > 1:
            y = torch.cat(self._reorder(expert_output.split(self._chunk_sizes("expert")), "expert"))
            y = reduce_scatter_rows(y, [sum(map(sum, per_source)) for per_source in self.table], self.etp_group)
            expert_output = all_to_all(y, self.input_splits, self.output_splits, self.ep_group, self.traffic)
        return unpermute(expert_output, self.token_ids, self.row_probs, self.num_tokens)


class AllGatherDispatcher(_Dispatcher):
    """Megatron's MoEAllGatherTokenDispatcher: every rank gathers all tokens of its ETP x EP
    block, runs its experts (its ETP share of their weights) on those routed to them, and a
    reduce-scatter over the block returns the weighted sums (adding the ETP partial sums)."""

    def dispatch(self, tokens, probs, routing_map):
        group = self.etp_ep_group
        self.sizes = row_counts(tokens.shape[0], group, tokens.device)
        tokens = gather_rows(tokens, self.sizes, group)
        probs = gather_rows(probs, self.sizes, group)
        routing_map = gather_rows(routing_map.to(torch.uint8), self.sizes, group).bool()
        local = slice(self.local_start, self.local_start + self.num_local)
        rows, self.token_ids, counts = permute(tokens, routing_map[:, local])
        self.row_probs = routed_probs(probs[:, local], routing_map[:, local])
        self.num_tokens = tokens.shape[0]
        return rows, counts.tolist()

    def combine(self, expert_output):
        out = unpermute(expert_output, self.token_ids, self.row_probs, self.num_tokens)
        return reduce_scatter_rows(out, self.sizes, self.etp_ep_group)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def build_dispatcher(kind: str, num_experts: int, expert_state=None):
    if kind not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {kind!r} is not one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[kind](num_experts, expert_state)
