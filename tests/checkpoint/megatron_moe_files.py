"""Megatron `torch`-format MoE checkpoints built from a megalite model's full tensors, laid out
the way Megatron-LM writes them (megatron/training/checkpointing.py): mp_rank_TT[_EEE] folders
written by the ranks with DP rank 0 or expert-DP rank 0 (rank order tp-cp-ep-dp-pp, PP=CP=1 here:
TP rank r % TP, DP rank r // TP; ETP rank r % ETP, EP rank r // ETP % EP, expert-DP rank
r // (ETP x EP)), each holding its TP slices of the dense tensors and its EP rank's experts,
locally numbered, as its ETP slices. Expert styles, each in Megatron-Core 0.16's state dict
shapes (megatron/core/transformer/moe/experts.py):
  sequential      SequentialMLP: mlp.experts.local_experts.<j>.linear_fc{1,2}.weight
  te_grouped      TEGroupedMLP: mlp.experts.linear_fc{1,2}.weight<j> (TE GroupedLinear weights)
  legacy_grouped  GroupedMLP: weight1 [hidden, experts x fc1 rows], weight2 [experts x fc2 cols,
                  hidden], built as GroupedMLP.sharded_state_dict's merge function builds them
The names (local or Transformer Engine spec: `te_names`) come from the reader's candidate list,
which the Megatron-Core-written checkpoints of test_megatron_core_*.py check."""

import argparse
import dataclasses
from pathlib import Path

import torch

from megalite.checkpoint.megatron.args import config_from_megatron_args
from megalite.checkpoint.megatron.names import megatron_candidates
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.moe_config import MoEConfig
from tests.checkpoint.megatron_files import megatron_args

EXPERTS, MOE_FFN = 4, 24
CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=16,
                   normalization="RMSNorm", activation="swiglu", add_bias_linear=False, position_embedding_type="rope",
                   untie_embeddings_and_output_weights=True, ffn_hidden_size=32, make_vocab_size_divisible_by=8,
                   hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=1,
                   moe=MoEConfig(num_experts=EXPERTS, ffn_hidden_size=MOE_FFN, layer_freq=[0, 1], router_topk=2,
                                 score_function="sigmoid", enable_expert_bias=True, shared_expert_intermediate_size=16,
                                 shared_expert_gate=True))


_NO_EXTRAS = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                  moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, mtp_num_layers=None)
HF_FAMILIES = {  # Hugging Face family: (Megatron arguments, megalite config) unlike CONFIG's
    "mixtral": ({**_NO_EXTRAS, "moe_layer_freq": 1, "moe_ffn_hidden_size": 32},  # HF: one intermediate_size
                dict(mtp_num_layers=None, moe=dict(score_function="softmax", enable_expert_bias=False, layer_freq=1,
                                                   ffn_hidden_size=32,
                                                   shared_expert_intermediate_size=None, shared_expert_gate=False))),
    "qwen2_moe": ({**_NO_EXTRAS, "moe_shared_expert_intermediate_size": 16, "moe_shared_expert_gate": True,
                   "moe_router_pre_softmax": True, "add_qkv_bias": True},
                  dict(mtp_num_layers=None, add_qkv_bias=True, moe=dict(score_function="softmax", enable_expert_bias=False,
                                                     pre_softmax=True))),
    "qwen3_moe": ({**_NO_EXTRAS, "moe_layer_freq": 1, "qk_layernorm": True},
                  dict(mtp_num_layers=None, qk_layernorm=True,
                       moe=dict(score_function="softmax", enable_expert_bias=False, layer_freq=1,
                                shared_expert_intermediate_size=None, shared_expert_gate=False))),
    "deepseek_v3": ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                     "moe_shared_expert_intermediate_size": MOE_FFN, "moe_shared_expert_gate": False,
                     "moe_router_topk_scaling_factor": 2.5, "multi_latent_attention": True, "qk_layernorm": True,
                     "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
                     "v_head_dim": 6, "rope_type": "yarn", "rotary_scaling_factor": 4.0, "mscale": 0.9,
                     "mscale_all_dim": 0.7}, None),
}


def family_config(family: str | None) -> GPTConfig:
    if family is None:
        return CONFIG
    if HF_FAMILIES[family][1] is None:  # from the arguments, as the reader maps them
        return config_from_megatron_args(moe_args(1, 1, 1, 1, "sequential", family), CONFIG.vocab_size, family)
    changes = dict(HF_FAMILIES[family][1])
    moe = dataclasses.replace(CONFIG.moe, **changes.pop("moe"))
    return dataclasses.replace(CONFIG, **changes, moe=moe)


def moe_args(tp: int, ep: int, etp: int, world: int, style: str, family: str | None = None) -> argparse.Namespace:
    args = _moe_args(tp, ep, etp, world, style)
    vars(args).update(HF_FAMILIES[family][0] if family else {})
    return args


def _moe_args(tp: int, ep: int, etp: int, world: int, style: str) -> argparse.Namespace:
    return megatron_args(num_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[0, 1], moe_router_topk=2,
                         moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, mtp_num_layers=1,
                         tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                         pipeline_model_parallel_size=1, world_size=world, moe_grouped_gemm=style != "sequential",
                         moe_use_legacy_grouped_gemm=style == "legacy_grouped")


def full_megatron_state(seed: int = 0, te_names: bool = False, family: str | None = None) -> tuple[dict, dict]:
    """({Megatron global name: full tensor}, {megalite name: full tensor}) of a seeded model."""
    model = GPTModel(family_config(family), init_seed=seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or name.endswith("expert_bias"):
                tensor.uniform_(0.5, 1.5)  # unlike Megatron's ones and zeros, a misplaced one shows
    megalite = {n: t.clone() for n, t in model.state_dict().items() if not n.endswith("._extra_state")}
    out = {}
    for name, tensor in megalite.items():
        candidates = megatron_candidates(name)
        moe_norm = name.replace("pre_mlp_layernorm.weight", "mlp.router.weight") in megalite  # TE: kept separate
        plain = "layernorm" in name and (moe_norm or not te_names)
        out[candidates[-1] if plain else candidates[0]] = tensor
    return out, megalite


def _slice(name: str, tensor: torch.Tensor, rank: int, size: int, split_down: bool = False) -> torch.Tensor:
    """Megatron's TP slice `rank` of `size` of full tensor `name`; an MLA down projection whole
    (Transformer Engine's duplicated linear) or, with `split_down`, split along its rows (the
    local spec's ColumnParallelLinear)."""
    if size == 1 or tensor.dim() == 0:
        return tensor
    if split_down and name.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        return tensor.chunk(size)[rank]
    if name.endswith(("linear_fc1.weight", "word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                      "linear_qkv.bias", "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")):
        if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate rows; up rows], each split
            return torch.cat([half.chunk(size)[rank] for half in tensor.chunk(2)])
        return tensor.chunk(size)[rank]
    if name.endswith(("linear_fc2.weight", "linear_proj.weight", "eh_proj.weight")):
        return tensor.chunk(size, dim=0 if name.endswith("eh_proj.weight") else 1)[rank]
    return tensor


def _expert_entries(names: dict, e: int, k: int, etp: int, local: int, style: str) -> dict:
    """The routed-expert entries of EP rank `e`, ETP slice `k`, in `style`."""
    out, grouped = {}, {}
    for name, tensor in names.items():
        head, _, rest = name.partition(".mlp.experts.local_experts.")
        if not rest:
            continue
        number, inner = rest.split(".", 1)
        g = int(number)
        if g // local != e:
            continue
        piece, j = _slice(inner, tensor, k, etp), g % local
        if style == "sequential":
            out[f"{head}.mlp.experts.local_experts.{j}.{inner}"] = piece
        elif style == "te_grouped":
            out[f"{head}.mlp.experts.{inner}{j}"] = piece
        else:
            grouped.setdefault((head, inner), {})[j] = piece
    for (head, inner), pieces in grouped.items():  # GroupedMLP.sharded_state_dict's sh_ten_merge_fn
        stacked = torch.stack([pieces[j] for j in range(local)])
        hidden = CONFIG.hidden_size
        shape = (hidden, -1) if inner == "linear_fc1.weight" else (-1, hidden)
        out[f"{head}.mlp.experts.weight{1 if inner == 'linear_fc1.weight' else 2}"] = \
            stacked.transpose(-1, -2).reshape(shape).contiguous()
    return out


def write_moe_torch(root, tp: int, ep: int, etp: int, world: int, style: str = "sequential",
                    te_names: bool = False, seed: int = 0, family: str | None = None,
                    split_down: bool = False) -> tuple[dict, list[str]]:
    """The checkpoint under `root` (iteration 3) of CONFIG, or of CONFIG changed to a Hugging
    Face `family`; ({megalite name: full tensor}, folder names). `split_down`: see _slice."""
    full, megalite = full_megatron_state(seed, te_names, family)
    local = EXPERTS // ep
    folder = Path(root) / "iter_0000003"
    written = []
    for rank in range(world):
        t, dp, k, e, edp = rank % tp, rank // tp, rank % etp, rank // etp % ep, rank // (etp * ep)
        if dp != 0 and edp != 0:
            continue
        state = {n: _slice(n, v, t, tp, split_down).clone() for n, v in full.items()
                 if ".mlp.experts.local_experts." not in n}
        state.update(_expert_entries(full, e, k, etp, local, style))
        name = f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "")
        written.append(name)
        (folder / name).mkdir(parents=True, exist_ok=True)
        torch.save({"args": moe_args(tp, ep, etp, world, style, family), "checkpoint_version": 3.0, "iteration": 3,
                    "model": state}, folder / name / "model_optim_rng.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("3")
    return megalite, written
