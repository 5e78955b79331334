from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style GPT pretraining in plain PyTorch: TP, SP, PP, DP and ZeRO, testable on a CPU.",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megalite", "megalite.*"]),
    install_requires=[
        # A range here; CPU install commands in the README pin torch==2.13.0 so that pip
        # does not pull the CUDA build on machines without a GPU.
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "regex",  # GPT-2 BPE pre-tokenisation
        "sentencepiece",
    ],
    extras_require={
        "gpu": ["triton"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "hf": ["transformers", "safetensors", "tokenizers"],
        "tokenizers": ["tokenizers", "tiktoken", "protobuf"],
        "plot": ["matplotlib"],
        # Gated DeltaNet's chunked rule as flash-linear-attention's Triton kernels on CUDA
        # (megalite/kernels/gated_delta_fla.py): fla-core requires einops only, torch and triton
        # are its own extras, so it keeps the installed torch
        "gdn": ["fla-core==0.6.0"],
        "quantize": ["torchao==0.18.0"],  # tools/generate.py --quantize int8|int4 (install with --no-deps: keeps your torch)
        "data": ["pyarrow", "zstandard"],  # Parquet and .zst inputs to tools/preprocess_data.py
        "gigatoken": ["gigatoken>=0.10.0"],  # faster tokenisation in preprocessing, ids checked at start-up
        "dev": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",  # python -m pytest tests -n 2: tests/xdist_scheduling.py
            "transformers",
            "safetensors",
            "tokenizers",
            "tiktoken",
            "protobuf",
            "triton",
            "megatron-core",
            # Megatron-Core's Muon needs it (tests/optimizer/muon_oracle.py); it declares Python >= 3.12:
            # on 3.11, pip install --no-deps --ignore-requires-python emerging-optimizers==0.3.0
            "emerging-optimizers==0.3.0; python_version >= '3.12'",
            "absl-py",
            "typing_extensions",
            "matplotlib",
            "tensorboard",
            "wandb",
            "psutil",
            "pyarrow",
            "zstandard",
            "gigatoken>=0.10.0",
            "torchao==0.18.0",
        ],
    },
)
