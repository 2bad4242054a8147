"""Whether torch can use a CUDA device here: its own module, imported only when the question
is asked, so that discovering the plugin imports no torch."""

from __future__ import annotations

import torch


def cuda_problem() -> str | None:
    """Why no CUDA device can be used here, or None."""
    if torch.version.cuda is None:
        return f"torch was built without CUDA (torch {torch.__version__})"
    if not torch.cuda.is_available():
        return (f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                "check the driver and CUDA_VISIBLE_DEVICES)")
    return None
