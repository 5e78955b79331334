"""Command line and YAML config of a training run, generated from one dataclass.

    args = parse_args(argv)            # defaults < --config FILE < command line
    validate_args(args, world_size)    # before any process group
    layout = layout_from_args(args, world_size)
    config = model_config_from_args(args, vocab_size)

Flag names and defaults are Megatron-LM's (see shared/docs/flags.md); every option is a field
of `Arguments` whose metadata carries its help text. Parse errors, unknown flags or YAML keys
and contradictions raise ValueError with one line naming them.
"""

import argparse
import difflib
import re
import sys
import typing
from dataclasses import asdict, dataclass, fields

import yaml

from megalite.model.config import GPTConfig
from megalite.config.context import ContextArgs, cp_a2a_size_of, cp_comm_type_of
from megalite.config.dist_opt import DistOptArgs
from megalite.config.dry_run import DryRunArgs
from megalite.config.field import MEGALITE, arg, flag_of
from megalite.config.flash_attn import uses_flash_attn_package
from megalite.config.fp8 import Fp8Args
from megalite.config.megatron.data import MegatronDataArgs
from megalite.config.megatron.fim import MegatronFimArgs
from megalite.config.megatron.engine import MegatronEngineArgs, offload_model_fields
from megalite.config.megatron.logs import MegatronLoggingArgs
from megalite.config.megatron.model import MegatronModelArgs, megatron_model_fields, mlp_activation
from megalite.config.megatron.training import MegatronTrainingArgs
from megalite.config.model import ModelArgs, ParallelArgs, PrecisionArgs, RecomputeArgs, recompute_modules_of
from megalite.config.megatron.checkpoint import MegatronCheckpointArgs
from megalite.config.gdn import GDNArgs, gdn_model_fields
from megalite.config.mla import MLAArgs, mla_model_fields
from megalite.config.moe import MoEArgs, moe_config_from_args
from megalite.config.mup import MupArgs, mup_model_fields
from megalite.config.muon import MuonArgs
from megalite.config.run import (CheckpointArgs, DataArgs, DerivedArgs, LoggingArgs,
                                             TrainingArgs)
from megalite.config.validate import (default_ffn_hidden_size, layout_from_args,
                                                  validate_args)

__all__ = ["Arguments", "build_parser", "load_config_file", "parse_args", "validate_args",
           "layout_from_args", "model_config_from_args"]


@dataclass
class Arguments(ParallelArgs, ContextArgs, MoEArgs, MLAArgs, GDNArgs, ModelArgs, MegatronModelArgs, Fp8Args, MupArgs, RecomputeArgs,
                PrecisionArgs, TrainingArgs, DataArgs, LoggingArgs, CheckpointArgs, MegatronCheckpointArgs, MegatronTrainingArgs,
                MegatronDataArgs, MegatronFimArgs, MegatronLoggingArgs, DistOptArgs, DryRunArgs, MuonArgs, DerivedArgs,
                MegatronEngineArgs):
    """Every option of a training run (snake_case of Megatron's flag names)."""

    config: str | None = arg(
        None, "YAML file of options (same names, dashes or underscores); the command line wins.",
        origin=MEGALITE)

    def to_dict(self) -> dict:
        """Plain values (str, int, float, bool, None, lists of str), e.g. for a checkpoint."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Arguments":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown argument names: {', '.join(unknown)}")
        return cls(**values)


_GROUPS = (
    ("config file", None), ("model", ModelArgs), ("Megatron model, fusion and tokenizer flags", MegatronModelArgs),
    ("FP8 training", Fp8Args),
    ("maximal update parameterisation (muP)", MupArgs), ("parallelism", ParallelArgs),
    ("context parallelism", ContextArgs), ("mixture of experts", MoEArgs),
    ("multi-latent attention and multi-token prediction", MLAArgs),
    ("Gated DeltaNet linear attention and gated attention", GDNArgs),
    ("recompute", RecomputeArgs), ("precision", PrecisionArgs),
    ("batch, schedule and optimizer", TrainingArgs), ("Muon optimizer", MuonArgs), ("data and tokenizer", DataArgs),
    ("logging", LoggingArgs), ("checkpoints", CheckpointArgs),
    ("Megatron training loop", MegatronTrainingArgs), ("Megatron data", MegatronDataArgs),
    ("fill-in-the-middle samples", MegatronFimArgs),
    ("Megatron logging", MegatronLoggingArgs),
    ("checkpoints (Megatron formats and policies)", MegatronCheckpointArgs),
    ("distributed optimizer, Megatron-FSDP and tensor-parallel overlap", DistOptArgs),
    ("shard initialisation and dry runs", DryRunArgs),
    ("Megatron fusions, Transformer Engine switches, MoE communication schedules", MegatronEngineArgs),
)
_HINTS = typing.get_type_hints(Arguments)
_METAVARS = {int: "N", float: "X", str: "STR"}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _kind(name: str) -> tuple[str, type | None]:
    """('bool' | 'tristate' | 'list' | 'scalar', scalar type) of a field."""
    hint = _HINTS[name]
    members = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    base = members[0]
    if base is bool:
        return ("tristate" if hint is not bool else "bool"), bool
    if typing.get_origin(base) is list:
        return "list", str
    return "scalar", base


NEGATIVE_NUMBER = re.compile(r"^-(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)([eE][-+]?\d+)?$")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `parser` read negative numbers in every notation (-1e-3, -.5, -1_000) as values, as
    it reads -0.001: argparse before Python 3.14 knows only -N and -N.N and takes `--lr -1e-3`
    for two flags ("expected one argument"). Sets argparse's own (private) matcher, before any
    option is added; Python 3.14's matches these already."""
    parser._negative_number_matcher = NEGATIVE_NUMBER
    return parser


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        accept_negative_numbers(self)
        self.given_flags = {}  # dest -> the option string that set it

    def error(self, message):
        raise ValueError(message)


class _Once(argparse.Action):
    """Stores an option's value, refusing a second occurrence: argparse would silently keep
    the last (`--data-path a --data-path b` gives ['b']; Megatron's list flags take every
    value after one flag). A switch and its negative form given together contradict."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = parser.given_flags.get(self.dest)
        if earlier == option_string:
            several = " (it takes several values after one flag)" if self.nargs == "+" else ""
            raise ValueError(f"{option_string} is given more than once; give it once{several}")
        if earlier is not None:
            raise ValueError(f"{earlier} and {option_string} contradict each other (give one)")
        parser.given_flags[self.dest] = option_string
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _help(f) -> str:
    text = f.metadata["help"]
    if f.default not in (None, False):
        text += f" (default: {f.default})"
    if f.metadata["origin"] == MEGALITE:
        text += " [megalite]"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every option; unset options are absent from its namespace."""
    parser = _Parser(prog="python -m megalite.pretrain_gpt", allow_abbrev=False,
                     argument_default=argparse.SUPPRESS,
                     description="Pretrain a GPT with Megatron-LM's flag names.")
    config_field = next(f for f in fields(Arguments) if f.name == "config")
    for title, cls in _GROUPS:
        group = parser.add_argument_group(title)
        for f in fields(cls) if cls else [config_field]:
            kind, base = _kind(f.name)
            options = {"dest": f.name, "help": _help(f)}
            if kind in ("bool", "tristate"):
                group.add_argument(flag_of(f), action=_Once, nargs=0, const=True, **options)
            if kind == "tristate":
                group.add_argument(f.metadata["negative_flag"], action=_Once, nargs=0, const=False,
                                   dest=f.name, help=f"Turn {flag_of(f)} off.")
            elif kind == "list":
                group.add_argument(flag_of(f), action=_Once, nargs="+", metavar="VALUE", **options)
            elif kind == "scalar":
                metavar = None if f.metadata["choices"] else _METAVARS[base]
                group.add_argument(flag_of(f), action=_Once, type=base, choices=f.metadata["choices"],
                                   metavar=metavar, **options)
    return parser


def _cli_fields() -> dict:
    return {f.name: f for f in fields(Arguments) if f.metadata["cli"] and f.name != "config"}


def _suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _coerce(f, value, where: str):
    """A YAML value converted to the field's type, or a ValueError naming `where`."""
    kind, base = _kind(f.name)
    if value is None:
        if f.default is None and kind != "bool":
            return None
        raise ValueError(f"{where}: expected a value, got null")
    if kind in ("bool", "tristate"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind == "list":
        if isinstance(value, str):
            return value.split()
        if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
            return [str(v) for v in value]
        raise ValueError(f"{where}: expected a list or a space-separated string, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: expected {_TYPE_NAMES[base]}, got {value!r}")
    try:
        if base is int and isinstance(value, float):
            raise ValueError
        converted = base(value)
    except ValueError:
        raise ValueError(f"{where}: expected {_TYPE_NAMES[base]}, got {value!r}") from None
    choices = f.metadata["choices"]
    if choices and converted not in choices:
        raise ValueError(f"{where}: {converted!r} is not one of {', '.join(map(str, choices))}")
    return converted


def load_config_file(path: str) -> dict:
    """Options from a YAML mapping of flag names (dashes or underscores) to values."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ValueError(f"{path}{line}: not valid YAML ({getattr(error, 'problem', error)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values, "
                         f"got a {type(data).__name__}")
    known = _cli_fields()
    negatives = {f.metadata["negative_flag"][2:].replace("-", "_"): f
                 for f in known.values() if f.metadata["negative_flag"]}
    values, origin = {}, {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        where = f"{path}: key '{key}'"
        if name in negatives:
            if value is not True:
                raise ValueError(f"{where}: expected true, got {value!r}")
            name, value = negatives[name].name, False
        elif name not in known:
            raise ValueError(f"{path}: unknown key '{key}'{_suggest(name, known)}")
        else:
            value = _coerce(known[name], value, where)
        if name in values:
            raise ValueError(f"{path}: keys '{origin[name]}' and '{key}' set the same option")
        values[name], origin[name] = value, key
    return values


def parse_args(argv: list[str] | None = None) -> Arguments:
    """Options from `argv` (default sys.argv[1:]) over --config's YAML over Megatron's defaults.

    Raises ValueError naming an unknown or repeated flag, a bad value or an unknown YAML key."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [token for token in unknown if token.startswith("-")] or unknown
        options = [s for action in parser._actions for s in action.option_strings]
        hint = _suggest(flags[0].split("=")[0], options)
        raise ValueError(f"unknown argument{'s' if len(flags) > 1 else ''}: {' '.join(flags)}{hint}")
    given = vars(namespace)
    values = load_config_file(given["config"]) if given.get("config") else {}
    values.update(given)
    return Arguments(**values)


def model_config_from_args(args, vocab_size: int) -> GPTConfig:
    """The GPTConfig these options describe, for a tokenizer of `vocab_size` tokens."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required")
    activation = mlp_activation(args)
    granularity = "selective" if args.recompute_activations else args.recompute_granularity
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        ffn_hidden_size=default_ffn_hidden_size(args),
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        activation=activation,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        recompute_granularity=granularity,
        recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=recompute_modules_of(args),
        label_smoothing=args.label_smoothing,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        fused_kernels=args.fused_kernels,
        use_flash_attn=uses_flash_attn_package(args),
        params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        **megatron_model_fields(args),
        **mup_model_fields(args, args.kv_channels or args.hidden_size // args.num_attention_heads),
        moe=moe_config_from_args(args, default_ffn_hidden_size(args)),
        cp_comm_type=cp_comm_type_of(args),
        cp_a2a_size=cp_a2a_size_of(args),
        **mla_model_fields(args),
        **gdn_model_fields(args),
        **offload_model_fields(args),
    )
