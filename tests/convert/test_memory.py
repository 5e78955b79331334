"""Conversion streams tensor by tensor: converting a model many times bigger than its largest
tensor raises the converter's peak resident memory by a few largest tensors, not the model.

Each conversion runs in a fresh process that imports everything, resets its peak-RSS counter
(/proc/self/clear_refs) and reports VmHWM - VmRSS after the conversion. Tensor memory is
allocated outside Python's allocator, so tracemalloc would not see it; RSS does.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.hf.safetensors_io import SafetensorsWriter

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20

MEASURE = r"""
import json, sys
import torch
import torch._dynamo  # torch imports its compiler on the first call of some functions (~100 MiB of code, not tensors)
from megalite.convert.cli import main

torch.set_num_threads(1)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

base = status("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
except OSError:
    pass
code = main(sys.argv[1:])
print(json.dumps({"code": code, "base": base, "peak": status("VmHWM")}))
"""


def write_llama(directory: Path, layers=24, hidden=512, ffn=1024, vocab=2048) -> tuple[int, int]:
    """A LlamaForCausalLM directory with random weights (GQA 8/4 heads), two safetensors
    shards; returns (total bytes, bytes of the largest megalite tensor: the embedding or the
    fused [gate; up] projection)."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=ffn, vocab_size=vocab,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    with torch.device("meta"):
        state = transformers.LlamaForCausalLM(config).state_dict()
    specs = [(n, tuple(t.shape), torch.float32) for n, t in state.items()]
    directory.mkdir()
    config.save_pretrained(directory)
    half = len(specs) // 2
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for i, shard in enumerate((specs[:half], specs[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        writer = SafetensorsWriter(directory / name, shard)
        for tensor_name, shape, _ in shard:
            writer.write(tensor_name, torch.randn(shape, generator=g) * 0.02)
            weight_map[tensor_name] = name
        writer.close()
    sizes = [torch.Size(s).numel() * 4 for _, s, _ in specs]
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    return sum(sizes), 4 * max(vocab * hidden, 2 * ffn * hidden)


def measure(*argv) -> int:
    proc = subprocess.run([sys.executable, "-c", MEASURE, *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, proc.stderr[-2000:]
    return result["peak"] - result["base"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_memory_stays_near_the_largest_tensor(tmp_path):
    total, largest = write_llama(tmp_path / "hf")
    assert total >= 50 * largest
    to_megalite = measure("--loader", "hf", "--saver", "megalite", "--load-dir", tmp_path / "hf",
                          "--save-dir", tmp_path / "ml", "--target-tensor-parallel-size", 2,
                          "--target-pipeline-parallel-size", 2)
    to_hf = measure("--loader", "megalite", "--saver", "hf", "--load-dir", tmp_path / "ml", "--save-dir",
                    tmp_path / "back", "--max-shard-size", "40MB")
    bound = 4 * largest + 16 * MIB
    print(f"model {total / MIB:.0f} MiB, largest tensor {largest / MIB:.0f} MiB; peak RSS increase "
          f"HF->megalite {to_megalite / MIB:.1f} MiB, megalite->HF {to_hf / MIB:.1f} MiB (bound {bound / MIB:.0f} MiB)")
    for what, increase in (("HF->megalite", to_megalite), ("megalite->HF", to_hf)):
        assert increase < min(bound, total / 8), \
            f"{what}: peak +{increase / MIB:.1f} MiB for a {total / MIB:.0f} MiB model"
