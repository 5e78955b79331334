"""Checkpoints written by Megatron-Core itself, on CPU: its GPTModel (local layer spec) at
TP=2 PP=2 in four gloo processes, with the logits it computes on fixed tokens.

`torch_dist` is written by megatron.core.dist_checkpointing.save of GPTModel.sharded_state_dict(),
as megatron/training/checkpointing.py does. `torch` is written as that file's save_checkpoint
writes it (megatron.training is not part of the megatron-core package): per rank,
iter_NNNNNNN/mp_rank_TT_PPP/model_optim_rng.pt holding generate_state_dict's keys (args,
checkpoint_version, iteration, model = state_dict_for_save_checkpoint(), opt_param_scheduler,
rng_state) and latest_checkpointed_iteration.txt. With `te_names` the model's state dict is
renamed as Transformer Engine's fused layer-norm linears name it (Transformer Engine is not
installed here): input_layernorm.weight -> self_attention.linear_qkv.layer_norm_weight,
pre_mlp_layernorm.weight -> mlp.linear_fc1.layer_norm_weight (and the biases), as
megatron.core.models.gpt.gpt_layer_specs maps them for TE specs.
"""

import argparse
import contextlib
import multiprocessing
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

TP, PP, ITERATION, VOCAB, SEQ = 2, 2, 7, 90, 12
PADDED_VOCAB = 96  # Megatron pads to make_vocab_size_divisible_by (8) x TP

FAMILIES = {
    "llama": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, layernorm_epsilon=1e-5,
                  position_embedding_type="rope", untie=True),
    "gpt2": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                 normalization="LayerNorm", gated_linear_unit=False, add_bias_linear=True, layernorm_epsilon=1e-5,
                 position_embedding_type="learned_absolute", untie=False),
}

TE_RENAMES = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
              ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
              ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
              ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(11))


def megatron_args(family: str, **overrides) -> argparse.Namespace:
    """The Namespace Megatron stores under 'args': the fields a loader reads (with the pre-0.16
    names norm_epsilon and apply_layernorm_1p; megatron_lm_args builds a whole Namespace) and a
    few enums. NullTokenizer's --vocab-size is one less than its VOCAB tokens (core_v0.16.1
    appends the EOD id), and the fusions _config turns off are off."""
    from megatron.core.transformer.enums import AttnBackend

    f = FAMILIES[family]
    args = argparse.Namespace(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], group_query_attention=f["num_query_groups"] != f["num_attention_heads"],
        ffn_hidden_size=f["ffn_hidden_size"], kv_channels=f["hidden_size"] // f["num_attention_heads"],
        seq_length=SEQ, max_position_embeddings=64, padded_vocab_size=PADDED_VOCAB, vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=8, tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
        virtual_pipeline_model_parallel_size=None, normalization=f["normalization"], norm_epsilon=f["layernorm_epsilon"],
        swiglu=f["gated_linear_unit"], add_bias_linear=f["add_bias_linear"], add_qkv_bias=f["add_bias_linear"],
        position_embedding_type=f["position_embedding_type"], rotary_base=10000, rotary_percent=1.0,
        untie_embeddings_and_output_weights=f["untie"], apply_layernorm_1p=False, qk_layernorm=False,
        squared_relu=False, openai_gelu=False, onnx_safe=None, bias_gelu_fusion=False, bias_swiglu_fusion=False,
        params_dtype=torch.float32, fp16=False, bf16=False,
        attention_backend=AttnBackend.auto, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        ckpt_format="torch", consumed_train_samples=56, consumed_valid_samples=0, iteration=ITERATION,
        tokenizer_type="NullTokenizer", micro_batch_size=2, global_batch_size=8, lr=1e-3, seed=1234)
    vars(args).update(overrides)
    return args


def _config(family: str, tp: int = TP, pp: int = PP, vp: int | None = None, bf16: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = FAMILIES[family]
    return TransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"], kv_channels=8,
        normalization=f["normalization"], gated_linear_unit=f["gated_linear_unit"],
        activation_func=F.silu if f["gated_linear_unit"] else F.gelu, add_bias_linear=f["add_bias_linear"],
        layernorm_epsilon=f["layernorm_epsilon"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        use_cpu_initialization=True, perform_initialization=True, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, sequence_parallel=False, init_method_std=0.02,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)


class _NoCudaRngTracker:
    """Megatron forks its CUDA RNG tracker around attention dropout; on CPU with dropout 0 there
    is nothing to fork."""

    def fork(self, name=None):
        return contextlib.nullcontext()


def _no_tracker(*args, **kwargs):
    return _NoCudaRngTracker()


def build_model(family: str, seed: int, tp: int = TP, pp: int = PP, vp: int | None = None, vp_stage: int | None = None,
                bf16: bool = False):
    """Megatron-Core's GPTModel (local layer spec, fp32 or `bf16`, CPU) for this rank of an
    initialised parallel state: the chunk `vp_stage` of `vp` virtual stages per pipeline rank,
    if given."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    f = FAMILIES[family]
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank() + 7 * (vp_stage or 0))
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker = _no_tracker
    stage = {} if vp is None else {"vp_stage": vp_stage}
    return GPTModel(
        _config(family, tp, pp, vp, bf16), get_gpt_layer_local_spec(normalization=f["normalization"]),
        vocab_size=PADDED_VOCAB, max_sequence_length=64,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, **stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, **stage),
        share_embeddings_and_output_weights=not f["untie"], position_embedding_type=f["position_embedding_type"],
        **stage)


def _forward(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits [b, s, vocab] on the last stage's TP rank 0 (point-to-point between stages)."""
    from megatron.core import parallel_state

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    hidden_shape = (ids.shape[1], ids.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            received = torch.empty(hidden_shape)
            dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(received)
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
        out = model(ids, positions, causal)  # True = masked; Megatron's default mask is built on CUDA
        if not parallel_state.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        pieces = [torch.empty_like(out) for _ in range(TP)]
        dist.all_gather(pieces, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        return torch.cat(pieces, dim=-1)[..., :VOCAB]


def tp_logits(model, tp: int) -> torch.Tensor:
    """A Megatron-Core GPT model's eval logits on tokens(), its vocabulary shards gathered over TP."""
    from megatron.core import parallel_state

    ids = tokens()
    positions = torch.arange(SEQ).expand_as(ids)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    model.eval()
    with torch.no_grad():
        out = model(ids, positions, causal)
    pieces = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(pieces, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)[..., :VOCAB]


def megalite_logits(source, load_dir, from_megatron: bool, pstate, tp: int) -> torch.Tensor:
    """megalite's full logits on tokens() for a checkpoint: a Megatron one given to --load
    (--finetune), a converted one read by load_checkpoint; the vocabulary shards gathered over TP."""
    from megalite.checkpoint.dcp.checkpoint import load_checkpoint
    from megalite.checkpoint.run_load import load_for_run
    from megalite.config.arguments import parse_args
    from megalite.config.run_config import CheckpointConfig
    from megalite.model.pipeline_chunks import build_model_chunks

    [model] = build_model_chunks(source.config, pstate, init_seed=5)
    if from_megatron:
        args = parse_args(["--load", load_dir, "--finetune", "--auto-detect-ckpt-format"])
        load_for_run(CheckpointConfig.from_args(args), [model], pstate, None)
    else:
        load_checkpoint(load_dir, chunks=[model], pstate=pstate, load_rng=False)
    model.eval()
    with torch.no_grad():
        local = model(tokens())
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.contiguous(), group=pstate.tp_group)
    return torch.cat(pieces, dim=-1)[..., :VOCAB]


def _save_torch(model, root: Path, family: str, te_names: bool) -> None:
    from megatron.core import parallel_state

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    model_sd = model.state_dict_for_save_checkpoint()
    if te_names:
        model_sd = type(model_sd)((_te_name(k), v) for k, v in model_sd.items())
    state = {"args": megatron_args(family), "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
             "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 0.0, "num_steps": 56, "warmup_steps": 0,
                                     "decay_steps": 800, "decay_style": "cosine"},
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                            "rng_tracker_states": {}}],
             "num_floating_point_operations_so_far": 0}
    save_torch(state, root, f"mp_rank_{tp:02d}_{pp:03d}")


def save_torch(state: dict | None, root: Path, rank_folder: str) -> None:
    """Megatron's `torch` format: this rank's `state` as iter_N/<rank_folder>/model_optim_rng.pt
    (None: this rank writes no file), then latest_checkpointed_iteration.txt (all ranks call it)."""
    if state is not None:
        folder = root / f"iter_{ITERATION:07d}" / rank_folder
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _te_name(key: str) -> str:
    for local, te in TE_RENAMES:
        if key.endswith(local):
            return key[: -len(local)] + te
    return key


def _save_torch_dist(model, root: Path, family: str) -> None:
    args = megatron_args(family)
    args.ckpt_format = "torch_dist"
    save_torch_dist(model, root, args)


def save_torch_dist(model, root: Path, args) -> None:
    """Megatron's `torch_dist` format of `model` (every rank calls it) under `root`."""
    from megatron.core import dist_checkpointing

    folder = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model.sharded_state_dict(),
             "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def cpu_shims(optimizer: bool = False) -> None:
    """Let Megatron-Core run on CPU in this (spawned) process. With `optimizer`, also what its
    DDP and optimizers need: tensors asked for on "cuda" are made on the CPU, and CPU tensors
    report CUDA type names (its optimizers check parameter types by name)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # dist_checkpointing's file writer starts a multiprocessing Manager; the test's worker is daemonic
    multiprocessing.current_process()._config["daemon"] = False
    torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding moves inv_freq to the "current device"
    torch.cuda.synchronize = lambda *a, **k: None  # the checkpoint writer synchronises before copying
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings are all-reduced "on the GPU" across stages
    if not optimizer:
        return
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    type_name = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if args or kwargs:
            return type_name(self, *args, **kwargs)
        name = type_name(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name


def _on_cpu(factory):
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device == "cuda" or isinstance(device, int) or getattr(device, "type", None) == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


def write_megatron_checkpoints(rank: int, world: int, out: str, family: str, te_names: bool = False):
    """Spawned worker (4 ranks): build, forward, save in both formats; logits from the last stage."""
    from megatron.core import parallel_state

    cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    try:
        model = build_model(family, seed=1234)
        logits = _forward(model, tokens())
        _save_torch(model, Path(out) / "torch", family, te_names)
        _save_torch_dist(model, Path(out) / "torch_dist", family)
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(logits, Path(out) / "logits.pt")
    finally:
        parallel_state.destroy_model_parallel()
