"""Whether torch can use a CUDA device here: its own module, imported only when the question
is asked, so that discovering the plugin imports no torch."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def _build_info() -> dict[str, object] | None:
    """``torch.version``'s constants read from its source without importing torch, or None
    when they cannot be read that way. A CPU build answers "no CUDA" in milliseconds where
    ``import torch`` takes seconds: a command that runs no model on this machine (``corellm
    bench`` on the simulated executor, ``corellm plugins``) need not pay for that import."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        source = Path(next(iter(spec.submodule_search_locations)), "version.py").read_text()
        values: dict[str, object] = {}
        for node in ast.parse(source).body:
            target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                      else node.target if isinstance(node, ast.AnnAssign) else None)
            if isinstance(target, ast.Name) and node.value is not None:
                values[target.id] = ast.literal_eval(node.value)
        return values if "cuda" in values and "__version__" in values else None
    except (OSError, ValueError, SyntaxError, StopIteration):
        return None


def cuda_problem() -> str | None:
    """Why no CUDA device can be used here, or None."""
    if "torch" not in sys.modules:
        info = _build_info()
        if info is not None and info["cuda"] is None:
            return f"torch was built without CUDA (torch {info['__version__']})"
    import torch

    if torch.version.cuda is None:
        return f"torch was built without CUDA (torch {torch.__version__})"
    if not torch.cuda.is_available():
        return (f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                "check the driver and CUDA_VISIBLE_DEVICES)")
    return None
