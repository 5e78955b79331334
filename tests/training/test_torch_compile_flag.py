"""--torch-compile in the driver: build_run compiles every region of every chunk through
GPTModel.compile_regions (the benchmark's compile rows call the same method), and training
then gives the eager run's losses. The backend is aot_eager here; inductor's C++ compile of
the same regions is covered by the slow tests of tests/model/test_model_torch_compile.py."""

import pytest

from megalite.model.gpt import GPTModel
from tests.training.test_cuda_graphs import _train


def test_torch_compile_compiles_every_region_in_the_driver(monkeypatch):
    reference, _ = _train(monkeypatch, [], iters=3)
    compiled_chunks = []
    real = GPTModel.compile_regions

    def compile_regions(model, **kwargs):
        compiled_chunks.append(model)
        real(model, backend="aot_eager", **kwargs)  # inductor's C++ compile is the slow tests'
    monkeypatch.setattr(GPTModel, "compile_regions", compile_regions)
    losses, run = _train(monkeypatch, ["--torch-compile"], iters=3)
    assert compiled_chunks == run.models
    model = run.models[0]
    assert model._compiled_head is not None and model.embedding._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert losses == pytest.approx(reference, rel=1e-5)
