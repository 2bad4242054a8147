"""Native (C) kernels for the CPU, compiled on first use and loaded with ctypes.

A plugin ships its kernel as C source with plain pointer arguments (no torch headers, so a
build takes about a second rather than the minute a torch extension takes) and asks the CPU
platform for it (``Platform.native_library``, which calls ``load_library``). The platform's C
headers (``csrc/``: the register-blocked micro-kernel of its GEMM, ``corellm_tile.h``; the one
bf16 conversion every kernel uses, ``corellm_bf16.h``; the thread pool, ``corellm_pool.h``) are
on every build's include path, so a plugin's kernel reuses them rather than copying them. The
library is compiled for the machine it runs on (``-march=native``) and cached under
``~/.cache/corellm/native`` (``XDG_CACHE_HOME``), keyed by the source, the flags, the
compiler's version and the CPU's model and feature flags, so a cache shared between different
machines never hands one a library built for another. The build writes to a temporary file and
renames it, so processes that build at once (the ranks of a tensor-parallel group) do not read
each other's half-written file.

Parallel loops run on the platform's thread pool (``csrc/corellm_pool.h``, ``pool.c``): one
library, loaded into the process's global symbol scope before any other, whose
``corellm_parallel_for`` every kernel library calls (the symbol is resolved when a library is
loaded). Libraries are built with ``-fopenmp-simd`` (``omp simd`` vectorizes) but not
``-fopenmp``: an ``omp parallel`` in a kernel would run on one thread, and the pool says why it is
not OpenMP. The pool's thread count is the CPUs this process may use (its affinity mask and its
cgroup's CPU quota), set when the pool is loaded and split between tensor-parallel ranks by
``CpuPlatform.prepare_process``.

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
import math
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

BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp-simd")
# Headers the platform shares with every native library (``#include "corellm_tile.h"``): on
# the include path of each build, and part of each build's cache key.
INCLUDE_DIR = Path(__file__).with_name("csrc")
LINK_FLAGS = ("-shared", "-fPIC", "-pthread")


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
    build, and load it, the thread pool first. Raises NativeBuildError naming the compiler, the
    source and its output when the build fails."""
    thread_pool()
    return _load(name, source, flags)


def _load(name: str, source: str | os.PathLike, flags: tuple[str, ...] = (),
          mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
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
        from corellm_plugins.platform_cpu.replay import RecordingLibrary
        lib = RecordingLibrary(str(target), mode=mode)
    except OSError as exc:
        raise NativeBuildError(f"loading {target} failed: {exc}") from exc
    _loaded[target] = lib
    return lib


# --------------------------------------------------------------------------- the thread pool
_POOL_SOURCE = Path(__file__).with_name("pool.c")
_SPIN_BOUNDS_NS = (1_000, 200_000)          # of the wake-up cost taken as the least spin


def cpu_budget() -> tuple[int, str]:
    """The CPUs this process may use, and how that was found: its affinity mask, lowered to its
    cgroup's CPU quota (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``, on its own cgroup and
    every parent; a quota of 1.5 CPUs gives 2 threads: they are throttled together, not one by
    one)."""
    try:
        cpus = len(os.sched_getaffinity(0))
        how = f"{cpus} CPUs in its affinity mask"
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
        how = f"{cpus} CPUs"
    quota = _cgroup_quota()
    if quota is not None and quota[0] < cpus:
        return max(1, quota[0]), f"{how}, a cgroup CPU quota of {quota[1]:g} ({quota[2]})"
    return max(1, cpus), how


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup"),
                  proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, float, str] | None:
    """(threads, CPUs, file) of the tightest CPU quota on this process's cgroup and its
    parents, or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, float, str] | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        if hierarchy == "0" and not controllers:                   # cgroup v2
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):                      # cgroup v1
            base = next((root / d for d in ("cpu,cpuacct", "cpu", "cpuacct,cpu")
                         if (root / d).is_dir()), root / "cpu")
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        path = base / rel.lstrip("/")
        while True:
            cpus = _read_quota(path, files)
            if cpus is not None and (best is None or cpus < best[1]):
                best = (math.ceil(cpus - 1e-9), cpus, str(path / files[0]))
            if path == base or path.parent == path:
                break
            path = path.parent
    return best


def _read_quota(path: Path, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:
            quota, period = (path / files[0]).read_text().split()[:2]
        else:
            quota = (path / files[0]).read_text().strip()
            period = (path / files[1]).read_text().strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def warm_ranges(ranges: list[tuple[int, int]]) -> ctypes.Array:
    """(address, bytes) ranges as the flat int64 array ``corellm_pool_warm`` reads."""
    return (ctypes.c_int64 * (2 * len(ranges)))(*(v for r in ranges for v in r))


class ThreadPool:
    """The platform's thread pool (``pool.c``), through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.corellm_pool_configure.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.corellm_pool_configure.restype = None
        lib.corellm_pool_threads.restype = ctypes.c_int
        lib.corellm_pool_spin_ns.restype = ctypes.c_int64
        lib.corellm_pool_spin_now_ns.restype = ctypes.c_int64
        lib.corellm_pool_wake_ns.argtypes = [ctypes.c_int]
        lib.corellm_pool_wake_ns.restype = ctypes.c_int64
        lib.corellm_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.corellm_pool_stats.restype = None
        lib.corellm_pool_warm.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.corellm_pool_warm.restype = None
        lib.corellm_pool_warmed_bytes.restype = ctypes.c_uint64

    @property
    def threads(self) -> int:
        """The threads a loop runs on, the caller included."""
        return int(self._lib.corellm_pool_threads())

    @property
    def spin_ns(self) -> int:
        """The least a waiting thread spins before it sleeps (a wake-up's cost)."""
        return int(self._lib.corellm_pool_spin_ns())

    @property
    def spin_now_ns(self) -> int:
        """What a waiting thread spins now: about twice the recent gap between loops, at least
        :attr:`spin_ns`, at most 200 us."""
        return int(self._lib.corellm_pool_spin_now_ns())

    def configure(self, threads: int, spin_ns: int | None = None) -> None:
        self._lib.corellm_pool_configure(int(threads), -1 if spin_ns is None else int(spin_ns))

    def wake_ns(self, rounds: int = 64) -> int:
        """The median time from waking a sleeping thread to its running (half a round trip
        between two threads that sleep in turn), in ns."""
        return int(self._lib.corellm_pool_wake_ns(rounds))

    def warm(self, ranges: list[tuple[int, int]]) -> None:
        """Memory the next loops will read, (address, bytes) ranges (at most 4), for an idle
        worker to fetch into the caches between loops (what the quantized layers give after
        each call; prefetches, so an address no longer mapped is harmless)."""
        self._lib.corellm_pool_warm(warm_ranges(ranges), len(ranges))

    @property
    def warmed_bytes(self) -> int:
        """Bytes the workers have fetched for :meth:`warm` since the pool was loaded."""
        return int(self._lib.corellm_pool_warmed_bytes())

    def stats(self) -> dict[str, int]:
        """Counters since the pool was loaded: loops run on it, chunks its workers ran, and
        the times a worker or the caller went to sleep."""
        out = (ctypes.c_uint64 * 4)()
        self._lib.corellm_pool_stats(out)
        return dict(zip(("loops", "worker_chunks", "worker_sleeps", "caller_sleeps"),
                        (int(v) for v in out)))


_pool: list[ThreadPool] = []


def thread_pool() -> ThreadPool:
    """The process's thread pool, built and loaded (into the global symbol scope, so the
    kernel libraries loaded after it call it) on first use, sized to :func:`cpu_budget`, its
    least spin the measured wake-up time (logged)."""
    if not _pool:
        pool = ThreadPool(_load("corellm_pool", _POOL_SOURCE, (), mode=ctypes.RTLD_GLOBAL))
        threads, how = cpu_budget()
        wake = pool.wake_ns()
        lo, hi = _SPIN_BOUNDS_NS
        spin = min(max(wake, lo), hi) if wake > 0 else hi
        pool.configure(threads, spin)
        logger.info("CPU thread pool: %d threads (%s); a waiting thread spins at least %.1f "
                    "us (the measured wake-up time), then sleeps", threads, how, spin / 1e3)
        _pool.append(pool)
    return _pool[0]
