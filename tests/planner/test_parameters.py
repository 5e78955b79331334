"""Parameters per rank as the planner counts them equal those of the models megalite builds
(on the meta device, each rank's groups from the fake process group), for GPT-2 and Llama
(GQA, SwiGLU, qk-norm, untied output) and an MoE model with shared experts, over TP, PP,
virtual stages and EP."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megalite.model.pipeline_chunks import build_model_chunks
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.planner.parameters import rank_parameters
from tests.planner.models import GPT, LLAMA, MOE


def built(config, t, p, v, pp_rank, ep):
    world = t * p * ep
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        layout = ParallelLayout(world, tensor=t, pipeline=p, virtual_pipeline=v)
        pstate = ParallelState.create(layout)
        pstate.pp_rank = pp_rank  # rank 0's groups serve every stage: only shapes are counted
        if config.moe is not None:
            pstate.expert = ExpertState.create(pstate, ep, config.moe.num_experts)
        chunks = build_model_chunks(config, pstate, device="meta")
        params = [q for chunk in chunks for q in chunk.parameters()]
        expert = sum(q.numel() for q in params if getattr(q, "expert_parallel", False))
        return sum(q.numel() for q in params) - expert, expert
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, config, ep", [("gpt", GPT, 1), ("llama", LLAMA, 1), ("moe", MOE, 2)])
@pytest.mark.parametrize("t, p, v", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)])
def test_counts_equal_the_built_model(name, config, ep, t, p, v):
    for rank in range(p):
        assert rank_parameters(config, t, p, v, rank, ep) == built(config, t, p, v, rank, ep), (name, rank)


def test_gated_delta_net_hybrid_counts_equal_the_built_model():
    """Linear layers (in_proj, conv1d, A_log, dt_bias, out_proj split by heads; out_norm whole)
    beside gated full attention, at TP2 and TP2 PP2."""
    from megalite.model.gdn_config import GDNConfig
    config = LLAMA.replace(attention_output_gate=True, gdn=GDNConfig(
        linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4))
    for t, p in ((1, 1), (2, 1), (2, 2)):
        for rank in range(p):
            assert rank_parameters(config, t, p, 1, rank) == built(config, t, p, 1, rank, 1), (t, p, rank)
