"""What every tokenizer module shares, kept apart so that tokenizers.py (which builds them by
type name) and the tokenizer modules it builds do not import each other."""

import importlib


def require_package(module: str, tokenizer_type: str, package: str | None = None):
    """Import an optional dependency, or say which tokenizer needs which pip package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs the '{package or module}' package: "
                         f"pip install {package or module}") from None
