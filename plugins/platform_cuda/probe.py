"""Whether torch can use a CUDA device here (imported only when the question is asked)."""

from __future__ import annotations

import torch


def cuda_problem() -> str | None:
    """Why no CUDA device can be used here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)"
    return None
