"""Checkpoint conversion: Hugging Face GPT-2 / Llama <-> megalite, and megalite between parallel
layouts, offline on CPU and one tensor at a time.

    from megalite.convert import TargetLayout, hf_to_megalite, megalite_to_hf, megalite_to_megalite

The command line is tools/checkpoint/convert.py (megalite/convert/cli.py).
"""

from megalite.convert.converters import Summary, hf_to_megalite, megalite_to_hf, megalite_to_megalite
from megalite.convert.publish import ConversionError
from megalite.convert.target_layout import TargetLayout

__all__ = ["ConversionError", "Summary", "TargetLayout", "hf_to_megalite", "megalite_to_hf", "megalite_to_megalite"]
