"""Helpers that install throwaway plugin distributions on sys.path (a dist-info directory with
METADATA and entry_points.txt, plus the module), so discovery runs through importlib.metadata
exactly as it does for a pip-installed package."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType


def source_module(monkeypatch, directory: Path, name: str) -> Iterator[ModuleType]:
    """For a fixture: an example's plugin module imported from its source tree (not installed),
    forgotten again after the test (a copy imported before is put back)."""
    monkeypatch.syspath_prepend(str(directory))
    saved = sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(directory.resolve())
    yield module
    sys.modules.pop(name, None)
    if saved is not None:
        sys.modules[name] = saved


def install_fake_dist(root: Path, dist: str, version: str, modules: dict[str, str],
                      entry_points: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[corellm]\n{eps}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def fresh_venv(tmp_path: Path, timeout: float = 120
               ) -> tuple[Path, Callable[..., subprocess.CompletedProcess]]:
    """A throwaway virtual environment in ``tmp_path`` that sees this one's packages (torch,
    pydantic, ...), and ``run(*args, timeout=...)``: its python run on ``args`` from
    ``tmp_path`` with the hub offline and a private corellm cache, asserting exit status 0.
    Returns (its site-packages, run)."""
    venv = tmp_path / "venv"
    # --without-pip: pip and setuptools then come from the system site-packages. The copies that
    # ensurepip would put in the venv take seconds to install, and the bundled setuptools may be
    # too old to build a wheel without the `wheel` package.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=60)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    site_packages = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, cwd=tmp_path).stdout.strip())
    assert site_packages.resolve().is_relative_to(venv.resolve())
    if sys.prefix != sys.base_prefix:
        # pytest runs inside a venv. --system-site-packages then exposes the base interpreter's
        # packages, not this venv's, so also expose this venv's site-packages. They go after
        # the new venv's own site-packages.
        import site
        (site_packages / "_outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV",
                        "CORELLM_PLUGINS")}
    env.update(CORELLM_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PIP_USER="0")

    def run(*args: str, timeout: float = timeout,
            input: str | None = None) -> subprocess.CompletedProcess:
        # cwd=tmp_path: `python -m` puts the cwd first on sys.path, and no source tree of the
        # checkout may be there.
        proc = subprocess.run([str(python), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout, input=input)
        assert proc.returncode == 0, (f"{' '.join(args)} exited {proc.returncode}\n"
                                      f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        return proc

    return site_packages, run
