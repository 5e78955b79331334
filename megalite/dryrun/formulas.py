"""formulas.md applied to one rank of a dry run, to print beside what it measures.

`expected_bytes`: the bytes per parameter of formulas.md's memory table, applied to the elements
each kind of state covers on this rank. The 16-bit weights and the main gradients live in the
DDP buffers, padded so that each bucket splits evenly over the data-parallel ranks (and, with
the distributed optimizer, to 128 elements even at DP = 1); the fp32 main parameters (and fp16's
fp32 gradient copies) are one flat copy of this rank's shard of each bucket, padding included,
so that one copy writes them back; Adam's moments exist only for parameter elements, never for
padding. Plus the 4-byte step count Adam keeps per parameter tensor. Without padding this is
formulas.md's 18 (or 6 + 12/d) bytes per parameter exactly.

`korthikanti_activation_bytes`: Korthikanti et al.'s activation bytes per transformer layer
(formulas.md; megalite.training.flops.activation_bytes_per_layer) for the run's sequence (this
context-parallel rank's share), micro-batch, hidden size, heads, TP size, sequence parallelism
and recompute, without the 5·a·s/h term of the s x s scores: a dry run attends with flash or memory-efficient attention as an sm80+ GPU would (the explicit
math backends, --attention-backend unfused/local, store the scores and keep the term), with
multi-latent attention's terms (megalite/dryrun/README.md, "FLOPs and memory of MLA and MTP"),
Gated DeltaNet layers by their own (megalite.training.flops.gdn_activation_bytes_per_layer),
summed over the layers of each chunk. Times the micro-batches this rank holds in flight at the
worst moment of its pipeline schedule (the last stage's last chunk counting each MTP depth as a
layer plus its own inputs): each forward of a chunk adds the chunk's layers, each backward frees
them (1F1B: p - r micro-batches on stage r; interleaved 1F1B: formulas.md's 1 + (p-1)/(p·v) on
stage 0). The formula is for 16-bit
activations and counts transformer layers only: the embedding, the final norm and the logits of
the last stage are not in it.
"""

from megalite.model.attention_backends import EXPLICIT_BACKENDS
from megalite.parallel.pipeline.actions import B, F, W
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.tensor.fp8_scaling import delayed_state_bytes
from megalite.training.flops import activation_bytes_of_layer, mtp_activation_bytes


def expected_bytes(args, buffers: list, optimizer, models=(), fsdp_shard_elements: int = 0,
                   fp8_delayed_linears: int = 0) -> dict:
    """formulas.md's bytes for this rank's DDP gradient `buffers` (see the module docstring),
    the parameters' with the `models`' buffers (the MoE routers' expert biases and token counts,
    fp32 per expert) and the delayed-scaling state of `fp8_delayed_linears` FP8 linears (fp32
    amax history [--fp8-amax-history-len, 3] and scales [3] each), which the held parameters
    include. Under FSDP2 (`fsdp_shard_elements`: the rank's parameter shards, padded as
    allocated) ZeRO-3's fp32 weights, gradients and Adam's moments: 4 + 4 + 8 bytes per element."""
    weight = 2 if args.bf16 or args.fp16 else 4
    grad = 2 if args.fp16 and not args.accumulate_allreduce_grads_in_fp32 else 4
    main = 4 if weight == 2 else 0  # fp32 main parameters beside 16-bit weights
    copies = main + (4 if grad == 2 else 0)  # fp16 gradients: an fp32 copy to step with
    moments = 8 if args.optimizer == "adam" else 4 if args.sgd_momentum else 0
    elements = shard = params = 0
    for buffer in buffers:
        elements += buffer.grad_data.numel()
        for bucket in buffer.buckets:
            s0, s1 = bucket.shard_start, bucket.shard_end
            shard += s1 - s0
            params += sum(max(0, min(end, s1) - max(start, s0)) for start, end in bucket.param_ranges.values())
    steps = 4 * sum(len(g["params"]) for g in optimizer.inner.param_groups) if args.optimizer == "adam" else 0
    if args.optimizer == "muon":  # per tensor: Muon's momentum or the scalar optimizer's states
        moments, steps = 0, muon_state_bytes(args, optimizer)
    model_buffers = sum(b.numel() * b.element_size() for m in models for b in m.buffers())
    model_buffers += fp8_delayed_linears * delayed_state_bytes(args.fp8_amax_history_len or 1)
    if fsdp_shard_elements:
        return {"parameters": 4 * fsdp_shard_elements + model_buffers, "gradients": 4 * fsdp_shard_elements,
                "optimizer": moments * fsdp_shard_elements + steps}
    return {"parameters": weight * elements + model_buffers, "gradients": grad * elements,
            "optimizer": copies * shard + moments * params + steps}


def muon_state_bytes(args, optimizer) -> int:
    """Under --optimizer muon: a 4-byte momentum per element of each Muon weight's main shard;
    the scalar optimizer's (--muon-scalar-optimizer) states for the rest, as Megatron splits them:
    Adam's two moments and its 4-byte step per tensor, or Lion's one moment."""
    scalar = 8 if args.muon_scalar_optimizer == "adam" else 4
    total = 0
    for entry in optimizer.mains:
        main = entry.main.to_local() if hasattr(entry.main, "to_local") else entry.main
        muon = optimizer.is_muon(entry.main)
        total += (4 if muon else scalar) * main.numel() + (4 if not muon and scalar == 8 else 0)
    return total


def layers_in_flight(schedule: str, pipeline_size: int, pp_rank: int, num_microbatches: int,
                     chunk_layers: list) -> float:
    """The most (layer, micro-batch) activations pipeline rank `pp_rank` holds at once: chunk c
    has chunk_layers[c] layers (or, given bytes per chunk, the most bytes). A split backward
    frees them at its weight-gradient half (W)."""
    actions = schedule_actions(schedule, pipeline_size, pp_rank, num_microbatches, len(chunk_layers))
    split = {(a.chunk, a.microbatch) for a in actions if a.kind == W}
    held = most = 0
    for action in actions:
        if action.kind == F:
            held += chunk_layers[action.chunk]
            most = max(most, held)
        elif action.kind == W or (action.kind == B and (action.chunk, action.microbatch) not in split):
            held -= chunk_layers[action.chunk]
    return most


def korthikanti_activation_bytes(args, config, tp_size: int, cp_size: int, pp_rank: int,
                                 chunk_layers: list) -> int | None:
    """formulas.md's activation bytes for this rank, whose chunk c holds the global layers
    chunk_layers[c] (None for fp32 activations: the formula counts 16-bit ones; None for
    --recompute-modules other than core_attn alone)."""
    if not (args.bf16 or args.fp16):
        return None
    if config.recompute_granularity == "selective" and config.recompute_modules != ("core_attn",):
        return None  # the formula knows selective recompute of core attention alone (--recompute-modules)
    if config.offload_modules:
        return None  # nor what --fine-grained-activation-offloading moves off the device (the dry run measures it)
    s = args.seq_length // cp_size

    def layer_bytes(layer: int) -> float:  # Gated DeltaNet layers by their own terms
        return activation_bytes_of_layer(config, layer, s, args.micro_batch_size, tp_size, config.sequence_parallel,
                                         config.recompute_granularity,
                                         flash_attention=config.attention_backend not in EXPLICIT_BACKENDS)
    chunk_bytes = [sum(layer_bytes(layer) for layer in layers) for layers in chunk_layers]
    if config.mtp_num_layers and pp_rank == args.pipeline_model_parallel_size - 1:
        per_layer = layer_bytes(-1)  # an MTP depth's layer: an attention layer
        if config.recompute_granularity == "full":  # a recomputed depth keeps its two inputs
            chunk_bytes[-1] += 2 * config.mtp_num_layers * per_layer
        else:
            extra = mtp_activation_bytes(s, args.micro_batch_size, config.hidden_size, tp_size,
                                         config.sequence_parallel)
            chunk_bytes[-1] += config.mtp_num_layers * (per_layer + extra)
    held = layers_in_flight(args.pipeline_schedule, args.pipeline_model_parallel_size, pp_rank,
                            args.num_micro_batches, chunk_bytes)
    return round(held)
