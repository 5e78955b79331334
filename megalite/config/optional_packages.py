"""The optional packages (setup.py's extras) that flags need, checked with the run's options,
before any data or model is built: on a base install (`pip install -e .`) a run given
--tensorboard-dir stops at once with one line naming the flag and the extra to install, instead
of every rank failing after preparing its data and building its model.

(--use-flash-attn's flash_attn, which no extra installs, is checked in validate.py.)
"""

import importlib.util

# (flag as the message names it, option, the value that needs the package or None for any
# value given, the module to find, the extra of setup.py that installs it)
FLAG_PACKAGES = (
    ("--tensorboard-dir", "tensorboard_dir", None, "tensorboard", "tensorboard"),
    ("--wandb-project", "wandb_project", None, "wandb", "wandb"),
    ("--tokenizer-type HuggingFaceTokenizer", "tokenizer_type", "HuggingFaceTokenizer", "tokenizers", "tokenizers"),
    ("--tokenizer-type TikTokenizer", "tokenizer_type", "TikTokenizer", "tiktoken", "tokenizers"),
    ("--quantize", "quantize", None, "torchao", "quantize"),  # tools/generate.py
)


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module left without a spec
        return False


def check_optional_packages(args) -> None:
    """Raises ValueError, one line, for the first flag whose optional package is not installed."""
    for flag, option, value, module, extra in FLAG_PACKAGES:
        given = getattr(args, option, None)
        if (given if value is None else given == value) and not installed(module):
            raise ValueError(f'{flag} needs {module}, which is not installed: pip install -e ".[{extra}]" '
                             f"(or pip install {module})")
