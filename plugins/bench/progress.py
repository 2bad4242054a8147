"""Progress and diagnostics of a benchmark, on stderr (tables and results go to stdout)."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    """Progress and diagnostics go to stderr; tables go to stdout."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar of requests on stderr, cleared when it closes."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, leave=False)
