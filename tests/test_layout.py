"""The architecture's boundaries, checked on the source: the core never imports a plugin, plugins
never import each other, every plugin folder is packaged and registered as an entry point."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists())


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_never_imports_a_plugin():
    for f in (ROOT / "corellm").rglob("*.py"):
        bad = {m for m in imports_of(f) if m.split(".")[0] == "corellm_plugins"}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_plugins_do_not_import_each_other():
    for d in PLUGIN_DIRS:
        for f in d.rglob("*.py"):
            for m in imports_of(f):
                parts = m.split(".")
                if parts[0] == "corellm_plugins" and len(parts) > 1:
                    assert parts[1] == d.name, f"{f.relative_to(ROOT)} imports {m}"


def test_every_plugin_folder_is_packaged_and_registered():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]["corellm"]
    packages = set(project["tool"]["setuptools"]["packages"])
    for d in PLUGIN_DIRS:
        assert eps.get(d.name) == f"corellm_plugins.{d.name}", f"no entry point for {d.name}"
        assert f"corellm_plugins.{d.name}" in packages
    for d in (ROOT / "corellm").rglob("__init__.py"):
        pkg = ".".join(d.parent.relative_to(ROOT).parts)
        assert pkg in packages, f"{pkg} missing from [tool.setuptools] packages"


def test_plugin_modules_import_without_torch_heavy_work():
    """Discovery stays light: plugin entry modules import only corellm's light modules."""
    heavy = {"torch", "transformers", "numpy"}
    for d in PLUGIN_DIRS:
        top = {m.split(".")[0] for m in imports_of(d / "__init__.py")}
        assert not top & heavy, f"{d.name}/__init__.py imports {top & heavy} at import time"
