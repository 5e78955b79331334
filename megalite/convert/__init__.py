"""Checkpoint conversion between formats, offline on CPU and one tensor at a time: Hugging Face
<-> megalite, megalite between parallel layouts, Megatron-LM -> megalite or Hugging Face. The
formats themselves (readers, writers, name mappings) live in megalite.checkpoint; this package
holds the conversions and their command line (tools/checkpoint/convert.py, megalite/convert/cli.py).

    from megalite.convert import TargetLayout, hf_to_megalite, megalite_to_hf, megalite_to_megalite
"""

from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.dcp.target_layout import TargetLayout
from megalite.convert.converters import Summary, hf_to_megalite, megalite_to_hf, megalite_to_megalite

__all__ = ["ConversionError", "Summary", "TargetLayout", "hf_to_megalite", "megalite_to_hf", "megalite_to_megalite"]
