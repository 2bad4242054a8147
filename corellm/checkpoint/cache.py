"""corellm's on-disk cache (``$CORELLM_CACHE``, default ``~/.cache/corellm``).

Things that are expensive to derive and never change for the same input (the demo checkpoint,
a GGUF file's parsed metadata and converted tokenizer) are built once, into a temporary sibling
directory, and renamed into place: concurrent processes (the API server and its engine core
start together) wait for one builder on a file lock instead of building twice, and a build
interrupted halfway leaves nothing a later run would mistake for complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from corellm.errors import CorellmError

COMPLETE = ".complete"


def cache_dir() -> Path:
    root = os.environ.get("CORELLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "corellm")
    return Path(root)


def build_once(target: Path, build: Callable[[Path], None], message: str) -> Path:
    """Return ``target``, running ``build(tmpdir)`` first if no complete copy exists.

    ``message`` is printed to stderr when this process builds (first use only).
    """
    marker = target / COMPLETE
    if marker.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "w")
    except OSError as exc:
        raise CorellmError(f"cannot write corellm's cache in {target.parent} ({exc}); set "
                           "CORELLM_CACHE to a writable directory") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():               # another process built it while we waited
            return target
        print(f"corellm: {message} (first use only)...", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            (tmp / COMPLETE).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return target
