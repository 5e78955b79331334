"""The optimizer of the model's flags (`--optimizer` and the flags that change what it holds or
does) and its state per rank, as megalite's optimizers hold it (megalite/optimizer/):

- every kind keeps fp32 main parameters beside 16-bit weights (4 bytes per element; fp16 adds
  an fp32 gradient copy, 4 more; fp32 runs step the weights themselves, FSDP2 its fp32 shards);
- adam: two fp32 moments per element (torch AdamW; its 4-byte step per tensor is not counted);
- sgd: one fp32 momentum buffer per element, none with --sgd-momentum 0 (torch SGD);
- muon: one fp32 momentum per element of each Muon weight (every 2-D weight but the word
  embedding and the output layer: muon.is_muon_param), --muon-scalar-optimizer's states for the
  rest: Adam's two moments or Lion's one.
All of it is per element, so the distributed optimizer and FSDP2 shard it over DP x CP (expert
weights over EDP) as they shard Adam's. `muon_matrices` lists the Muon weights one rank
orthogonalises (their TP-local shapes), for the state split and for the Newton-Schulz FLOPs
(optimizer_step.py).

--optimizer lion, soap and adaptive_muon are refused by megalite (config/run.py), so the planner
refuses them too, one line each; dist_muon (Megatron's deprecated muon + distributed optimizer)
is refused with the flags to give instead, since the planner chooses the distributed optimizer.
"""

from dataclasses import dataclass

from megalite.model.config import GPTConfig
from megalite.parallel.pipeline.stage_layout import stage_layers

KINDS = ("adam", "sgd", "muon")


@dataclass(frozen=True)
class OptimizerSpec:
    """What the planner needs of the run's optimizer (the flags' values)."""

    kind: str = "adam"
    weight_decay: float = 0.01
    sgd_momentum: float = 0.9
    scalar: str = "adam"
    """--muon-scalar-optimizer: adam or lion."""
    ns_steps: int = 5
    tp_mode: str = "duplicated"
    split_qkv: bool = True
    nesterov: bool = False
    ns_bf16: bool = True
    """--muon-fp32-matmul-prec medium: the Newton-Schulz GEMMs run in bf16."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"--optimizer {self.kind!r}: the planner models {', '.join(KINDS)}")

    def describe(self) -> str:
        if self.kind == "sgd":
            return f"sgd (momentum {self.sgd_momentum:g})"
        if self.kind == "muon":
            return (f"muon ({self.ns_steps} Newton-Schulz steps in {'bf16' if self.ns_bf16 else 'fp32'}, "
                    f"{self.tp_mode} TP, scalar {self.scalar})")
        return self.kind

    def moment_bytes(self, matrix: bool) -> int:
        """fp32 state bytes per element of a parameter (`matrix`: a Muon weight under muon)."""
        if self.kind == "adam":
            return 8
        if self.kind == "sgd":
            return 4 if self.sgd_momentum else 0
        return 4 if matrix or self.scalar == "lion" else 8


def spec_from_args(args) -> OptimizerSpec:
    """The OptimizerSpec of pretrain_gpt's parsed flags; ValueError (one line) for an optimizer or
    combination megalite refuses."""
    from megalite.config.muon import check_muon_args

    if args.optimizer in ("lion", "soap", "adaptive_muon"):
        raise ValueError(f"--optimizer {args.optimizer} is not implemented in megalite (it runs adam, sgd and "
                         "muon; Lion only as --muon-scalar-optimizer lion), so there is nothing to plan")
    if args.optimizer == "dist_muon":
        raise ValueError("--optimizer dist_muon is Megatron's deprecated muon with --use-distributed-optimizer: "
                         "give --optimizer muon (and --distributed-optimizer on to the planner to force it)")

    def fail(message):
        raise ValueError(message)
    check_muon_args(args, fail)
    if args.apply_wd_to_qk_layernorm and args.optimizer == "muon":
        raise ValueError("--apply-wd-to-qk-layernorm with --optimizer muon is not implemented in megalite")
    if args.use_mup and args.optimizer not in ("adam", "sgd"):
        raise ValueError(f"--use-mup with --optimizer {args.optimizer} is refused by megalite (adam or sgd only)")
    return OptimizerSpec(args.optimizer, args.weight_decay, args.sgd_momentum, args.muon_scalar_optimizer,
                         args.muon_num_ns_steps, args.muon_tp_mode, args.muon_split_qkv is not False,
                         args.muon_nesterov, args.muon_fp32_matmul_prec == "medium")


@dataclass(frozen=True)
class Matrix:
    """A Muon weight on one rank: TP-local [rows, cols], the dim TP splits (None: whole on every
    TP rank), the (q, k, v) rows per query group of a fused QKV weight, how many alike, and
    whether it is a routed expert's (sharded over EDP, not DP x CP)."""

    rows: int
    cols: int
    partition_dim: int | None
    count: int = 1
    qkv_split: tuple | None = None
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def _mlp(ffn: int, h: int, up: int, t: int, count: int = 1, expert: bool = False) -> list:
    return [Matrix(ffn * up // t, h, 0, count, expert=expert), Matrix(h, ffn // t, 1, count, expert=expert)]


def layer_matrices(config: GPTConfig, layer: int, t: int, ep: int = 1) -> list:
    """The Muon weights of transformer layer `layer` (an MTP depth's numbered from num_layers) on
    one TP (and EP) rank, as megalite builds them."""
    h, d, up = config.hidden_size, config.kv_channels, 2 if config.activation == "swiglu" else 1
    if config.gdn is not None and config.gdn.is_linear_layer(layer, config.num_layers):
        gdn = config.gdn
        out = [Matrix(sum(gdn.in_proj_sections()) // t, h, 0), Matrix(h, gdn.v_dim // t, 1)]
    elif config.mla is not None:
        mla, a = config.mla, config.num_attention_heads
        up_q = a * mla.q_head_dim // t
        out = [Matrix(up_q, h, 0)] if mla.q_lora_rank is None else [Matrix(mla.q_lora_rank, h, None),
                                                                   Matrix(up_q, mla.q_lora_rank, 0)]
        out += [Matrix(mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h, None),
                Matrix(a * (mla.qk_head_dim + mla.v_head_dim) // t, mla.kv_lora_rank, 0),
                Matrix(h, a * mla.v_head_dim // t, 1)]
    else:
        q, kv = config.num_attention_heads * d, config.num_query_groups * d
        rows = (q * (1 + config.attention_output_gate) + 2 * kv) // t
        split = (config.num_attention_heads // config.num_query_groups * d, d, d)
        out = [Matrix(rows, h, 0, qkv_split=split if rows % sum(split) == 0 else None), Matrix(h, q // t, 1)]
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer, config.num_layers):
        return out + _mlp(config.ffn_hidden_size, h, up, t)
    out.append(Matrix(moe.num_experts, h, None))  # the router
    if moe.shared_expert_intermediate_size:
        out += _mlp(moe.shared_expert_intermediate_size, h, up, t)
        out += [Matrix(1, h, None)] if moe.shared_expert_gate else []
    return out + _mlp(moe.ffn_hidden_size, h, up, t, moe.num_experts // ep, expert=True)


def rank_matrices(config: GPTConfig, t: int, p: int, v: int, rank: int, ep: int = 1,
                  split: dict | None = None) -> list:
    """The Muon weights over all chunks of pipeline rank `rank` (`split`: Workload.layer_split)."""
    out = []
    for chunk in range(v):
        for layer in stage_layers(config.num_layers, p, rank, chunk, v, **(split or {})):
            out += layer_matrices(config, layer, t, ep)
        first, last = rank == 0 and chunk == 0, rank == p - 1 and chunk == v - 1
        mtp_copy = last and not first and config.mtp_num_layers  # MTP's copy of the embedding
        if (first or mtp_copy) and config.position_embedding_type == "learned_absolute":
            out.append(Matrix(config.max_position_embeddings, config.hidden_size, None))
        if last:
            for depth in range(config.mtp_num_layers or 0):  # eh_proj, column-parallel, and the depth's layer
                out.append(Matrix(config.hidden_size // t, 2 * config.hidden_size, 0))
                out += layer_matrices(config, config.num_layers + depth, t, ep)
    return out


def optimizer_state_bytes(workload, layout, rank: int, dense: int, expert: int) -> float:
    """Optimizer bytes (fp32 main parameters and copies, the optimizer's states) of pipeline rank
    `rank` holding `dense` and `expert` parameters under `layout` (see the module)."""
    spec = workload.optimizer
    copies = 0 if layout.fsdp2 else {"bf16": 4, "fp16": 8, "fp32": 0}[workload.precision]
    sharded = layout.distributed_optimizer or layout.fsdp2
    shards = layout.dp * layout.cp if sharded else 1
    expert_shards = max(1, shards // layout.ep) if sharded else 1
    if spec.kind == "muon":
        matrices = rank_matrices(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                 workload.layer_split(layout.pp, layout.vp))
        dense_matrix = sum(m.numel for m in matrices if not m.expert)
        expert_matrix = sum(m.numel for m in matrices if m.expert)
    else:
        dense_matrix = expert_matrix = 0
    scalar, matrix = spec.moment_bytes(False), spec.moment_bytes(True)
    dense_bytes = copies * dense + scalar * (dense - dense_matrix) + matrix * dense_matrix
    expert_bytes = copies * expert + scalar * (expert - expert_matrix) + matrix * expert_matrix
    return dense_bytes / shards + expert_bytes / expert_shards
