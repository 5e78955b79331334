"""A pipeline rank's GPT model chunks and their forward step for the pipeline executor: local
chunk c of pipeline rank r is global virtual stage c*p + r and holds the layers stage_layout
assigns it, under their global numbers.

The embedding lives only on virtual stage 0 (rank 0, chunk 0), the final norm and output layer
only on the last (rank p-1, chunk v-1). With tied embeddings and p > 1 the last stage holds its
own copy of the word embedding as output_layer.weight: GPTModel initialises it from the same
draw as the first stage's embedding and marks both `shared_embedding`, and
finalize_model_grads all-reduces their gradients over the embedding group, so the two copies
receive identical updates and stay equal.
"""

import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.offload import share_offload_plan
from megalite.parallel.context.loss import cp_masked_mean
from megalite.parallel.pipeline.executor import unwrap
from megalite.parallel.pipeline.stage_layout import layers_per_virtual_stage, stage_layers
from megalite.parallel.state import ParallelState


def build_model_chunks(config: GPTConfig, pstate: ParallelState, *,
                       num_layers_first: int | None = None, num_layers_last: int | None = None,
                       rng_tracker=None, init_seed: int = 1234, device=None,
                       init_on_shard: bool = False, embedding_stage: bool = False,
                       loss_stage: bool = False, layout_counts: list[int] | None = None) -> list[GPTModel]:
    """This rank's pstate.vp_size model chunks, chunk c holding
    stage_layers(num_layers, p, rank, c, v, num_layers_first, num_layers_last).

    `num_layers_first` / `num_layers_last` are --decoder-first-pipeline-num-layers and
    --decoder-last-pipeline-num-layers; `embedding_stage` / `loss_stage` the
    --account-for-*-in-pipeline-split split with virtual stages (stage_layout); `layout_counts` the
    decoder layers per virtual stage of a --pipeline-model-parallel-layout. Raises ValueError naming the flags when the layers
    cannot be split as asked. Every layout starts from the same full model for a given
    `init_seed` (weights are drawn per parameter name; with `init_on_shard`, per parameter
    name and TP rank). `device` "meta" defers initialisation (model.meta_init.materialize_)."""
    p, v, rank = pstate.pp_size, pstate.vp_size, pstate.pp_rank
    accounting = {"embedding_stage": embedding_stage, "loss_stage": loss_stage, "layout_counts": layout_counts}
    layers_per_virtual_stage(config.num_layers, p, v, num_layers_first, num_layers_last, **accounting)
    models = [GPTModel(config, pstate, rng_tracker=rng_tracker,
                       layer_numbers=stage_layers(config.num_layers, p, rank, c, v,
                                                  num_layers_first, num_layers_last, **accounting),
                       pre_process=(rank == 0 and c == 0),
                       post_process=(rank == p - 1 and c == v - 1),
                       init_seed=init_seed, device=device, init_on_shard=init_on_shard)
              for c in range(v)]
    share_offload_plan(models)  # --fine-grained-activation-offloading's policy spans the rank's chunks
    return models


def gpt_forward_step(chunk, batch: dict | None, hidden_states: torch.Tensor | None) -> torch.Tensor:
    """Forward of a GPTModel chunk: hidden states [s(/t), b, h], or on the chunk holding the
    output layer the micro-batch loss sum(loss * loss_mask) / sum(loss_mask).

    `batch` (tokens, labels, loss_mask, position_ids, attention_mask) is None on ranks without
    data; their chunks then run with attention_mask None, i.e. causal."""
    model = unwrap(chunk)
    batch = batch or {}
    for needed, key in ((model.needs_tokens, "tokens"), (model.post_process, "labels")):
        if needed and batch.get(key) is None:
            raise ValueError(f"micro-batch has no {key!r}, which the chunk holding the "
                             f"{'embedding (or multi-token prediction)' if key == 'tokens' else 'output layer'} needs")
    out = chunk(tokens=batch.get("tokens") if model.needs_tokens else None,
                position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask"),
                labels=batch.get("labels") if model.post_process else None,
                hidden_states=hidden_states, loss_mask=batch.get("loss_mask") if model.mtp is not None else None)
    if not model.post_process:
        return out
    if model.pstate.cp_size > 1:
        return cp_masked_mean(out, batch.get("loss_mask"), model.pstate.cp_group)
    return masked_mean_loss(out, batch.get("loss_mask"))
