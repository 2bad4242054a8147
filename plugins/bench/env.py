"""What a benchmark result was measured on: hardware, software versions, thread settings and the
code's git state. Stored with every result so two numbers are only compared when they are
comparable (a different torch, another process on the cores, uncommitted engine edits)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import os
import platform
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

_SIMD_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}
_THREAD_VARS = ("CORELLM_MALLOC_TUNING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_AFFINITY",
                "LD_PRELOAD")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for the block (as ``timeit`` does), back to what it was
    after. For building a workload and running it: each collection walks every live container,
    the workload's prompts included, so at 100,000 requests the collections cost more than a
    tenth of a simulated run, and a real run's pauses would land in some request's latency.
    Neither creates reference cycles worth collecting (a 100,000-request run leaves a few hundred
    objects to the collection that runs after it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def loadavg() -> float | None:
    """The 1-minute load average (Linux), or None: above ~0.5 before a run, something else is
    using the CPU and the numbers will be noisy."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def proc_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _git_root() -> Path | None:
    """The corellm source checkout this code runs from, if it is one (an editable install)."""
    root = Path(__file__).resolve().parent.parent.parent
    return root if (root / ".git").exists() else None


def _installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(*, started: _dt.datetime | None = None,
                import_torch: bool = True) -> dict[str, Any]:
    """The machine and software a result was measured with (JSON-serializable). ``started``
    is the date recorded (default: now). With ``import_torch=False`` torch is described only
    if something already imported it: called after a run, that is whenever the run used it,
    and a run that did not (a server benchmarked over HTTP) does not pay seconds of start-up
    for version strings; then only the installed version is recorded, and no thread counts or
    accelerators."""
    torch = sys.modules.get("torch")
    if torch is None and import_torch:
        import torch
    cpu = platform.processor() or platform.machine()
    simd: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                simd = sorted(set(line.split(":", 1)[1].split()) & _SIMD_FLAGS)
                break
    except OSError:
        pass
    env: dict[str, Any] = {
        "date": (started or _dt.datetime.now()).astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_model": cpu, "cpu_simd": simd, "cpu_count": os.cpu_count(),
        "torch": torch.__version__ if torch is not None else _installed_version("torch"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "torch_interop_threads": torch.get_num_interop_threads() if torch is not None else None,
    }
    # Accelerators, as the installed platforms see them: every available platform whose
    # devices are not the host's memory (a GPU) lists its devices.
    accelerators = []
    if torch is not None:
        try:
            from corellm.platforms import available_platforms, host_visible
            from corellm.plugins import load_registry
            accelerators = [p for p in available_platforms(load_registry())
                            if not host_visible(torch.device(p.device_type))]
        except Exception:          # a report must not fail on a broken platform plugin
            accelerators = []
    env["cuda"] = torch.version.cuda if accelerators else None
    if accelerators:
        env["gpus"] = [name for p in accelerators for name in p.device_names()]
        env["accelerator_kind"] = accelerators[0].device_type
    env["thread_env"] = {k: os.environ[k] for k in _THREAD_VARS if k in os.environ}
    try:
        env["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    # The installed versions, read without importing what the run did not (transformers alone
    # takes a second to import).
    for mod in ("transformers", "corellm", "numpy"):
        module = sys.modules.get(mod)
        env[mod] = getattr(module, "__version__", None) or _installed_version(mod)
    root = _git_root()
    if root is not None:
        try:
            env["git_commit"] = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                timeout=10).stdout.strip() or None
            # Uncommitted changes (engine files edited since the commit change what was measured).
            env["git_status"] = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain"], capture_output=True,
                text=True, timeout=10).stdout.splitlines()[:50]
        except (OSError, subprocess.SubprocessError):
            pass
    return env
