"""The measured table impl="auto" consults on a CUDA GPU (megalite/kernels/speed_table.py):
Triton unless a measurement on that GPU class found the torch reference faster for that op and
shape class; bench_kernels.py writes it."""

import importlib.util
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from megalite.kernels import dispatch, speed_table

ROOT = Path(__file__).resolve().parents[2]


def _cuda_tensor(*shape):
    """What use_triton reads of a CUDA tensor (is_cuda, shape, device), on a machine without one."""
    return SimpleNamespace(is_cuda=True, shape=shape, device=torch.device("cuda", 0))


def test_shape_class_is_the_tile_width():
    assert speed_table.shape_class("rms_norm", 4096) == "rms_norm:4096"
    assert speed_table.shape_class("rms_norm", 4000) == "rms_norm:4096"
    assert speed_table.shape_class("cross_entropy", 50257) == "cross_entropy:65536"
    assert speed_table.shape_class("swiglu", 1) == "swiglu:1"


def test_auto_follows_the_table(monkeypatch):
    monkeypatch.setattr(speed_table, "MEASURED", {"sm90-132sm": {"layer_norm:4096": "torch",
                                                                 "rms_norm:4096": "triton"}})
    monkeypatch.setattr(speed_table, "_cached_gpu_class", lambda index: "sm90-132sm")
    x = _cuda_tensor(16, 4096)
    assert dispatch.use_triton("layer_norm", "auto", x, None) is False
    assert dispatch.use_triton("rms_norm", "auto", x, None) is True
    assert dispatch.use_triton("layer_norm", "auto", _cuda_tensor(16, 8192), None) is True  # not measured: Triton
    assert dispatch.use_triton("layer_norm", "triton", x, None) is True  # an explicit impl is obeyed
    monkeypatch.setattr(speed_table, "_cached_gpu_class", lambda index: "sm80-108sm")
    assert dispatch.use_triton("layer_norm", "auto", x, None) is True  # another GPU class


def test_an_empty_table_asks_nothing_of_the_device(monkeypatch):
    monkeypatch.setattr(speed_table, "MEASURED", {})
    monkeypatch.setattr(speed_table, "_cached_gpu_class", lambda index: 1 / 0)
    assert speed_table.prefers_torch("rms_norm", _cuda_tensor(4, 4096)) is False


def test_rewrite_keeps_other_gpus_and_the_module_loads(tmp_path):
    path = tmp_path / "speed_table.py"
    shutil.copy(ROOT / "megalite" / "kernels" / "speed_table.py", path)
    speed_table.rewrite(str(path), "sm90-132sm", {"rms_norm:4096": "triton", "layer_norm:4096": "torch"})
    speed_table.rewrite(str(path), "sm80-108sm", {"rms_norm:4096": "torch"})
    speed_table.rewrite(str(path), "sm90-132sm", {"layer_norm:4096": "triton"})
    spec = importlib.util.spec_from_file_location("written_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.MEASURED == {"sm80-108sm": {"rms_norm:4096": "torch"}, "sm90-132sm": {"layer_norm:4096": "triton"}}
    assert not list(tmp_path.glob("*.tmp"))


def test_bench_verdicts_pick_the_faster_forward_plus_backward():
    sys.path.insert(0, str(ROOT / "tools" / "benchmarks"))
    try:
        import bench_kernels
    finally:
        sys.path.remove(str(ROOT / "tools" / "benchmarks"))
    rows = [dict(table_key="rms_norm:4096", impl="triton", total_ms=0.05),
            dict(table_key="rms_norm:4096", impl="torch reference", total_ms=0.2),
            dict(table_key="rms_norm:4096", impl="F.rms_norm (bf16)", total_ms=0.01),
            dict(table_key="layer_norm:4096", impl="triton", total_ms=0.3),
            dict(table_key="layer_norm:4096", impl="torch reference", total_ms=0.2)]
    assert bench_kernels.verdicts(rows) == {"rms_norm:4096": "triton", "layer_norm:4096": "torch"}


def test_the_lookup_compiles_into_a_full_graph(monkeypatch):
    """Dynamo traces use_triton: with a table in force, the GPU class lookup is a constant of the
    graph, not a graph break (torch.compile(fullgraph=True) of a model must still capture it)."""
    monkeypatch.setattr(speed_table, "MEASURED", {"sm90-132sm": {"layer_norm:16": "torch"}})
    props = SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    speed_table._gpu_class_of.cache_clear()
    try:
        def pick(x):
            return x * 2 if speed_table.prefers_torch("layer_norm", x) else x * 3
        x = torch.ones(4, 16)
        assert torch.equal(torch.compile(pick, backend="eager", fullgraph=True)(x), x * 2)
    finally:
        speed_table._gpu_class_of.cache_clear()
