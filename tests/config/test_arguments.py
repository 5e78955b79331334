"""Options: generated parser, YAML config, refusals with one-line messages, Megatron defaults."""

import dataclasses
import os
import re

import pytest

from megalite.model.config import GPTConfig
from megalite.parallel.state import ParallelLayout
from megalite.config.arguments import (Arguments, build_parser, layout_from_args,
                                         model_config_from_args, parse_args, validate_args)
from tests.training.launch import drop_flags

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 100").split()


def parsed(extra="", world_size=None):
    args = parse_args(drop_flags(BASE, *extra.split()) + extra.split())  # extra's values win
    if world_size is not None:
        validate_args(args, world_size)
    return args


def refused(extra: str, world_size: int = 1) -> str:
    with pytest.raises(ValueError) as info:
        parsed(extra, world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_field_has_help_and_a_flag():
    parser = build_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    for f in dataclasses.fields(Arguments):
        assert f.metadata["help"], f.name
        if f.metadata["cli"]:
            assert f.metadata.get("flag") or "--" + f.name.replace("_", "-") in options, f.name
    for flag in ("--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-load-optim",
                 "--no-load-rng", "--no-save-optim", "--recompute-activations", "--config",
                 "--metrics-file", "--pipeline-schedule", "--torch-compile", "--no-fused-kernels",
                 "--label-smoothing", "--lr-warmup-init", "--exit-signal-handler"):
        assert flag in options


def test_flags_md_lists_only_known_flags():
    text = open(os.path.join(os.path.dirname(__file__), "../../../shared/docs/flags.md")).read() \
        if os.path.exists(os.path.join(os.path.dirname(__file__), "../../../shared/docs/flags.md")) else None
    if text is None:
        pytest.skip("shared/docs/flags.md is not beside the repository")
    options = {s for action in build_parser()._actions for s in action.option_strings}
    named = set(re.findall(r"(--[a-z0-9][a-z0-9-]*[a-z0-9])(?![a-z0-9-]*\*)", text))
    families = set(re.findall(r"(--[a-z0-9][a-z0-9-]*-)\*", text))  # "the --moe-* family"
    assert named - options == set()
    assert {f for f in families if not any(o.startswith(f) for o in options)} == set()


def test_megatron_defaults():
    args = parse_args([])
    expected = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                    distributed_timeout_minutes=10, initial_loss_scale=2.0**32, min_loss_scale=1.0,
                    loss_scale_window=1000, hysteresis=2, rotary_base=10000, rotary_percent=1.0,
                    norm_epsilon=1e-5, make_vocab_size_divisible_by=128, init_method_std=0.02,
                    attention_dropout=0.1, hidden_dropout=0.1, weight_decay=0.01, adam_beta1=0.9,
                    adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, optimizer="adam", seed=1234,
                    num_workers=2, log_interval=100, eval_interval=1000, eval_iters=100,
                    lr_decay_style="linear", lr_warmup_iters=0, lr_warmup_init=0.0, min_lr=0.0,
                    lr_wsd_decay_style="exponential", label_smoothing=0.0,
                    position_embedding_type="learned_absolute", normalization="LayerNorm",
                    ckpt_format="dcp", transformer_impl="local", fused_kernels=None,
                    sequence_parallel=False, bf16=False, loss_scale=None)
    assert {k: getattr(args, k) for k in expected} == expected


def test_command_line_values_and_types():
    args = parsed("--bf16 --data-cache-path /c --rotary-base 5e5 --fused-kernels "
                  "--disable-bias-linear --no-load-optim")
    assert (args.num_layers, args.lr, args.rotary_base, args.data_cache_path) == (4, 1e-3, 5e5, "/c")
    assert args.bf16 and args.fused_kernels is True and args.disable_bias_linear and args.no_load_optim
    assert parsed("--no-fused-kernels").fused_kernels is False
    weighted = parse_args(drop_flags(BASE, "--mock-data") + "--data-path 0.3 a 0.7 b".split())
    assert weighted.data_path == ["0.3", "a", "0.7", "b"]


@pytest.mark.parametrize("argv, words", [
    ("--hidden 8", ["--hidden", "did you mean --hidden-size"]),      # no prefix matching
    ("--not-a-flag", ["--not-a-flag"]),
    ("--num-layers four", ["--num-layers", "four"]),
    ("--lr-decay-style exp", ["--lr-decay-style", "exp"]),
    ("--fused-kernels --no-fused-kernels", ["--fused-kernels", "--no-fused-kernels"]),
])
def test_bad_command_lines_name_the_flag(argv, words):
    with pytest.raises(ValueError) as info:
        parse_args(BASE + argv.split())
    assert all(word in str(info.value) for word in words), str(info.value)


def test_config_file_and_command_line_precedence(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("hidden-size: 128\nnum_attention_heads: 8\nlr: 3.0e-4\nmin-lr: 1e-5\n"
                      "bf16: true\ndata-path: 0.5 a 0.5 b\nno-fused-kernels: true\n"
                      "train_data_path: [x, 1]\n")
    args = parse_args(["--config", str(config), "--hidden-size", "256"])
    assert args.hidden_size == 256                      # the command line wins
    assert args.num_attention_heads == 8 and args.bf16 and args.fused_kernels is False
    assert args.lr == 3e-4 and args.min_lr == 1e-5      # '1e-5' is a string to YAML 1.1
    assert args.data_path == ["0.5", "a", "0.5", "b"] and args.train_data_path == ["x", "1"]
    assert args.config == str(config)


@pytest.mark.parametrize("text, words", [
    ("hidden-sise: 64\n", ["hidden-sise", "unknown key", "hidden_size"]),
    ("num-layers: 2.5\n", ["num-layers", "integer"]),
    ("bf16: yes please\n", ["bf16", "true or false"]),
    ("normalization: BatchNorm\n", ["normalization", "BatchNorm"]),
    ("lr: 1e-3\nlr: 2e-3\nhidden_size: 8\nhidden-size: 8\n", ["hidden_size", "hidden-size"]),
    ("- a list\n", ["mapping"]),
    ("lr: [1\n", ["not valid YAML", ":"]),
    ("config: other.yaml\n", ["config"]),
])
def test_bad_config_files_name_the_file_and_key(tmp_path, text, words):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError) as info:
        parse_args(["--config", str(config)])
    message = str(info.value)
    assert str(config) in message and "\n" not in message
    assert all(word in message for word in words), message


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nothere.yaml"):
        parse_args(["--config", str(tmp_path / "nothere.yaml")])


@pytest.mark.parametrize("extra, world_size, words", [
    ("--bf16 --fp16", 1, ["--bf16", "--fp16"]),
    ("--train-samples 100", 1, ["--train-iters", "--train-samples"]),
    ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1, ["--lr-warmup-iters", "--lr-warmup-fraction"]),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--num-virtual-stages-per-pipeline-rank 2", 2,
     ["--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"]),
    ("--global-batch-size 6", 4, ["--global-batch-size 6", "--micro-batch-size 2", "4"]),
    ("--group-query-attention", 1, ["--group-query-attention", "--num-query-groups"]),
    ("--num-query-groups 2", 1, ["--num-query-groups", "--group-query-attention"]),
    ("--swiglu --openai-gelu", 1, ["--swiglu", "--openai-gelu"]),
    ("--recompute-method block --recompute-granularity selective", 1, ["--recompute-method", "--recompute-granularity full"]),
    ("--recompute-num-layers 1 --recompute-granularity selective", 1, ["--recompute-num-layers"]),
    ("--recompute-activations --recompute-granularity full", 1,
     ["--recompute-activations", "--recompute-granularity full"]),
    ("--recompute-granularity full --recompute-num-layers 5", 1, ["--recompute-num-layers 5", "4"]),
    ("--ckpt-format zarr", 1, ["--ckpt-format", "zarr"]),
    ("--rampup-batch-size 16 16 1000", 1, ["--rampup-batch-size"]),
    ("--tensor-model-parallel-size 3", 3, ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
    ("--tensor-model-parallel-size 2", 3, ["world size 3", "--tensor-model-parallel-size 2"]),
    ("--pipeline-model-parallel-size 3", 3, ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule none", 2, ["--pipeline-schedule none"]),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule interleaved_1f1b", 2,
     ["interleaved_1f1b", "--num-virtual-stages-per-pipeline-rank"]),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4", 2,
     ["--num-layers 4", "--decoder-first-pipeline-num-layers 4"]),
    ("--decoder-last-pipeline-num-layers 1", 1, ["--decoder-last-pipeline-num-layers",
                                                 "--pipeline-model-parallel-size"]),
    ("--overlap-param-gather --overlap-grad-reduce", 1, ["--overlap-param-gather",
                                                         "--use-distributed-optimizer"]),
    ("--use-torch-fsdp2 --use-distributed-optimizer", 1, ["--use-torch-fsdp2",
                                                          "--use-distributed-optimizer"]),
    ("--lr-decay-style WSD", 1, ["WSD", "--lr-wsd-decay-iters"]),
    ("--lr-wsd-decay-iters 2", 1, ["--lr-wsd-decay-iters", "WSD"]),
    ("--lr-warmup-iters 10", 1, ["warmup", "decay"]),
    ("--min-lr 0.1", 1, ["--min-lr", "--lr"]),
    ("--lr-decay-samples 10", 1, ["--lr-decay-samples", "--train-iters"]),
    ("--mock-data --data-path x", 1, ["--mock-data", "--data-path"]),
    ("--max-position-embeddings 16", 1, ["--max-position-embeddings 16", "--seq-length 32"]),
    ("--loss-scale 128", 1, ["--loss-scale", "--fp16"]),
    ("--hidden-dropout 1.5", 1, ["--hidden-dropout"]),
    ("--micro-batch-size 0", 1, ["--micro-batch-size"]),
    ("--finetune", 1, ["--finetune", "--load"]),
    ("--optimizer-cpu-offload", 1, ["--optimizer-cpu-offload", "--use-distributed-optimizer"]),
    ("--ffn-hidden-size 101 --tensor-model-parallel-size 2", 2, ["--ffn-hidden-size 101"]),
])
def test_contradictions_are_refused_naming_the_flags(extra, world_size, words):
    message = refused(extra, world_size)
    assert all(word in message for word in words), message


def test_required_and_data_checks():
    bare = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32".split()
    with pytest.raises(ValueError, match="--micro-batch-size is required"):
        validate_args(parse_args(bare), 1)
    with pytest.raises(ValueError, match="--train-iters or --train-samples"):
        validate_args(parse_args(bare + ["--micro-batch-size", "1", "--mock-data"]), 1)
    gpt2 = BASE[:-4] + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"]
    assert BASE[-4:] == ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        validate_args(parse_args(gpt2), 1)
    without_data = drop_flags(BASE, "--mock-data")
    with pytest.raises(ValueError, match="--data-path"):
        validate_args(parse_args(without_data), 1)
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        validate_args(parse_args(without_data + "--data-path 0.5 a b".split()), 1)
    with pytest.raises(ValueError, match="--split"):
        validate_args(parse_args(without_data + "--data-path a --split 9,x".split()), 1)
    with pytest.raises(ValueError, match="--lr is required"):
        validate_args(parse_args(drop_flags(BASE, "--lr")), 1)


def test_derived_values_and_no_silent_rewrites():
    args = parsed("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                  "--global-batch-size 16 --sequence-parallel --recompute-activations", world_size=8)
    assert (args.world_size, args.data_parallel_size, args.num_micro_batches) == (8, 2, 4)
    assert args.pipeline_schedule == "1f1b" and args.virtual_pipeline_model_parallel_size == 1
    assert args.sequence_parallel and args.recompute_granularity == "selective"
    assert args.max_position_embeddings == 32 and args.ffn_hidden_size == 256
    assert args.total_train_iters == 10
    snapshot = args.to_dict()
    validate_args(args, 8)                       # idempotent
    assert args.to_dict() == snapshot
    assert Arguments.from_dict(snapshot) == args
    defaults = parsed(world_size=4)
    assert (defaults.global_batch_size, defaults.num_micro_batches, defaults.pipeline_schedule) == (8, 1, "none")
    samples = parse_args(drop_flags(BASE, "--train-iters") + ["--train-samples", "101", "--global-batch-size", "4"])
    validate_args(samples, 1)
    assert samples.total_train_iters == 25 and samples.train_iters is None
    swiglu = parsed("--swiglu", world_size=1)
    assert swiglu.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 == 128
    interleaved = parsed("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                         "--global-batch-size 4", world_size=2)
    assert interleaved.virtual_pipeline_model_parallel_size == 2
    assert interleaved.pipeline_schedule == "interleaved_1f1b"
    uneven = parsed("--num-layers 5 --pipeline-model-parallel-size 3 "
                    "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2",
                    world_size=3)
    assert uneven.pipeline_schedule == "1f1b"


def test_layout_from_args_checks_before_any_process_group():
    args = parsed("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                  "--num-virtual-stages-per-pipeline-rank 2")
    layout = layout_from_args(args, 8)
    assert layout == ParallelLayout(8, tensor=2, pipeline=2, virtual_pipeline=2)
    with pytest.raises(ValueError, match="--num-query-groups 1 is not divisible by --tensor-model"):
        layout_from_args(parsed("--group-query-attention --num-query-groups 1 "
                                "--tensor-model-parallel-size 2"), 2)


def test_model_config_from_args():
    gpt2 = model_config_from_args(parsed("--openai-gelu --attention-dropout 0 --label-smoothing 0.1",
                                         world_size=1), vocab_size=100)
    assert isinstance(gpt2, GPTConfig)
    assert (gpt2.activation, gpt2.add_bias_linear, gpt2.params_dtype) == ("openai_gelu", True, "float32")
    assert (gpt2.ffn_hidden_size, gpt2.max_position_embeddings, gpt2.vocab_size) == (256, 32, 100)
    assert gpt2.attention_dropout == 0.0 and gpt2.label_smoothing == 0.1
    llama = model_config_from_args(parsed(
        "--swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
        "--rotary-base 500000 --group-query-attention --num-query-groups 2 --bf16 "
        "--untie-embeddings-and-output-weights --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 2 --no-fused-kernels"), vocab_size=100)
    assert (llama.activation, llama.add_bias_linear, llama.normalization) == ("swiglu", False, "RMSNorm")
    assert (llama.num_query_groups, llama.kv_channels, llama.ffn_hidden_size) == (2, 16, 128)
    assert (llama.position_embedding_type, llama.rotary_base, llama.params_dtype) == ("rope", 5e5, "bfloat16")
    assert llama.untie_embeddings_and_output_weights and llama.fused_kernels is False
    assert (llama.recompute_granularity, llama.recompute_method, llama.recompute_num_layers) == ("full", "block", 2)
    assert model_config_from_args(parsed("--fp16"), 100).params_dtype == "float16"
    assert model_config_from_args(parsed("--recompute-activations"), 100).recompute_granularity == "selective"


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
EXAMPLE_RUNS = {  # file: (intended world size, what its README command adds)
    "gpt2_124m.yaml": (8, "--vocab-file v.json --merge-file m.txt"),
    "gpt2_350m_tp_pp.yaml": (8, "--vocab-file v.json --merge-file m.txt"),
    "llama_1b.yaml": (8, "--tokenizer-model tokenizer_dir"),
    "llama_7b_3d.yaml": (32, "--tokenizer-model tokenizer.model"),
    "demo_cpu.yaml": (4, "--tokenizer-model tokenizer.model --save checkpoints"),
}


def test_every_example_is_listed():
    found = {name for name in os.listdir(EXAMPLES) if name.endswith(".yaml")}
    assert found == set(EXAMPLE_RUNS)


@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_examples_parse_and_validate_at_their_world_size(name):
    world_size, extra = EXAMPLE_RUNS[name]
    path = os.path.join(EXAMPLES, name)
    args = parse_args(["--config", path, "--data-path", "corpus_text_document"] + extra.split())
    validate_args(args, world_size)
    layout = layout_from_args(args, world_size)
    assert layout.tensor * layout.pipeline * layout.data == world_size
    assert f"examples/{name}" in open(os.path.join(EXAMPLES, "README.md")).read()
    if name == "llama_7b_3d.yaml":
        assert (layout.tensor, layout.pipeline, layout.data) == (4, 2, 4)
        assert args.use_distributed_optimizer and args.sequence_parallel
    model_config_from_args(args, vocab_size=32000)


def test_help_lists_groups_defaults_and_megalite_additions():
    text = build_parser().format_help()
    for words in ("parallelism:", "checkpoints:", "--initial-loss-scale X", "(default: 4294967296.0)",
                  "--metrics-file STR", "[megalite]", "--no-fused-kernels"):
        assert words in text, words


@pytest.mark.parametrize("argv, message", [
    ("--data-path a --data-path b", "--data-path is given more than once; give it once (it takes several "
                                    "values after one flag)"),
    ("--lr 1e-3 --lr=2e-3", "--lr is given more than once; give it once"),
    ("--bf16 --bf16", "--bf16 is given more than once; give it once"),
    ("--no-fused-kernels --fused-kernels", "--no-fused-kernels and --fused-kernels contradict each other (give one)"),
])
def test_repeated_flags_are_refused(argv, message):
    """argparse would keep the last value silently; Megatron's list flags take several values
    after one flag. The config file may still set what the command line overrides."""
    with pytest.raises(ValueError) as info:
        parse_args("--num-layers 2".split() + argv.split())
    assert str(info.value) == message


def test_uneven_pipeline_stages_with_virtual_stages():
    """The validator splits layers as the model is built (stage_layout): rank 0 holds 4 layers
    in two chunks of 2, rank 1 two chunks of 1, so one chunk holds at most 2 layers."""
    uneven = "--num-layers 6 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 " \
             "--decoder-first-pipeline-num-layers 4 --global-batch-size 4 --recompute-granularity full"
    args = parsed(uneven + " --recompute-num-layers 2", world_size=2)
    assert (args.virtual_pipeline_model_parallel_size, args.pipeline_schedule) == (2, "interleaved_1f1b")
    assert refused(uneven + " --recompute-num-layers 3", 2) == (
        "--recompute-num-layers 3 exceeds the 2 layers of one pipeline stage (model chunk)")
    parsed("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
           "--decoder-last-pipeline-num-layers 2 --global-batch-size 4", world_size=2)
    odd = refused("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                  "--decoder-first-pipeline-num-layers 1 --global-batch-size 4", 2)
    assert "--decoder-first-pipeline-num-layers 1 is not divisible by --num-virtual-stages-per-pipeline-rank 2" \
        in odd
    only_last = refused("--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 4", 2)
    assert "--decoder-last-pipeline-num-layers 4" in only_last and "None" not in only_last
    assert "first" not in only_last, only_last
    assert "--num-virtual-stages-per-pipeline-rank" in refused(
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--decoder-first-pipeline-num-layers 2 --global-batch-size 4", 2)


def _flash_decision(extra: str, *, installed: bool, cuda: bool, world_size: int = 1):
    """validate_args on a machine with or without the flash_attn package and a CUDA device: (args,
    its --use-flash-attn start-up lines, GPTConfig)."""
    import importlib.util

    import torch

    from megalite.config.run_config import startup_notes

    real_find_spec = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if installed else None)
                      if name == "flash_attn" else real_find_spec(name, *a))
        patch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = parsed(extra, world_size)
    lines = [line for line in startup_notes(args, "cuda" if cuda else "cpu") if "--use-flash-attn" in line]
    return args, lines, model_config_from_args(args, 128)


def test_use_flash_attn_package_on_cuda_else_sdpa_with_one_line():
    """--use-flash-attn: flash_attn's kernels where installed on CUDA (no line); else SDPA serves it
    (its flash kernel on CUDA, as --attention-backend flash; its own choice on CPU, as auto) and one
    start-up line says so and what to install. Flash kernels on CUDA refuse fp32 and masks up front."""
    args, lines, config = _flash_decision("--use-flash-attn --bf16", installed=True, cuda=True)
    assert (args.flash_attn_served_by, lines, config.use_flash_attn) == ("flash_attn", [], True)
    args, lines, config = _flash_decision("--use-flash-attn --bf16", installed=False, cuda=True)
    assert args.flash_attn_served_by == "sdpa_cuda" and not config.use_flash_attn
    assert config == _flash_decision("--attention-backend flash --bf16", installed=False, cuda=True)[2]
    assert lines == ["--use-flash-attn: the flash_attn package is not installed, so scaled_dot_product_attention's "
                     "FLASH_ATTENTION kernel serves attention (the same FlashAttention-2 algorithm, as "
                     "--attention-backend flash); flash_attn's own kernels need a CUDA run with the package "
                     "installed (pip install flash-attn)"]
    for installed in (True, False):
        args, lines, config = _flash_decision("--use-flash-attn --bf16", installed=installed, cuda=False)
        assert args.flash_attn_served_by == "sdpa_cpu" and not config.use_flash_attn
        assert config == _flash_decision("--bf16", installed=installed, cuda=False)[2]
        assert len(lines) == 1 and lines[0].startswith("--use-flash-attn: this run is on CPU (no CUDA device)"), lines
        assert "own choice on CPU" in lines[0] and "pip install flash-attn" in lines[0]
    args, lines, _ = _flash_decision("--use-flash-attn --distributed-backend gloo", installed=True, cuda=True)
    assert args.flash_attn_served_by == "sdpa_cpu" and "(--distributed-backend gloo)" in lines[0]
    # an explicit --attention-backend decides where SDPA serves (as in Megatron)
    _, lines, config = _flash_decision("--use-flash-attn --attention-backend unfused", installed=False, cuda=True)
    assert config.attention_backend == "unfused" and "--attention-backend unfused serves attention" in lines[0]
    for installed in (True, False):
        with pytest.raises(ValueError, match=r"^--use-flash-attn needs --bf16 or --fp16 on CUDA"):
            _flash_decision("--use-flash-attn", installed=installed, cuda=True)
        with pytest.raises(ValueError, match=r"^--use-flash-attn and --reset-attention-mask contradict"):
            _flash_decision("--use-flash-attn --bf16 --reset-attention-mask", installed=installed, cuda=True)
    # context parallelism: flash_attn's blocks take no dropout (megalite.parallel.context.flash_blocks); SDPA's do
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        _flash_decision("--use-flash-attn --bf16 --context-parallel-size 2", installed=True, cuda=True, world_size=2)
    assert _flash_decision("--use-flash-attn --bf16 --context-parallel-size 2", installed=False, cuda=True,
                           world_size=2)[2].attention_backend == "flash"


def test_use_flash_attn_on_cpu_computes_as_attention_backend_auto():
    """The CPU model of a --use-flash-attn run (no flash_attn here) trains as the one without it."""
    import importlib.util

    import torch

    from megalite.model.gpt import GPTModel, masked_mean_loss

    assert importlib.util.find_spec("flash_attn") is None, "this test expects flash_attn to be absent here"
    losses = []
    for extra in ("--use-flash-attn --attention-dropout 0 --hidden-dropout 0 --num-layers 2",
                  "--attention-dropout 0 --hidden-dropout 0 --num-layers 2"):
        model = GPTModel(model_config_from_args(parsed(extra, 1), 128), init_seed=3)
        tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
        loss = masked_mean_loss(model(tokens, labels=tokens.roll(-1, 1)), torch.ones(2, 32))
        loss.backward()
        losses.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))


def test_save_interval_without_save_saves_nothing_with_one_line():
    """Megatron (training.py: `if args.save and args.save_interval and ...`) accepts --save-interval
    without --save and saves nothing; megalite says so once at start-up."""
    from megalite.config.run_config import CheckpointConfig, startup_notes

    args = parsed("--save-interval 5", world_size=1)
    assert [n for n in startup_notes(args) if n.startswith("--save-interval")] == [
        "--save-interval 5: no effect without --save (nothing is saved; Megatron accepts it and saves nothing too)"]
    assert CheckpointConfig.from_args(args).save is None
    assert not [n for n in startup_notes(parsed("--save-interval 5 --save /tmp/x", world_size=1))
                if n.startswith("--save-interval")]


def test_flags_megalite_refuses_or_needs_less_for():
    assert refused("--timing-log-level 2") == ("--timing-log-level 2 is not implemented in megalite "
                                               "(supported: 0, 1)")
    evaluate_only = parse_args(drop_flags(BASE, "--train-iters", "--lr") + ["--skip-train"])
    validate_args(evaluate_only, 1)
    assert evaluate_only.total_train_iters == 0 and evaluate_only.lr is None
    assert parsed("--exit-reason-file r.txt --timing-log-level 1").exit_reason_file == "r.txt"
