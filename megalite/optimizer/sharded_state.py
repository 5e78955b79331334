"""The optimizer's sharded checkpoint form: each rank hands over only the elements it owns
(a 1/d slice under the distributed optimizer or FSDP2, within its distributed-optimizer
instance) as FlatShards saying where every rank's elements lie, with no communication; and
loads the same form laid out for this rank. A mixin of MixedPrecisionOptimizer (mixed_precision.py),
whose `_named_params`, `_values`, `_header`, `_start_load`, `_saved_entries`, `_set_state` and
`_finish_load` it uses.
"""

import torch

from megalite.optimizer.distributed import FlatShard, bucket_dp_ranges, dtensor_dp_ranges, rank_layout
from megalite.parallel.data.fsdp import FSDPChunk


class ShardedOptimizerState:
    """sharded_state_dict / empty_sharded_state / load_sharded_state_dict (see the module)."""

    def _layout(self, chunk, param, entry) -> tuple[int, int, list | None]:
        """(lo, hi) of the elements of flattened `param` this rank holds, and every DP x CP rank's."""
        ranges = dtensor_dp_ranges(entry.main) if isinstance(chunk, FSDPChunk) else bucket_dp_ranges(chunk, param)
        return rank_layout(ranges, self.pstate, param, param.numel())

    def sharded_state_dict(self) -> dict:
        """`state_dict` without gathering: per parameter name and key a FlatShard holding a CPU
        fp32 copy of only the elements this rank owns (a 1/d slice under the distributed
        optimizer or FSDP2) and where every DP x CP rank's elements lie, for checkpoints written
        shard by shard."""
        self.finish_param_sync()
        params = {}
        for chunk, name, param, entry in self._named_params():
            lo, hi, ranges = self._layout(chunk, param, entry)
            params[name] = {}
            for key, value in self._values(entry).items():
                if value is None:
                    flat = torch.zeros(0)
                else:
                    local = value.to_local() if hasattr(value, "to_local") else value
                    flat = local.detach().reshape(-1).to("cpu", torch.float32, copy=True)
                params[name][key] = FlatShard(flat, lo, hi, param.shape, ranges)
        return self._header(params)

    def empty_sharded_state(self, keys) -> dict:
        """Per parameter name and key in `keys`, a zero FlatShard laid out as `sharded_state_dict`
        lays out this rank's elements: the buffers a checkpoint load fills."""
        params = {}
        for chunk, name, param, entry in self._named_params():
            lo, hi, ranges = self._layout(chunk, param, entry)
            params[name] = {k: FlatShard(torch.zeros(hi - lo), lo, hi, param.shape, ranges) for k in keys}
        return params

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Load the form `sharded_state_dict` returns, laid out for this rank (see
        `empty_sharded_state`)."""
        keys = self._start_load(state)
        for chunk, name, param, entry, saved in self._saved_entries(state, keys):
            lo, hi, _ = self._layout(chunk, param, entry)
            for key in keys:
                shard = saved[key]
                mine = (tuple(shard.shape), shard.lo, shard.hi, shard.values.numel())
                if mine != (tuple(param.shape), lo, hi, hi - lo):
                    raise ValueError(f"optimizer state {name}.{key}: elements [{shard.lo}, {shard.hi}) of shape "
                                     f"{tuple(shard.shape)}, this rank holds [{lo}, {hi}) of {tuple(param.shape)}")
            if entry is None:
                continue
            local = {}
            for key in keys:
                target = torch.zeros_like(entry.main) if key != "param" else entry.main
                on_rank = target.to_local() if hasattr(target, "to_local") else target
                on_rank.copy_(saved[key].values.view(on_rank.shape))
                local[key] = target
            local.pop("param")
            self._set_state(entry.main, local)
        self._finish_load(state)
