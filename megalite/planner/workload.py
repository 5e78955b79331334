"""What the planner plans for: a model (GPTConfig), the sequence length, the global batch, the
precision, and the flags that give the same model to `scripts/pretrain_gpt.sh`.

A model comes from megalite's own flag parsing (Megatron flags, or a YAML file through
`--config`), or from a Hugging Face config.json through megalite's HF mapping. Layout flags
(TP, PP, virtual stages, CP, EP, sequence parallelism, recompute, distributed optimizer,
micro-batch size) are the planner's to choose: given among a model's flags they are refused.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace

from megalite.model.config import GPTConfig
from megalite.parallel.pipeline.stage_layout import layers_per_virtual_stage
from megalite.planner.cluster import read_json
from megalite.planner.optimizer import OptimizerSpec, spec_from_args

PRECISIONS = ("bf16", "fp16", "fp32")
# Options the planner chooses; a model's flags or YAML must leave them unset.
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "context_parallel_size", "expert_model_parallel_size",
                 "sequence_parallel", "use_distributed_optimizer", "use_torch_fsdp2", "recompute_granularity", "recompute_activations",
                 "recompute_method", "recompute_num_layers", "micro_batch_size", "pipeline_schedule",
                 "overlap_grad_reduce", "overlap_param_gather", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout")


@dataclass
class Workload:
    config: GPTConfig
    seq_length: int
    global_batch_size: int
    precision: str = "bf16"
    flash_attention: bool = True
    """No s x s attention scores are kept: megalite's scaled_dot_product_attention (flash /
    cuDNN on a GPU, the fused CPU kernel) and flash_attn never store them."""
    model_flags: list = field(default_factory=list)
    """Flags giving this model (and tokenizer) to pretrain_gpt, without layout or batch flags."""
    source: str = ""
    account_for_embedding: bool = False
    """--account-for-embedding-in-pipeline-split among the model's flags."""
    account_for_loss: bool = False
    """--account-for-loss-in-pipeline-split among the model's flags."""
    gradient_accumulation_fusion: bool = True
    """Linear weight gradients accumulated into main_grad inside their GEMM (Megatron's default;
    off with --no-gradient-accumulation-fusion or --torch-compile among the model's flags)."""
    fp8: object = None
    """The Fp8Recipe of --fp8-format among the model's flags (megalite/planner/fp8.py), else None."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """--optimizer and the flags that change its state and step (megalite/planner/optimizer.py)."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        for flag, value in (("--seq-length", self.seq_length), ("--global-batch-size", self.global_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element (formulas.md's table assumes 16-bit)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def is_moe(self) -> bool:
        return self.config.moe is not None

    @property
    def accounts_in_split(self) -> bool:
        return self.account_for_embedding or self.account_for_loss

    def layer_split(self, pp: int, vp: int) -> dict:
        """stage_layers' keyword arguments for this model's layers over `pp` ranks x `vp` virtual
        stages: the split pretrain_gpt and the dry run build, the --account-for-*-in-pipeline-split
        flags applied by the same code (megalite.config.megatron.training). ValueError naming the
        flag where the layers cannot be split so."""
        return _layer_split(self.config.num_layers, pp, vp, self.account_for_embedding, self.account_for_loss)


@lru_cache(maxsize=None)
def _layer_split(num_layers: int, pp: int, vp: int, embedding: bool, loss: bool) -> dict:
    from megalite.config.megatron.training import apply_pipeline_split_accounting, split_accounting

    def fail(message):
        raise ValueError(message)

    args = SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                           num_virtual_stages_per_pipeline_rank=vp if vp > 1 else None,
                           num_layers_per_virtual_pipeline_stage=None, account_for_embedding_in_pipeline_split=embedding,
                           account_for_loss_in_pipeline_split=loss, decoder_first_pipeline_num_layers=None,
                           decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout=None)
    apply_pipeline_split_accounting(args, fail)
    split = {"first_stage_layers": args.decoder_first_pipeline_num_layers,
             "last_stage_layers": args.decoder_last_pipeline_num_layers, **split_accounting(args)}
    layers_per_virtual_stage(num_layers, pp, vp, **split)  # what the run validates
    return split


def _precision_flags(precision: str) -> list[str]:
    return {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[precision]


def from_flags(argv: list[str], seq_length: int | None = None, global_batch_size: int | None = None) -> Workload:
    """A Workload from pretrain_gpt's flags (Megatron names; `--config file.yaml` allowed). The
    vocabulary is the tokenizer's: `--vocab-size` with NullTokenizer, or the tokenizer files."""
    from megalite.config.arguments import model_config_from_args, parse_args
    from megalite.config.fp8 import fp8_recipe_from_args
    from megalite.config.megatron.model import tokenizer_from_args

    args = parse_args(argv)
    defaults = parse_args([])
    chosen = [name for name in LAYOUT_FIELDS if getattr(args, name) != getattr(defaults, name)]
    if chosen:
        raise ValueError(f"the model's flags set {', '.join('--' + n.replace('_', '-') for n in chosen)}: "
                         "the planner chooses the layout; leave them out (or pass them to the planner's own options)")
    args.seq_length = seq_length or args.seq_length
    if args.seq_length is None:
        raise ValueError("--seq-length is required (among the model's flags or the planner's)")
    batch = global_batch_size or args.global_batch_size
    if batch is None:
        raise ValueError("--global-batch-size is required (among the model's flags or the planner's)")
    if args.tokenizer_type is None and not (args.vocab_file and args.merge_file):
        raise ValueError("the model's flags need a tokenizer: --tokenizer-type NullTokenizer --vocab-size N, "
                         "or the tokenizer's files")
    tokenizer = tokenizer_from_args(args, "GPT2BPETokenizer")
    config = model_config_from_args(args, tokenizer.vocab_size)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    flash = args.attention_backend not in ("unfused", "local")
    dropped = {"--seq-length", "--global-batch-size"}
    flags, i = [], 0
    while i < len(argv):  # the model's flags as given, without the two the planner prints itself
        token = argv[i]
        name = token.split("=", 1)[0]
        takes_value = "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if name not in dropped:
            flags += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return Workload(config, args.seq_length, batch, precision, flash, flags, source="flags",
                    account_for_embedding=args.account_for_embedding_in_pipeline_split,
                    account_for_loss=args.account_for_loss_in_pipeline_split,
                    gradient_accumulation_fusion=args.gradient_accumulation_fusion is not False
                    and not args.torch_compile, fp8=fp8_recipe_from_args(args), optimizer=spec_from_args(args))


def from_hf_config(path: str, seq_length: int, global_batch_size: int, precision: str = "bf16") -> Workload:
    """A Workload from a Hugging Face config.json (the architectures megalite converts)."""
    from megalite.convert.hints import model_flags
    from megalite.checkpoint.hf.mapping import config_from_hf

    hf = read_json(path, "--hf-config")
    try:
        config = config_from_hf(hf)
    except ValueError as error:
        raise ValueError(f"--hf-config {path}: {error}") from None
    if seq_length is None or global_batch_size is None:
        raise ValueError("--hf-config needs --seq-length and --global-batch-size")
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    config = config.replace(params_dtype=dtype, max_position_embeddings=max(config.max_position_embeddings, seq_length))
    # the all-to-all dispatcher: the one the planner's expert-parallel model assumes
    printed = config if config.moe is None else config.replace(
        moe=dataclasses.replace(config.moe, token_dispatcher_type="alltoall"))
    flags = [f for f in model_flags(printed) if f not in ("--bf16", "--fp16")]
    i = flags.index("--seq-length")  # model_flags suggests one; the planner prints the real one
    flags = flags[:i] + flags[i + 2:] + _precision_flags(precision)
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1)]
    return Workload(config, seq_length, global_batch_size, precision, True, flags, source=path)
