"""fla's l2norm (x / sqrt(sum(x^2) + eps) over the last dim) in plain torch: see fla/__init__.py."""

from megalite.kernels.gated_delta import l2norm as _l2norm


def l2norm(x, eps: float = 1e-6, output_dtype=None):
    out = _l2norm(x, eps)
    return out if output_dtype is None else out.to(output_dtype)
