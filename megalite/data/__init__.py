"""Data: Megatron indexed datasets, tokenizers, preprocessing, GPT samples, blending, loading.

    from megalite.data import build_gpt_datasets, build_data_iterator
    from megalite.data.tokenizers import build_tokenizer

Names are imported on first use, so tools that only preprocess never import torch.
"""

import importlib

_EXPORTS = {
    "BlendedDataset": "blending", "blend_indices": "blending", "parse_data_path": "blending",
    "build_gpt_datasets": "builder", "megatron_num_samples": "builder",
    "GPTDataset": "gpt_dataset", "MockIndexedDataset": "gpt_dataset",
    "IndexedDataset": "indexed_dataset", "IndexedDatasetWriter": "indexed_dataset",
    "dtype_for_vocab": "indexed_dataset", "merge_datasets": "indexed_dataset",
    "PretrainingSampler": "loader", "build_data_iterator": "loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
