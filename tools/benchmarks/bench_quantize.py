"""Weight memory and perplexity of a checkpoint's model with its weights in bf16, INT8 and INT4
(tools/generate.py --quantize; torchao weight-only on the attention and MLP linears), on held-out
tokens of a Megatron .bin/.idx corpus:

    python tools/benchmarks/bench_quantize.py --load /tmp/megalite-demo/checkpoints \\
        --data-path /tmp/megalite-demo/data/demo_text_document

(after `bash scripts/pretrain_gpt.sh`, the demo). The tokens are the last --documents documents of
the corpus file (the demo's split 98,1,1 gives the last 1% of documents, ~10, to its test set),
cut into windows of the model's max_position_embeddings; perplexity is exp of the mean next-token
cross-entropy over them. Every mode runs the same model cast to bf16 (activations bf16), then
quantized; fp32 is printed beside as the checkpoint's own precision. A mode that cannot run here
(int4 without CUDA) prints its one refusal line instead of a row.
"""

import argparse
import datetime
import math
import platform
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.inference.generate import load_model  # noqa: E402
from megalite.inference.quantize import check_quantize, quantize_weights, quantized_linears, tensor_bytes, weight_bytes  # noqa: E402

MODES = ("fp32", "bf16", "int8", "int4")


def held_out_windows(prefix: str, documents: int, length: int) -> torch.Tensor:
    """[n, length + 1] windows of the last `documents` documents' tokens, concatenated."""
    dataset = IndexedDataset(prefix)
    last = range(len(dataset) - documents, len(dataset))
    tokens = torch.from_numpy(np.concatenate([dataset[i] for i in last]).astype(np.int64))
    n = (tokens.numel() - 1) // length
    return torch.stack([tokens[i * length: i * length + length + 1] for i in range(n)])


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int) -> float:
    vocab = model.config.vocab_size
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch):
        chunk = windows[start:start + batch].to(next(model.parameters()).device)
        logits = model(chunk[:, :-1])[..., :vocab].float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="megalite checkpoint directory")
    p.add_argument("--data-path", required=True, help="prefix of the .bin/.idx corpus")
    p.add_argument("--documents", type=int, default=10, help="the corpus's last documents to score")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(args.load, device=device)
    windows = held_out_windows(args.data_path, args.documents, model.config.max_position_embeddings)
    print(f"# {datetime.date.today()} {platform.node()} {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}"
          f", torch {torch.__version__}; {windows.numel()} tokens in {windows.shape[0]} windows")
    print("| weights | weight memory (MiB) | of which attention + MLP linears (MiB) | perplexity |\n|---|---|---|---|")
    for mode in args.modes:
        quantize = mode if mode.startswith("int") else None
        try:
            check_quantize(quantize, device, 1)
        except ValueError as refusal:
            print(f"| {mode} | {refusal} | | |")
            continue
        model, _ = load_model(args.load, device=device)
        if mode != "fp32":
            model.to(torch.bfloat16)
        if quantize:
            quantize_weights(model, quantize)
        linears = sum(tensor_bytes(m.weight) for _, m in quantized_linears(model))
        print(f"| {mode} | {weight_bytes(model) / 2**20:.3f} | {linears / 2**20:.3f} | {perplexity(model, windows, args.batch):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
