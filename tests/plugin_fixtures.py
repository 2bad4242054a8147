"""Helpers that install throwaway plugin distributions on sys.path (a dist-info directory with
METADATA and entry_points.txt, plus the module), so discovery runs through importlib.metadata
exactly as it does for a pip-installed package."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_fake_dist(root: Path, dist: str, version: str, modules: dict[str, str],
                      entry_points: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[corellm]\n{eps}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
