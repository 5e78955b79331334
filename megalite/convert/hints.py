"""The Megatron flags that rebuild a converted model in `python -m megalite.pretrain_gpt`.

`model_config_from_args(parse_args(flags), vocab_size)` gives back the converted GPTConfig
(tested), so the printed hint and common.json's `args` describe the model exactly.
"""

import dataclasses
import shlex

from megalite.model.config import GPTConfig
from megalite.model.moe_config import MoEConfig
from megalite.config.arguments import parse_args
from megalite.config.gdn import gdn_flags
from megalite.config.mla import mla_flags
from megalite.config.moe import MoEArgs

# MoEConfig field -> the MoEArgs option (Megatron's flag) that sets it
MOE_OPTIONS = {
    "num_experts": "num_experts", "ffn_hidden_size": "moe_ffn_hidden_size", "layer_freq": "moe_layer_freq",
    "router_topk": "moe_router_topk", "score_function": "moe_router_score_function",
    "pre_softmax": "moe_router_pre_softmax", "topk_scaling_factor": "moe_router_topk_scaling_factor",
    "router_dtype": "moe_router_dtype", "num_groups": "moe_router_num_groups",
    "group_topk": "moe_router_group_topk", "load_balancing_type": "moe_router_load_balancing_type",
    "aux_loss_coeff": "moe_aux_loss_coeff", "z_loss_coeff": "moe_z_loss_coeff",
    "enable_expert_bias": "moe_router_enable_expert_bias", "bias_update_rate": "moe_router_bias_update_rate",
    "capacity_factor": "moe_expert_capacity_factor", "pad_to_capacity": "moe_pad_expert_input_to_capacity",
    "token_drop_policy": "moe_token_drop_policy",
    "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "shared_expert_gate": "moe_shared_expert_gate", "grouped_gemm": "moe_grouped_gemm",
    "token_dispatcher_type": "moe_token_dispatcher_type",
}


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def model_flags(config: GPTConfig) -> list[str]:
    """Flags giving `config`'s architecture."""
    flags = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
             "--num-attention-heads", str(config.num_attention_heads),
             "--ffn-hidden-size", str(config.ffn_hidden_size),
             "--max-position-embeddings", str(config.max_position_embeddings),
             "--seq-length", str(min(config.max_position_embeddings, 4096))]
    if config.num_query_groups != config.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(config.num_query_groups)]
    if config.kv_channels != config.hidden_size // config.num_attention_heads:
        flags += ["--kv-channels", str(config.kv_channels)]
    if config.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", _number(config.rotary_base)]
        if config.rotary_percent != 1.0:
            flags += ["--rotary-percent", _number(config.rotary_percent)]
        if config.rotary_interleaved:
            flags.append("--rotary-interleaved")
        if config.rotary_seq_len_interpolation_factor is not None:
            flags += ["--rotary-seq-len-interpolation-factor", _number(config.rotary_seq_len_interpolation_factor)]
        if config.use_rope_scaling:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(config.rope_scaling_factor)]
    elif config.position_embedding_type == "none":
        flags += ["--position-embedding-type", "none"]
    if config.normalization != "LayerNorm":
        flags += ["--normalization", config.normalization]
    flags += ["--norm-epsilon", _number(config.norm_epsilon)]
    flags += [flag for flag, on in (("--apply-layernorm-1p", config.apply_layernorm_1p),
                                    ("--qk-layernorm", config.qk_layernorm)) if on]
    # exact GeLU with biases: Megatron's flags give tanh unless the bias-GeLU fusion is off
    flags += {"swiglu": ["--swiglu"], "openai_gelu": ["--openai-gelu"], "squared_relu": ["--squared-relu"],
              "gelu": ["--no-bias-gelu-fusion"] if config.add_bias_linear else []}[config.activation]
    if not config.add_bias_linear:
        flags.append("--disable-bias-linear")
    if config.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if config.make_vocab_size_divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(config.make_vocab_size_divisible_by)]
    flags += ["--init-method-std", _number(config.init_method_std),
              "--attention-dropout", _number(config.attention_dropout),
              "--hidden-dropout", _number(config.hidden_dropout)]
    if config.attention_softmax_in_fp32:
        flags.append("--attention-softmax-in-fp32")
    flags += {"bfloat16": ["--bf16"], "float16": ["--fp16"], "float32": []}[config.params_dtype]
    if config.moe is not None:
        flags += moe_flags(config.moe)
    return flags + mla_flags(config) + gdn_flags(config) + [flag for flag in kernel_flags(config) if flag not in flags]


def moe_flags(moe: MoEConfig) -> list[str]:
    """Flags giving `moe`: the expert count, width and layer pattern always, the rest where they
    differ from Megatron's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(MoEArgs)}
    flags = []
    for field in dataclasses.fields(MoEConfig):
        option, value = MOE_OPTIONS[field.name], getattr(moe, field.name)
        flag = "--" + option.replace("_", "-")
        if field.name == "layer_freq":
            value = str(value) if isinstance(value, int) else "[" + ",".join(map(str, value)) + "]"
        elif field.name not in ("num_experts", "ffn_hidden_size") and value == defaults[option]:
            continue
        flags += [flag] if value is True else [flag, _number(value)]
    return flags


def kernel_flags(config: GPTConfig) -> list[str]:
    """The attention backend and the fused kernels `config` chooses (Megatron's fusion flags)."""
    off = set(config.unfused_kernels)
    flags = [] if "cross_entropy" in off else ["--cross-entropy-loss-fusion"]
    flags += [flag for op, flag in (("bias_gelu", "--no-bias-gelu-fusion"), ("swiglu", "--no-bias-swiglu-fusion"),
                                    ("rotary", "--no-rope-fusion"), ("bias_dropout_add", "--no-bias-dropout-fusion"))
              if op in off]
    if config.attention_backend != "auto":
        flags += ["--attention-backend", config.attention_backend]
    return flags


def layout_flags(layout, sequence_parallel: bool = False) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout.vp)]
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.expert_tp != layout.tp:
        flags += ["--expert-tensor-parallel-size", str(layout.expert_tp)]
    if sequence_parallel and layout.tp > 1:
        flags.append("--sequence-parallel")
    return flags


def tokenizer_flags(entry: dict, vocab_size: int) -> list[str]:
    if not entry.get("type"):
        return []
    flags = ["--tokenizer-type", entry["type"]]
    for key, flag in (("model", "--tokenizer-model"), ("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")):
        if entry.get(key):
            flags += [flag, str(entry[key])]
    if entry["type"] == "NullTokenizer":
        flags += ["--vocab-size", str(vocab_size - 1)]  # Megatron's NullTokenizer adds the EOD id
    return flags


def training_flags(config: GPTConfig, layout, tokenizer: dict, load_dir) -> list[str]:
    """Every flag a run loading the converted checkpoint from `load_dir` needs."""
    return (model_flags(config) + layout_flags(layout, config.sequence_parallel)
            + tokenizer_flags(tokenizer, config.vocab_size) + ["--load", str(load_dir)])


def args_dict(flags: list[str]) -> dict:
    """common.json's `args`: the Arguments these flags parse to (Megatron's defaults elsewhere)."""
    return parse_args(flags).to_dict()


def hint_text(flags: list[str], layout, vocab_note: str | None = None) -> str:
    """The lines printed after a conversion to megalite."""
    replicas = ("per data-parallel replica" if layout.dp == 1 else
                f"= {layout.dp} data-parallel replicas, the fewest whose ranks the expert grid tiles")
    lines = [f"To train from it ({layout.world_size} processes {replicas}):",
             f"  torchrun --nproc-per-node {layout.world_size} -m megalite.pretrain_gpt \\"]
    pairs, i = [], 0
    while i < len(flags):
        take = 2 if i + 1 < len(flags) and not flags[i + 1].startswith("--") else 1
        pairs.append(" ".join(shlex.quote(f) for f in flags[i:i + take]))
        i += take
    lines += [f"    {p} \\" for p in pairs]
    lines.append("    --finetune   # or --no-load-optim --no-load-rng; plus your data, batch and lr flags")
    lines.append("  (--seq-length is a suggestion: change it to any length up to --max-position-embeddings)")
    if vocab_note:
        lines.append(f"  note: {vocab_note}")
    return "\n".join(lines)
