"""Train a tiny DeepSeek-V3-shaped GPT (multi-latent attention with YaRN and latent norms,
sigmoid group-limited MoE with expert bias, the sequence auxiliary loss and a shared expert after
one dense layer, two multi-token prediction depths) for STEPS Adam steps at any TP / SP / PP
(interleaved too) / CP / DP / EP layout, and return what the layout tests compare with the
single-process run: per-step losses and logged MTP and auxiliary losses, the first step's full
gradients, the final full parameters and expert biases, and eval logits."""

import torch

from megalite.model.config import GPTConfig
from megalite.model.moe import reduce_logged_losses, update_expert_bias
from megalite.model.moe_config import MoEConfig
from megalite.model.mtp import reduce_mtp_losses
from megalite.model.offload import end_offload_step
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.training.per_token_loss import PerTokenLoss
from tests.numerics import rel_error
from tests.parallel.expert.ep_harness import HIDDEN, OPTIM, SEQ, VOCAB, compare, eval_logits, full_state, rank_batches
from tests.parallel.train_step import train_step

STEPS, NUM_LAYERS, MTP_DEPTHS = 6, 4, 2


def mla_config(sequence_parallel=False, **overrides) -> GPTConfig:
    moe = MoEConfig(num_experts=8, ffn_hidden_size=12, router_topk=2, layer_freq=[0, 1, 1, 1],
                    score_function="sigmoid", enable_expert_bias=True, bias_update_rate=1e-2, num_groups=4,
                    group_topk=1, topk_scaling_factor=2.5, router_dtype="fp32", load_balancing_type="seq_aux_loss",
                    aux_loss_coeff=1e-2, shared_expert_intermediate_size=12, token_dispatcher_type="alltoall")
    mla = dict(q_lora_rank=12, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn",
               rotary_scaling_factor=4.0, original_max_position_embeddings=4, mscale=0.8, mscale_all_dim=0.6)
    values = dict(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=SEQ, ffn_hidden_size=24, activation="swiglu", normalization="RMSNorm",
                  position_embedding_type="rope", add_bias_linear=False, qk_layernorm=True,
                  untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
                  sequence_parallel=sequence_parallel, moe=moe, mla=mla, mtp_num_layers=MTP_DEPTHS,
                  mtp_loss_scaling_factor=0.3)
    return GPTConfig(**{**values, **overrides})


def layout_state(tp=1, pp=1, vp=1, cp=1, ep=1, world=None) -> ParallelState:
    world = world or torch.distributed.get_world_size()
    pstate = ParallelState.create(ParallelLayout(world, tensor=tp, pipeline=pp, virtual_pipeline=vp, context=cp))
    pstate.expert = ExpertState.create(pstate, ep, num_experts=8)
    return pstate


def single_state() -> ParallelState:
    pstate = ParallelState.single()
    pstate.expert = ExpertState.single()
    return pstate


def train(pstate: ParallelState, config: GPTConfig, steps: int = STEPS, dist_opt: bool = False,
          per_token: bool = False) -> dict:
    """`dist_opt`: the distributed optimizer (its sharded gradients are not compared);
    `per_token`: --calculate-per-token-loss."""
    models = build_model_chunks(config, pstate, init_seed=5)
    chunks = [DistributedDataParallel(c, pstate, use_distributed_optimizer=dist_opt) for c in models]
    optimizer = build_optimizer(chunks, pstate, use_distributed_optimizer=dist_opt, **OPTIM)
    batches_of = lambda step: rank_batches(step, pstate.dp_rank, pstate.dp_size, pstate.cp_size,  # noqa: E731
                                           pstate.cp_rank)
    m = len(batches_of(0))
    forward_step = PerTokenLoss() if per_token else gpt_forward_step
    executor = None
    if pstate.pp_size > 1:
        executor = PipelineExecutor(chunks, pstate, "interleaved_1f1b" if pstate.vp_size > 1 else "1f1b",
                                    num_microbatches=m, seq_length=SEQ, micro_batch_size=2, hidden_size=HIDDEN,
                                    sequence_parallel=config.sequence_parallel, forward_step=forward_step)
    out = {"losses": [], "mtp": [], "aux": []}
    for step in range(steps):
        optimizer.zero_grad()
        out["losses"].append(train_step(chunks, pstate, batches_of(step), forward_step, executor, per_token))
        end_offload_step(models)  # with offloading, steps 2 and 3 keep groups on the device (offload_plan.py)
        world = pstate.world_group
        out["mtp"].append(reduce_mtp_losses(models, MTP_DEPTHS, world))
        out["aux"].append(reduce_logged_losses(models, NUM_LAYERS + MTP_DEPTHS, world))
        if step == 0 and not dist_opt:
            out["grads"] = full_state(chunks, pstate, grads=True)
        optimizer.step()
        update_expert_bias(models, pstate.dp_cp_group)
    out["params"] = full_state(chunks, pstate)
    out["offloaded_bytes"] = sum(sum(m.offloader.offloaded_bytes.values()) for m in models)  # --offload-modules
    if pstate.pp_size == 1:
        out["logits"] = eval_logits(chunks[0].module.eval(), pstate)
    return out


def reference(config: GPTConfig, **options) -> dict:
    return train(single_state(), config.replace(sequence_parallel=False), **options)


def check(results: list[dict], ref: dict, tol: float = 1e-5, logits_tol: float | None = None) -> list[str]:
    """compare()'s differences (the eval logits' at `logits_tol`, default `tol`), plus the logged
    MTP and auxiliary losses of every step."""
    logits_tol = tol if logits_tol is None else logits_tol
    problems = compare([{k: v for k, v in r.items() if k != "logits"} for r in results], ref, tol)
    problems += [f"logits: rel error {rel_error(r['logits'], ref['logits']):.2e}" for r in results
                 if "logits" in r and rel_error(r["logits"], ref["logits"]) > logits_tol]
    for step, want in enumerate(ref["mtp"]):
        for r in results:
            got = r["mtp"][step]
            if set(got) != set(want) or any(abs(got[k] - want[k]) > tol * abs(want[k]) for k in want):
                problems.append(f"step {step} MTP losses {got} vs {want}")
    for step, want in enumerate(ref["aux"]):
        got = results[0]["aux"][step]
        if set(got) != set(want) or any(abs(got[k] - want[k]) > tol * max(abs(want[k]), 1e-12) for k in want):
            problems.append(f"step {step} auxiliary losses {got} vs {want}")
    return problems
