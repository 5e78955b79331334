"""Mixture-of-experts checkpoints written by Megatron-Core itself, on CPU (the companion of
megatron_core_fixture.py, whose CPU shims it uses): its GPTModel from get_gpt_decoder_block_spec
(local spec) with --moe-layer-freq [0,1] (layer 0 dense, layer 1 MoE), 4 routed experts
(SequentialMLP), at TP=2, EP=2 and ETP=1 (expert TP differs from TP) in four gloo processes,
saved in `torch_dist` by megatron.core.dist_checkpointing.save (and in the legacy `torch` format:
each writing rank's state_dict_for_save_checkpoint(), <kind>_torch/), with its logits on fixed tokens.

Kinds: "plain" (softmax top-2 router) and "shared" (sigmoid router with the expert bias, a gated
shared expert). Megatron's grouped-GEMM experts (GroupedMLP needs the grouped_gemm package and
bf16 on a GPU; TEGroupedMLP needs Transformer Engine) cannot be built here; their `torch_dist`
sharded state dict is SequentialMLP's by construction (experts.py: "interchangeable with
SequentialMLP's"), and their `torch` layouts are tested on Megatron's tensors re-laid out
(test_megatron_moe_torch.py)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.checkpoint import megatron_core_fixture as base

TP, EP, ETP, ITERATION, SEQ, PADDED_VOCAB, VOCAB = 2, 2, 1, base.ITERATION, base.SEQ, base.PADDED_VOCAB, base.VOCAB
KINDS = {
    "plain": dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                  moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
    "shared": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True),
}
MOE = dict(num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2, moe_layer_freq=[0, 1],
           moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)


def megatron_args(kind: str):
    args = base.megatron_args("llama", tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=EP, expert_tensor_parallel_size=ETP, num_layers=2,
                              ckpt_format="torch_dist", moe_grouped_gemm=False, sequence_parallel=False,
                              moe_router_load_balancing_type="aux_loss", moe_router_pre_softmax=False,
                              moe_router_topk_scaling_factor=None, moe_router_dtype=None)
    vars(args).update(MOE, **KINDS[kind])
    return args


def _config(kind: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = base.FAMILIES["llama"]
    return TransformerConfig(
        num_layers=2, hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"], kv_channels=8,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        layernorm_epsilon=1e-5, tensor_model_parallel_size=TP, expert_model_parallel_size=EP,
        expert_tensor_parallel_size=ETP, sequence_parallel=False, use_cpu_initialization=True,
        perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, init_method_std=0.02,
        pipeline_dtype=torch.float32, moe_router_load_balancing_type="aux_loss", num_moe_experts=MOE["num_experts"],
        **{k: v for k, v in MOE.items() if k != "num_experts"}, **KINDS[kind])


def build_model(kind: str, seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 names it only when TE imports
        moe_utils.te_general_gemm = None
    torch.manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker = base._no_tracker
    config = _config(kind)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=64, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():  # Megatron initialises norms to 1 and the expert bias to 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.linspace(-0.2, 0.3, buffer.numel()))
    return model


def write_moe_checkpoints(rank: int, world: int, out: str):
    """Spawned worker (4 ranks: TP2 x DP2 for the dense part, EP2 x ETP1 x DP2 for experts):
    every kind built, run and saved."""
    from megatron.core import parallel_state

    base.cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, expert_model_parallel_size=EP,
                                             expert_tensor_parallel_size=ETP)
    try:
        for kind in KINDS:
            model = build_model(kind, seed=2024)
            logits = base.tp_logits(model, TP)
            root = Path(out) / kind
            base.save_torch_dist(model, root, megatron_args(kind))
            _save_torch(model, Path(out) / f"{kind}_torch", kind)
            if rank == 0:
                torch.save(logits, root / "logits.pt")
                torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                           root / "rank0_state.pt")
    finally:
        parallel_state.destroy_model_parallel()


def _save_torch(model, root: Path, kind: str) -> None:
    """The same model in Megatron's legacy `torch` format: what megatron/training/checkpointing.py
    writes (not installed with megatron-core): the rank's state_dict_for_save_checkpoint() in
    mp_rank_TT_EEE (get_checkpoint_name at EP > 1), written by the ranks with DP rank 0 or
    expert-DP rank 0."""
    from megatron.core import parallel_state as ps

    state = None
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        args = megatron_args(kind)
        args.ckpt_format, args.world_size = "torch", dist.get_world_size()
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": model.state_dict_for_save_checkpoint()}
    base.save_torch(state, root, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
                                 f"{ps.get_expert_model_parallel_rank():03d}")
