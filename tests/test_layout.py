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


# --------------------------------------------------------------------------- device code
# The exact rule of "no core module branches on the device type": outside corellm/platforms.py
# (the platform interface, whose host_visible() is the one device-type test the core has), no
# module of corellm/
#   1. compares the ``.type`` of anything named like a device (``device.type == ...``,
#      ``x.device.type in (...)``, ``self.dev.type != ...``);
#   2. compares anything with a device-type name ("cpu", "cuda", "xpu", "mps", "hip", "npu"),
#      alone or inside a tuple/list/set;
#   3. reads ``.is_cuda``, ``.is_cpu``, ``.is_xpu`` or ``.is_mps``;
#   4. uses a device's own torch API: ``torch.cuda``, ``torch.xpu``, ``torch.mps``,
#      ``torch.backends.{cuda,cudnn,mkl,mkldnn,mps}``, ``torch.ops.{mkl,mkldnn}``.
# Device names may appear elsewhere (a docstring, a data table of GPUs, an error message).
DEVICE_TYPES = {"cpu", "cuda", "xpu", "mps", "hip", "npu"}
DEVICE_APIS = ("torch.cuda", "torch.xpu", "torch.mps", "torch.backends.cuda",
               "torch.backends.cudnn", "torch.backends.mkl", "torch.backends.mkldnn",
               "torch.backends.mps", "torch.ops.mkl", "torch.ops.mkldnn")
PLATFORM_INTERFACE = ROOT / "corellm" / "platforms.py"


def _names_a_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in DEVICE_TYPES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    return False


def device_branches(source: str) -> list[str]:
    """Every place in ``source`` that breaks the rule above, as "line: code"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        bad = False
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            bad = any((isinstance(o, ast.Attribute) and o.attr == "type"
                       and "dev" in ast.unparse(o.value).lower()) or _names_a_device(o)
                      for o in operands)
        elif isinstance(node, ast.Attribute):
            bad = node.attr in ("is_cuda", "is_cpu", "is_xpu", "is_mps") or any(
                ast.unparse(node) == api for api in DEVICE_APIS)
        if bad:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_catches_device_branches():
    """The checker itself: each form it must catch, and what it must let through."""
    assert device_branches("if x.device.type == 'cuda': pass")
    assert device_branches("ok = t.device.type in ('cpu', 'mps')")
    assert device_branches("if name != 'cpu': pass")
    assert device_branches("if kind in ['cuda', 'xpu']: pass")
    assert device_branches("if t.is_cuda: pass")
    assert device_branches("n = torch.cuda.device_count()")
    assert device_branches("ok = torch.backends.mkldnn.is_available()")
    assert device_branches("if self.dev.type != other: pass")
    assert not device_branches("d = torch.device('cuda')\nmsg = f'on {device}'\n"
                               "x = {'kind': 'cuda'}\nif host_visible(d): pass\n"
                               "if kind == Model.type: pass")


def test_the_core_holds_no_device_code():
    """``corellm/`` contains no C source and no device-specific module, and no core module
    branches on the device type outside the platform interface (the rule above)."""
    core = ROOT / "corellm"
    sources = [p for ext in ("*.c", "*.h", "*.cc", "*.cpp", "*.cu", "*.cuh")
               for p in core.rglob(ext)]
    assert not sources, f"C sources in the core: {sources}"
    named = [p for p in core.rglob("*.py") if p.stem.startswith(("cpu", "cuda"))]
    assert not named, f"device-specific modules in the core: {named}"
    problems = []
    for f in sorted(core.rglob("*.py")):
        if f == PLATFORM_INTERFACE:
            continue
        problems += [f"{f.relative_to(ROOT)}:{line}" for line in device_branches(f.read_text())]
    assert not problems, "device branches outside corellm/platforms.py:\n" + "\n".join(problems)


def test_the_core_imports_no_platform_plugin():
    for f in (ROOT / "corellm").rglob("*.py"):
        bad = {m for m in imports_of(f) if m.startswith("corellm_plugins.platform_")}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
