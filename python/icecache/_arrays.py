"""Array conversions at the boundary of the Rust core (imported by the extension)."""

import sys

import numpy as np


def as_numpy(x):
    """A NumPy view of ``x``: arrays as they are, CPU torch tensors without a copy (bfloat16
    as its ``uint16`` bits), anything else through ``np.asarray``."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"tensor must be on the CPU, got device {x.device}")
        if x.dtype == torch.bfloat16:
            x = x.view(torch.uint16)
        return x.detach().numpy()
    return np.asarray(x)
