"""`arg()`: a dataclass field that carries its own command-line description.

Every training option is one dataclass field; the argparse parser and the YAML loader are
generated from these fields (megalite/config/arguments.py), so help text, choices and
defaults live in one place.
"""

from dataclasses import MISSING, field

MEGALITE = "megalite"  # marks options megalite adds to Megatron's


def arg(
    default=None,
    help: str = "",
    *,
    choices: tuple | None = None,
    unsupported: tuple = (),
    flag: str | None = None,
    negative_flag: str | None = None,
    origin: str = "megatron",
    cli: bool = True,
):
    """A dataclass field describing one command-line option.

    default:       Megatron's default (None means "not set").
    choices:       values argparse accepts; `unsupported` ones are accepted by the parser
                   (they are Megatron's) but refused by validate_args with a message naming
                   the flag.
    flag:          the option string when it is not `--` + the field name with dashes.
    negative_flag: a second option that stores False (tri-state booleans such as
                   --fused-kernels / --no-fused-kernels).
    origin:        "megatron" or MEGALITE, shown in --help.
    cli:           False for values derived by validate_args (not settable by the user).
    """
    metadata = {
        "help": help,
        "choices": choices,
        "unsupported": tuple(unsupported),
        "flag": flag,
        "negative_flag": negative_flag,
        "origin": origin,
        "cli": cli,
    }
    return field(default=default if default is not MISSING else None, metadata=metadata)


def flag_of(f) -> str:
    """The option string of a dataclass field made by `arg()`."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def on_cpu(args) -> bool:
    """Whether the run computes on CPU (gloo, or no CUDA device)."""
    import torch

    return args.distributed_backend == "gloo" or not torch.cuda.is_available()
