"""Native (C) kernels for the CPU, compiled on first use and loaded with ctypes.

A plugin ships its kernel as C source with plain pointer arguments (no torch headers, so a
build takes about a second rather than the minute a torch extension takes) and asks the CPU
platform for it (``Platform.native_library``, which calls ``load_library``). The platform's C
headers (``csrc/``: the register-blocked micro-kernel of its GEMM, ``corellm_tile.h``, and the
one bf16 conversion every kernel uses, ``corellm_bf16.h``) are on every build's include path, so
a plugin's kernel reuses them rather than copying them. The library is compiled for the machine it runs on
(``-march=native``) and cached under ``~/.cache/corellm/native`` (``XDG_CACHE_HOME``), keyed by
the source, the flags, the compiler's version and the CPU's model and feature flags, so a
cache shared between different machines never hands one a library built for another. The
build writes to a temporary file and renames it, so processes that build at once (the ranks of
a tensor-parallel group) do not read each other's half-written file.

The library links the OpenMP runtime that torch has already loaded (``libgomp``, matched by its
soname), so a kernel's ``omp parallel`` shares torch's thread pool rather than adding one.

Compiling and linking are two steps, and ``flags`` go to the compile step only: linking a shared
library with ``-ffast-math`` (GCC before 13) adds ``crtfastmath.o``, whose constructor sets the
CPU's flush-to-zero and denormals-are-zero modes for the whole process when the library is
loaded, which would change every float computation of the program (torch's included) and was
caught by Hypothesis refusing to run. A kernel may use ``-ffast-math`` for its own code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

from corellm.platforms import NativeUnavailable

logger = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp")
# Headers the platform shares with every native library (``#include "corellm_tile.h"``): on
# the include path of each build, and part of each build's cache key.
INCLUDE_DIR = Path(__file__).with_name("csrc")
LINK_FLAGS = ("-shared", "-fPIC", "-fopenmp")


class NativeBuildError(NativeUnavailable):
    """A native library could not be built or loaded (no compiler, a compile error)."""


def machine_key() -> str:
    """The CPU (model name and feature flags) and torch build a measurement holds for."""
    model, flags = platform.processor() or "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == (platform.processor() or "?"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import torch

    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{model}|flags={digest}|torch={torch.__version__}"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


@cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "corellm" / "native"


_loaded: dict[Path, ctypes.CDLL] = {}


def load_library(name: str, source: str | os.PathLike, flags: tuple[str, ...] = ()
                 ) -> ctypes.CDLL:
    """Compile ``source`` (a C file) into ``lib<name>.so`` for this machine, or reuse the cached
    build, and load it. Raises NativeBuildError naming the compiler, the source and its
    output when the build fails."""
    source = Path(source)
    cc = compiler()
    if cc is None:
        raise NativeBuildError(f"building {name} from {source} needs a C compiler: none found "
                               "(set CC, or install gcc or clang)")
    all_flags = (*BASE_FLAGS, f"-I{INCLUDE_DIR}", *flags)
    text = source.read_bytes()
    headers = [h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    digest = hashlib.sha256(b"\0".join([
        text, *headers, " ".join(all_flags).encode(), " ".join(LINK_FLAGS).encode(),
        _compiler_version(cc).encode(),
        machine_key().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}" / f"lib{name}.so"
    if target in _loaded:
        return _loaded[target]
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        steps = [[cc, *all_flags, "-c", str(source), "-o", obj],
                 [cc, *LINK_FLAGS, obj, "-o", tmp, "-lm"]]
        t0 = time.perf_counter()
        try:
            for cmd in steps:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise NativeBuildError(f"building {name} failed ({' '.join(cmd)}):\n"
                                           f"{proc.stderr.strip()[-4000:]}")
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeBuildError(f"building {name} with {cc} failed: {exc}") from exc
        finally:
            for leftover in (tmp, obj):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        logger.info("built native library %s in %.1f s: %s", name, time.perf_counter() - t0,
                    target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"loading {target} failed: {exc}") from exc
    _loaded[target] = lib
    return lib
