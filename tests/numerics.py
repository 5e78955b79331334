"""Tolerance helpers shared by the tests: errors are relative to the reference's largest
magnitude (max|a - b| / max|b|), the usual measure for comparing parallel and serial runs."""

import torch


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def assert_rel_close(actual, expected, tol: float, what: str = "") -> None:
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
