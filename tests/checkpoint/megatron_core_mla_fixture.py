"""A multi-latent attention checkpoint written by Megatron-Core itself, on CPU (the companion of
megatron_core_fixture.py, whose CPU shims and save helpers it uses): its GPTModel with an
MLATransformerConfig (local layer spec: query and key/value latents with their norms under
--qk-layernorm, YaRN rotary with mscale) and one multi-token prediction depth
(get_gpt_mtp_block_spec), at TP=2 in two gloo processes, saved in `torch_dist`, with what it
computes on fixed tokens in training mode: per-token losses, and the MTP depth's loss from its
MTPLossLoggingHelper tracker.

megatron-core 0.16's local spec cannot build MLA as it ships: MLASelfAttention gives its core
attention k_channels and v_channels, which only Transformer Engine's attention takes, and tests
isinstance(linear_proj, TELinear) with a TELinear that is no class when Transformer Engine is
absent. The
fixture's core attention is Megatron-Core's own DotProductAttention taking (and, for its output
width, using) the value width, its forward Megatron's unchanged; TELinear becomes a class
nothing is an instance of."""

from pathlib import Path

import torch
import torch.nn.functional as F

from tests.checkpoint import megatron_core_fixture as base

TP, ITERATION, SEQ, PADDED_VOCAB = 2, base.ITERATION, base.SEQ, base.PADDED_VOCAB
VOCAB = PADDED_VOCAB  # Megatron's loss is over every row of its padded vocabulary: all of them are tokens here
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn",
           rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7)


def megatron_args():
    """The 'args' a Megatron MLA + MTP run stores (YaRN's original context stays
    MLATransformerConfig's 4096: no flag reaches it)."""
    args = base.megatron_args("llama", tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
                              multi_latent_attention=True, qk_layernorm=True, group_query_attention=False,
                              num_query_groups=4, mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
                              vocab_size=VOCAB, ckpt_format="torch_dist")
    vars(args).update(MLA)
    return args


def _config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    f = base.FAMILIES["llama"]
    return MLATransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        ffn_hidden_size=f["ffn_hidden_size"], normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, layernorm_epsilon=1e-5, tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False, sequence_parallel=False,
        init_method_std=0.02, pipeline_dtype=torch.float32, qk_layernorm=True, mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1, **MLA)


def _mla_dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:  # (the Attention base class builds one without them first)
                self.hidden_size_per_partition = v_channels * config.num_attention_heads // TP

    return MLADotProductAttention


def build_model(seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.TELinear = type("NoTransformerEngineLinear", (), {})
    torch.manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker = base._no_tracker
    config = _config()
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention()
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=64, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     mtp_block_spec=mtp)
    with torch.no_grad():  # Megatron initialises norms to 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def labels_and_mask():
    g = torch.Generator().manual_seed(12)
    return torch.randint(0, base.VOCAB, (2, SEQ), generator=g), (torch.rand(2, SEQ, generator=g) > 0.25).float()


def _losses(model):
    """(per-token losses [b, s], the MTP depth's masked mean loss) of a training-mode forward."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ids = base.tokens()
    labels, mask = labels_and_mask()
    positions = torch.arange(SEQ).expand_as(ids)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    MTPLossLoggingHelper.tracker = {}
    model.train()
    with torch.no_grad():
        loss = model(ids, positions, causal, labels=labels, loss_mask=mask)
    return loss, MTPLossLoggingHelper.tracker["values"].clone()


def write_mla_checkpoint(rank: int, world: int, out: str):
    """Spawned worker (TP=2): build, compute, save in both formats."""
    from megatron.core import parallel_state

    base.cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        model = build_model(seed=4321)
        losses, mtp = _losses(model)
        model.eval()
        root = Path(out)
        base.save_torch_dist(model, root / "torch_dist", megatron_args())
        if rank == 0:
            torch.save({"losses": losses, "mtp": mtp}, root / "reference.pt")
        return sorted(model.state_dict().keys()) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
