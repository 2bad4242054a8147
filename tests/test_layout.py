"""The architecture's boundaries, checked on the source: the core's modules import only down its
layers and never in a circle, the core never imports a plugin, plugins never import each other,
every plugin folder is packaged and registered as an entry point, no source file holds more than
one file's worth of concerns, and the core's size is what docs/architecture.md says."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists())


MAX_LINES = 600


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


# --------------------------------------------------------------------------- the core's layers
# corellm/'s modules by layer, lowest first (docs/architecture.md, "The core in layers"). An entry
# is a module or a package (relative to corellm/), most specific entry wins. A module imports
# only from its own layer and the layers below, and no import cycle exists at all. Every import
# counts: at module level, under TYPE_CHECKING, inside functions, and the __init__ of every
# package an imported module sits in (Python runs it first). The package's facade,
# corellm/__init__.py, is left out: it re-exports from every layer, lazily.
CORE_LAYERS: dict[str, list[str]] = {
    "foundation": ["errors", "clock", "_imports", "plugins.deprecation", "platforms.devices",
                   "platforms.shm_ring", "checkpoint.cache", "engine.logs", "serving"],
    "data types": ["sampling_params", "request", "outputs", "arch", "ops", "sampling",
                   "serving.constraint_shape", "tool_calls", "quant", "lora.request"],
    "interfaces": ["attention", "policy_view", "interfaces"],
    "component specs": ["specs"],
    "config": ["config.schema"],
    "registry": ["hookspecs", "plugins"],
    "composition": ["platforms", "checkpoint", "config", "components"],
    "libraries": ["kv", "scheduling", "wrappers", "layers", "serving.chat_output", "lora"],
    "engine": ["engine", "worker", "cli", "__main__"],
}


def is_facade(init: Path) -> bool:
    """A package ``__init__`` that is the lazy public face of one of its modules
    (``__getattr__ = facade(...)``, corellm._imports): it imports nothing when it runs."""
    return "__getattr__ = facade(" in init.read_text()


def facade_main(init: Path) -> str | None:
    """The module a lazy facade reads its names from (``facade(__name__, "main", ...)``)."""
    m = re.search(r'__getattr__ = facade\(__name__, "(\w+)"', init.read_text())
    return m[1] if m else None


def module_graph(package_dir: Path, name: str | None = None,
                 with_init: bool = False) -> dict[str, set[str]]:
    """Module (dotted, under the package's ``name``, by default its folder's) -> the package's
    modules it imports, by every kind of import, plus the packages whose __init__ those imports
    run. The facades (the package's own __init__ unless ``with_init``, and lazy ones) are
    neither sources nor targets."""
    top = name or package_dir.name
    files = {}
    for f in package_dir.rglob("*.py"):
        parts = top.split(".") + list(f.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = f

    def known(name: str) -> str | None:         # the longest module prefix of a dotted name
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts) if parts else None

    # The facades (the package's own __init__, and those of folders that replaced a module)
    # run no import of their own: neither sources nor targets.
    facades = {mod for mod, f in files.items()
               if (mod == top and not with_init) or (f.name == "__init__.py" and is_facade(f))}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        if mod in facades:
            continue
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from a import b` imports a.b when b is a module, else just a
                names = [f"{base}.{a.name}" if known(f"{base}.{a.name}") == f"{base}.{a.name}"
                         else base for a in node.names]
            else:
                continue
            for name in names:
                target = known(name)
                if target is None:
                    continue
                if target in facades and target != top and facade_main(files[target]):
                    # A name read through a folder's facade (``from corellm.config import X``)
                    # comes from the facade's main module: that is the import.
                    target = f"{target}.{facade_main(files[target])}"
                parts = target.split(".")
                for k in range(2, len(parts) + 1):   # its packages' __init__ run first
                    enclosing = ".".join(parts[:k])
                    if enclosing in files and not f"{mod}.".startswith(f"{enclosing}."):
                        targets.add(enclosing)
        targets.discard(mod)
        graph[mod] = targets - facades
    return graph


def layer_problems(graph: dict[str, set[str]], layers: dict[str, list[str]]) -> list[str]:
    """Every module no layer names, every import that goes up a layer, and every cycle."""
    order = {f"corellm.{entry}": (i, name) for i, (name, entries) in enumerate(layers.items())
             for entry in entries}

    def layer(mod: str) -> tuple[int, str] | None:
        parts = mod.split(".")
        for k in range(len(parts), 1, -1):
            if ".".join(parts[:k]) in order:
                return order[".".join(parts[:k])]
        return None

    problems = [f"{m}: in no layer" for m in sorted(graph) if layer(m) is None]
    for mod, targets in sorted(graph.items()):
        here = layer(mod)
        for target in sorted(targets):
            there = layer(target)
            if here and there and there[0] > here[0]:
                problems.append(f"{mod} ({here[1]}) imports {target} ({there[1]}), a layer up")
    return problems + [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module, each sorted."""
    found: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_layer_check_catches_upward_imports_and_cycles(tmp_path):
    pkg = tmp_path / "corellm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from corellm.high import x\n")    # the facade: ignored
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from corellm.high import H\n")
    (pkg / "high.py").write_text("def f():\n    from corellm import low\n")
    (pkg / "sub" / "__init__.py").write_text("from corellm.high import H\n")
    (pkg / "sub" / "leaf.py").write_text("x = 1\n")
    (pkg / "user.py").write_text("from .sub.leaf import x\n")    # runs sub/__init__ too
    graph = module_graph(pkg)
    assert graph["corellm.user"] == {"corellm.sub", "corellm.sub.leaf"}
    assert graph["corellm.high"] == {"corellm.low"}
    problems = layer_problems(graph, {"low": ["low", "user", "sub.leaf"], "high": ["high", "sub"]})
    assert "corellm.low (low) imports corellm.high (high), a layer up" in problems
    assert "corellm.user (low) imports corellm.sub (high), a layer up" in problems
    assert "import cycle: corellm.high -> corellm.low" in problems
    assert not layer_problems({"corellm.a": {"corellm.b"}, "corellm.b": set()},
                              {"one": ["b"], "two": ["a"]})


def lazy_facade_imports(package_dir: Path) -> list[str]:
    """``from corellm import NAME`` in the package's modules where NAME is neither a submodule
    nor bound by the facade when it is imported: such a name (``LLM``) is resolved lazily by the
    facade, from whichever layer defines it, which module_graph cannot see."""
    top = package_dir.name
    facade = ast.parse((package_dir / "__init__.py").read_text())
    eager = set()
    for node in facade.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            eager.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            eager.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for f in sorted(package_dir.rglob("*.py")):
        if f == package_dir / "__init__.py":
            continue
        depth = len(f.relative_to(package_dir).parts) - (f.name == "__init__.py")
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                    (node.level == 0 and node.module == top) or (node.level == depth
                                                                 and node.module is None)):
                for a in node.names:
                    submodule = package_dir / a.name
                    if a.name not in eager and not (submodule.is_dir()
                                                    or submodule.with_suffix(".py").exists()):
                        found.append(f"{f.relative_to(package_dir.parent)}: from {top} import "
                                     f"{a.name}")
    return found


def test_the_layer_check_sees_names_read_through_a_folders_facade(tmp_path):
    pkg = tmp_path / "corellm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text(
        'from corellm._imports import facade\n'
        '__getattr__ = facade(__name__, "compose", ("compose",))\n')
    (pkg / "config" / "compose.py").write_text("from corellm.low import x\n")
    (pkg / "low.py").write_text("from corellm.config import EngineConfig\n")
    graph = module_graph(pkg)
    assert graph["corellm.low"] == {"corellm.config.compose"}
    assert cycles(graph) == [["corellm.config.compose", "corellm.low"]]


def test_the_facade_check_catches_lazy_names(tmp_path):
    pkg = tmp_path / "corellm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from corellm.low import hookimpl\n__version__ = '1'\n"
                                     "def __getattr__(name):\n    from corellm.high import LLM\n"
                                     "    return LLM\n")
    (pkg / "low.py").write_text("from corellm import __version__, hookimpl, high\n"
                                "def f():\n    from corellm import LLM\n")
    (pkg / "high.py").write_text("LLM = 1\n")
    (pkg / "sub" / "leaf.py").write_text("from .. import LLM\n")
    assert lazy_facade_imports(pkg) == ["corellm/low.py: from corellm import LLM",
                                        "corellm/sub/leaf.py: from corellm import LLM"]


def test_the_core_imports_no_lazy_name_of_the_facade():
    found = lazy_facade_imports(ROOT / "corellm")
    assert not found, "\n".join(found)


def test_the_core_imports_only_down_its_layers():
    problems = layer_problems(module_graph(ROOT / "corellm"), CORE_LAYERS)
    assert not problems, "\n".join(problems)


def test_no_plugin_has_an_import_cycle():
    """Within each built-in plugin, no module imports (even lazily, inside a function) one that
    imports it back: the bench plugin's sub-commands take what they share with its ``cli``
    from ``cli_common``."""
    for d in PLUGIN_DIRS:
        graph = module_graph(d, f"corellm_plugins.{d.name}", with_init=True)
        assert not cycles(graph), f"{d.name}: {cycles(graph)}"
    bench = module_graph(ROOT / "plugins" / "bench", "corellm_plugins.bench", with_init=True)
    assert {"corellm_plugins.bench.calibrate", "corellm_plugins.bench.workload_cli"} <= \
        bench["corellm_plugins.bench.cli"]                  # the checker sees the lazy imports


def test_no_source_file_over_600_lines():
    """One concern per file: a file past this has several (split it by concern)."""
    long = [f"{f.relative_to(ROOT)}: {n} lines" for d in ("corellm", "plugins")
            for f in sorted((ROOT / d).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


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
# The exact rule of "no core module branches on the device type": outside
# corellm/platforms/devices.py
# (whose host_visible() is the one device-type test the core has), no
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
PLATFORM_INTERFACE = ROOT / "corellm" / "platforms" / "devices.py"


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
    assert not problems, ("device branches outside corellm/platforms/devices.py:\n"
                          + "\n".join(problems))


def test_the_core_imports_no_platform_plugin():
    for f in (ROOT / "corellm").rglob("*.py"):
        bad = {m for m in imports_of(f) if m.startswith("corellm_plugins.platform_")}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


# --------------------------------------------------------------------------- the docs agree
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def core_lines_by_layer() -> tuple[dict[str, int], int, int]:
    """Lines of corellm/'s files per layer of CORE_LAYERS, the total and the number of files."""
    order = {entry: name for name, entries in CORE_LAYERS.items() for entry in entries}
    per_layer = dict.fromkeys(CORE_LAYERS, 0)
    total = files = 0
    for f in (ROOT / "corellm").rglob("*.py"):
        n = len(f.read_text().splitlines())
        total, files = total + n, files + 1
        parts = list(f.relative_to(ROOT / "corellm").with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in order:
                per_layer[order[".".join(parts[:k])]] += n
                break
    return per_layer, total, files


def test_architecture_doc_states_the_layers_and_the_core_size():
    """docs/architecture.md's layer table names CORE_LAYERS' modules, and its line counts (per
    layer and in all) are within 10% of the files': update the table when they drift."""
    text = ARCHITECTURE.read_text()
    table = text.split("<!-- layers:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    measured, total, files = core_lines_by_layer()
    stated = {}
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        modules = [m.rstrip("/") for m in re.findall(r"`([^`]+)`", cells[1])]
        stated[cells[0]] = (modules, int(cells[3].replace(",", "")))
    assert list(stated) == list(CORE_LAYERS)
    for layer, (modules, lines) in stated.items():
        assert modules == CORE_LAYERS[layer], f"{layer}: the table says {modules}"
        assert abs(lines - measured[layer]) <= 0.1 * measured[layer], \
            f"{layer}: the table says {lines} lines, the files have {measured[layer]}"
    said = re.search(r"The core is \*\*([\d,]+) lines\*\* in (\d+) files", text)
    assert said, "docs/architecture.md must say the core's size"
    assert abs(int(said[1].replace(",", "")) - total) <= 0.1 * total, \
        f"the doc says {said[1]} lines, the core has {total}"
    assert abs(int(said[2]) - files) <= 0.1 * files, f"the doc says {said[2]} files, not {files}"


def test_architecture_doc_lists_every_builtin_plugin():
    """The built-in plugin table of docs/architecture.md has one row per entry point, and each
    row names every component the plugin registers."""
    from corellm.plugins.discovery import load_registry

    text = ARCHITECTURE.read_text()
    table = text.split("| plugin (entry point) | component | what it is |", 1)[1]
    rows = {}
    for row in table.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(rows) == set(project["project"]["entry-points"]["corellm"])
    registry = load_registry()
    for table_ in registry.providers.values():
        for name, providers in table_.items():
            for entry in providers:
                if entry.plugin.name in rows:
                    assert name in rows[entry.plugin.name], \
                        f"{entry.describe()} is missing from its row of docs/architecture.md"


# --------------------------------------------------------------------------- no concrete types
def concrete_type_checks(source: str, concrete: set[str]) -> list[str]:
    """``type(x) is C`` / ``type(x) == C`` (and their negations) for a class ``C`` (a CamelCase
    name), and ``isinstance(x, C)`` for ``C`` in ``concrete``: generic code asking which class
    a component is, instead of a capability its interface declares. Comparing a method
    (``type(x).forward is Base.forward``: is it overridden?) asks a capability and passes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                and getattr(node.left.func, "id", None) == "type":
            for op, right in zip(node.ops, node.comparators):
                name = right.id if isinstance(right, ast.Name) else None
                if isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) and name \
                        and name[:1].isupper():
                    found.append(f"{node.lineno}: type(...) compared with {name}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for c in classes:
                name = c.id if isinstance(c, ast.Name) else getattr(c, "attr", None)
                if name in concrete:
                    found.append(f"{node.lineno}: isinstance(..., {name})")
    return found


def core_component_classes() -> dict[str, str]:
    """The core's concrete component classes (those that implement a plugin interface and are
    not abstract) -> the module that defines each."""
    import importlib
    import inspect

    from corellm.interfaces import (AttentionBackend, Executor, Frontend, KVCacheManager,
                                    LogitsProcessor, Sampler, Scheduler, SchedulingPolicy)
    from corellm.kv.block_pool import EvictionPolicy
    from corellm.platforms.interface import Platform
    bases = (AttentionBackend, Executor, Frontend, KVCacheManager, LogitsProcessor, Sampler,
             Scheduler, SchedulingPolicy, EvictionPolicy, Platform)
    found = {}
    for f in sorted((ROOT / "corellm").rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        module = importlib.import_module(".".join(parts))
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ \
                    and issubclass(obj, bases) and not inspect.isabstract(obj):
                found[name] = module.__name__
    return found


def test_the_concrete_type_check_catches_both_forms():
    source = ("if type(kv) is PagedKVCacheManager: pass\n"
              "if type(e) != LRUEviction: pass\n"
              "ok = type(x).forward is Base.forward or type(v) is int\n"
              "if isinstance(s, (int, BatchScheduler)): pass\n")
    assert concrete_type_checks(source, {"BatchScheduler"}) == [
        "1: type(...) compared with PagedKVCacheManager", "2: type(...) compared with LRUEviction",
        "4: isinstance(..., BatchScheduler)"]


def test_no_generic_code_checks_a_components_concrete_type():
    """A fast path that needs a property of a component asks a capability its interface
    declares (``KVCacheManager.block_calls_only``, ``EvictionPolicy.inline_order``), which a
    third-party component can claim too; it never tests for the core's own class."""
    concrete = core_component_classes()
    assert {"PagedKVCacheManager", "LRUEviction", "BatchScheduler"} <= set(concrete)
    problems = []
    for f in sorted((ROOT / "corellm").rglob("*.py")):
        module = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        own = {name for name, where in concrete.items() if where == module}
        problems += [f"{f.relative_to(ROOT)}:{p}"
                     for p in concrete_type_checks(f.read_text(), set(concrete) - own)]
    assert not problems, "\n".join(problems)


def test_architecture_doc_states_every_folder_and_its_size():
    """docs/architecture.md's folder table names every folder and top-level file of the core
    once, each row's line count within 10% of the files' (update the table when they drift)."""
    text = ARCHITECTURE.read_text()
    table = text.split("| where | what it holds | lines |", 1)[1].split("\n\n", 1)[0]
    named: list[str] = []
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        entries = re.findall(r"`([\w/.]+)`", cells[0])
        files = [f for e in entries for f in ((ROOT / "corellm" / e).glob("*.py")
                                              if e.endswith("/") else [ROOT / "corellm" / e])]
        lines = sum(len(f.read_text().splitlines()) for f in files)
        stated = int(cells[-1].replace(",", ""))
        assert abs(stated - lines) <= 0.1 * lines, f"{cells[0]}: says {stated}, has {lines}"
        named += entries
    core = ROOT / "corellm"
    everything = {f"{d.name}/" for d in core.iterdir() if (d / "__init__.py").exists()} | {
        f.name for f in core.glob("*.py")
        if f.name not in ("__init__.py", "__main__.py", "_imports.py")}
    assert sorted(named) == sorted(everything)
