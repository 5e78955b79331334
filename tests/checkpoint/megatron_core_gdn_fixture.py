"""A Gated DeltaNet hybrid checkpoint written by Megatron-Core itself, on CPU (the companion of
megatron_core_fixture.py, whose CPU shims it uses): megatron-core 0.16.1's GPTModel with
layer 0 its GatedDeltaNet (experimental_attention_variant "gated_delta_net",
linear_attention_freq [1, 0]) and layer 1 gated full attention (attention_output_gate), at TP=2
in two gloo processes, saved in `torch_dist` (dist_checkpointing.save: in_proj and conv1d stored
as their blocks) and in `torch` (per-rank state_dict_for_save_checkpoint), with its logits on
fixed tokens.

What is not Megatron-Core's own as it ships, and why:
  - the layer specs are written here with Megatron-Core's local modules (ColumnParallelLinear
    in_proj after a separate input norm, WrappedTorchNorm out_norm, RowParallelLinear out_proj):
    0.16.1's get_transformer_block_with_experimental_attention_variant_spec asserts Transformer
    Engine, which fuses the input norm into in_proj (in_proj.layer_norm_weight; the reader's
    name for it is unit-tested in test_megatron_gdn_names.py);
  - `fla` (flash-linear-attention) is tests/checkpoint/fla_standin: its l2norm in plain torch
    (the same formula) and no chunked kernel; the model runs with deterministic_mode, where
    GatedDeltaNet computes the delta rule with Megatron's torch_chunk_gated_delta_rule (see
    fla_standin/fla/__init__.py for what of the real fla-core 0.6.0 runs on this CPU).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.checkpoint import megatron_core_fixture as base

TP, ITERATION, SEQ, PADDED_VOCAB, VOCAB = 2, base.ITERATION, base.SEQ, base.PADDED_VOCAB, base.VOCAB
FLA_STANDIN = str(Path(__file__).parent / "fla_standin")
GDN = dict(linear_attention_freq=[1, 0], linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4)


def megatron_args():
    args = base.megatron_args("llama", tensor_model_parallel_size=TP, pipeline_model_parallel_size=1, num_layers=2,
                              ckpt_format="torch_dist", experimental_attention_variant="gated_delta_net",
                              attention_output_gate=True)
    vars(args).update(GDN)
    return args


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = base.FAMILIES["llama"]
    return TransformerConfig(
        num_layers=2, hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"], kv_channels=8,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        layernorm_epsilon=1e-5, tensor_model_parallel_size=TP, sequence_parallel=False, use_cpu_initialization=True,
        perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, init_method_std=0.02,
        pipeline_dtype=torch.float32, deterministic_mode=True, experimental_attention_variant="gated_delta_net",
        attention_output_gate=True, **GDN)


def _block_spec():
    """[GatedDeltaNet layer, gated full-attention layer] from Megatron-Core's local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    full = get_gpt_layer_local_spec(normalization="RMSNorm")
    gdn = ModuleSpec(module=full.module, submodules=type(full.submodules)(**{
        **vars(full.submodules),
        "self_attention": ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))}))
    return TransformerBlockSubmodules(layer_specs=[gdn, full], layer_norm=WrappedTorchNorm)


def build_model(seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker = base._no_tracker
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.get_cuda_rng_tracker = base._no_tracker  # imported by name there
    model = GPTModel(_config(), _block_spec(), vocab_size=PADDED_VOCAB, max_sequence_length=64, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():  # Megatron initialises norms to 1 and dt_bias to 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.uniform_(0.5, 1.5)
    return model


def _save_torch(model, root: Path) -> None:
    from megatron.core import parallel_state

    args = megatron_args()
    args.ckpt_format = "torch"
    base.save_torch({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                     "model": model.state_dict_for_save_checkpoint()},
                    root, f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")


def write_gdn_checkpoints(rank: int, world: int, out: str):
    """Spawned worker (TP=2): build, compute, save in both formats; returns rank 0's sharded
    state dict keys of the GDN layer."""
    from megatron.core import parallel_state

    sys.path.insert(0, FLA_STANDIN)
    base.cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        model = build_model(seed=321)
        logits = base.tp_logits(model, TP)
        root = Path(out)
        base.save_torch_dist(model, root / "torch_dist", megatron_args())
        _save_torch(model, root / "torch")
        if rank == 0:
            torch.save(logits, root / "logits.pt")
        return sorted(model.state_dict().keys()) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
