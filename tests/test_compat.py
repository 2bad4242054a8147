"""Compatibility: the release and plugin API versions agree with the CHANGELOG, the public names
of docs/compatibility.md exist, deprecations name the plugin that uses them, and `corellm
plugins` honours plugins.disable and can fail a plugin package's CI."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import corellm
from corellm._imports import MOVED
from corellm.plugins.deprecation import warn_deprecated
from corellm.errors import CorellmDeprecationWarning
from corellm.plugins.discovery import PLUGIN_API_VERSION, load_registry
from tests.conftest import engine_config
from tests.plugin_fixtures import install_fake_dist

ROOT = Path(__file__).resolve().parents[1]


def test_versions_agree_with_the_changelog():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == corellm.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)(?: — plugin API (\d+)\.(\d+))?$", changelog, re.M)
    assert first and first.group(1) == corellm.__version__, "newest CHANGELOG entry"
    assert (int(first.group(2)), int(first.group(3))) == PLUGIN_API_VERSION
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    assert f"`corellm.__version__` ({corellm.__version__})" in doc
    assert f"`corellm.plugins.PLUGIN_API_VERSION` ({PLUGIN_API_VERSION[0]}." \
           f"{PLUGIN_API_VERSION[1]})" in doc


def _lookup(owner: object, dotted: str) -> object | None:
    """``owner.<dotted>``: an attribute, or a dataclass field (instance-only attributes)."""
    for part in dotted.split("."):
        fields = getattr(owner, "__dataclass_fields__", {})
        owner = getattr(owner, part, None) or fields.get(part)
        if owner is None:
            return None
    return owner


def test_every_public_name_in_the_compatibility_table_exists():
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    table = doc.split("## What is public", 1)[1].split("Not public:", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 14
    checked = 0
    for modules_cell, names_cell in rows:
        modules = [importlib.import_module(m) for m in re.findall(r"`([\w.]+)`", modules_cell)]
        owners = list(modules)
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", names_cell):
            found = [obj for o in owners if (obj := _lookup(o, name)) is not None]
            if not found and name.startswith("corellm."):        # a module named in the cell
                found = [importlib.import_module(name)]
            assert found, f"{name} (docs/compatibility.md) is not in {modules_cell.strip()}"
            owners += [f for f in found if isinstance(f, type)]  # methods of listed classes
            checked += 1
    assert checked > 50


# Names plugin API 1.1 could import from these modules and 1.2 defines elsewhere (the core's
# layers): each must still be importable from its 1.1 module, as the same object.
MOVED_IN_1_2 = {
    "corellm.components": ["ComponentOptions", "SchedulerOptions", "PlatformSpec", "CommandSpec",
                           "delegate_field", "delegate_fields", "section_of", "NoOptions",
                           "SECTION_SPECS", "BuildContext"],
    "corellm.config": ["EngineConfig", "ModelConfig", "ParallelConfig", "PluginsConfig",
                       "load_config", "read_config_file", "parse_override", "apply_overrides",
                       "did_you_mean", "SchedulerOptions", "KVCacheOptions", "ExecutorOptions",
                       "SamplerOptions", "FrontendOptions", "DType"],
    "corellm.plugins": ["Registry", "PluginInfo", "RegisteredComponent", "BrokenPlugin",
                        "Conflict", "call_factory", "executor_launcher_worker", "load_registry",
                        "PLUGIN_API_VERSION", "BUILTIN_DISTRIBUTION", "section_of"],
    "corellm.checkpoint.reader": ["ModelArchConfig", "LlamaArchConfig", "ConfigReader",
                                  "RopeConfig", "ROPE_TYPES", "parse_arch_config",
                                  "checkpoint_name"],
    "corellm.platforms": ["Platform", "host_visible", "host_memory_available",
                          "PLATFORM_INTERFACE_VERSION", "build_platform", "choose_platform"],
    "corellm.interfaces": ["CachedPrefix", "NO_CACHED_PREFIX", "SchedulingPolicy",
                           "attention_layer_specs"],
    "corellm.scheduling": ["SchedulingContext", "WaitingQueue", "BatchScheduler"],
    "corellm.layers": ["DeviceOps", "REFERENCE_OPS", "OpsModule", "bind_ops", "Attention"],
    "corellm.layers.attention": ["Attention", "attention_layer_specs", "bind_kv_caches"],
}


def test_names_of_plugin_api_1_1_import_from_their_1_1_modules():
    for module, names in MOVED_IN_1_2.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module} lost {missing}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_from_its_old_path_with_a_warning_until_0_7(old):
    """0.6 moved these modules into folders: the old path still imports, as the same module
    (so classes, isinstance and monkeypatching agree), with a warning naming the new path."""
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(CorellmDeprecationWarning) as record:
        __import__(old)                             # what an import statement calls
    moved = sys.modules[old]
    assert [str(w.message) for w in record] == [
        f"the module {old}, which is deprecated and will be removed in corellm 0.7; use "
        f"{MOVED[old]}"]
    assert record[0].filename == __file__           # the importer's line, not importlib's
    assert moved is new and moved.__spec__.name == MOVED[old]
    sys.modules.pop(old, None)


def test_the_compatibility_page_lists_every_moved_module():
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    table = doc.split("<!-- moved: checked against corellm._imports.MOVED -->", 1)[1]
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", table.split("\n\n", 1)[0], re.M)
    assert dict(rows) == MOVED


def test_every_module_of_the_core_imports_from_its_own_path_without_a_warning():
    """No module of the core imports an old path (each would warn once per process)."""
    names = []
    for f in sorted((ROOT / "corellm").rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue                        # runs the command line
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    code = ("import importlib, warnings\n"
            "warnings.simplefilter('error', FutureWarning)\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(names) > 70


def test_a_plugin_that_imports_an_old_path_is_named(site):
    install_fake_dist(site, "fake-old-path", "0.1", {"fake_old_path": """
        from corellm import hookimpl
        from corellm.components import KVCacheManagerSpec
        from corellm.kv_cache import PagedKVCacheManager, PagedKVCacheOptions

        class Mine(PagedKVCacheManager):
            pass

        @hookimpl
        def corellm_kv_cache_managers():
            yield KVCacheManagerSpec(name="mine", options=PagedKVCacheOptions,
                                     factory=lambda o, ctx: Mine(ctx.num_kv_blocks, o.block_size))
    """}, {"fake_old_path": "fake_old_path"})
    sys.modules.pop("corellm.kv_cache", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reg = load_registry()
    sys.modules.pop("corellm.kv_cache", None)
    messages = [str(w.message) for w in record if w.category is CorellmDeprecationWarning]
    assert messages == [
        "plugin 'fake_old_path' (entry point fake_old_path = fake_old_path, from fake-old-path "
        "0.1) uses the module corellm.kv_cache, which is deprecated and will be removed in "
        "corellm 0.7; use corellm.kv.paged"]
    from corellm.kv.paged import PagedKVCacheManager
    assert issubclass(sys.modules["fake_old_path"].Mine, PagedKVCacheManager)
    assert "mine" in reg.choices("kv_cache") and not reg.broken


DEPRECATED_USER = """
from corellm import hookimpl
from corellm.components import SamplerSpec
from corellm.plugins.deprecation import warn_deprecated

warn_deprecated("old.import.path", "new.import.path", "0.9")

def make(options, ctx):
    warn_deprecated("old_factory_helper()", "new_factory_helper()", "0.9")
    raise RuntimeError("not built in this test")

@hookimpl
def corellm_samplers():
    yield SamplerSpec(name="dep", factory=make)
"""


def test_a_deprecation_names_the_plugin_that_uses_it(site, llama_path):
    install_fake_dist(site, "fake-dep", "1.0", {"fake_dep": DEPRECATED_USER},
                      {"fake_dep": "fake_dep"})
    with pytest.warns(CorellmDeprecationWarning) as record:
        reg = load_registry()
    [w] = [w for w in record if "old.import.path" in str(w.message)]
    assert str(w.message) == (
        "plugin 'fake_dep' (entry point fake_dep = fake_dep, from fake-dep 1.0) uses "
        "old.import.path, which is deprecated and will be removed in corellm 0.9; use "
        "new.import.path")
    assert issubclass(CorellmDeprecationWarning, FutureWarning)     # shown by default
    # In a factory, too (the sampler is built inside the worker).
    from corellm import LLM
    from corellm.errors import PluginError
    with pytest.warns(CorellmDeprecationWarning, match=r"plugin 'fake_dep' .*uses "
                                                       r"old_factory_helper\(\)"):
        with pytest.raises(PluginError, match="not built in this test"):
            LLM(engine_config(llama_path, sampler={"name": "dep"}))
    del reg
    # Outside any plugin, the warning has no owner to name.
    with pytest.warns(CorellmDeprecationWarning) as record:
        warn_deprecated("x", "y", "0.9")
    assert str(record[0].message).startswith("x, which is deprecated")


def _cli(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from corellm.cli.commands import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(args))
    return status, out.getvalue()


def test_corellm_plugins_honours_the_configs_disable_list(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("plugins: {disable: [scheduler_priority]}\n")
    status, out = _cli("plugins", "--json")
    assert status == 0 and "priority" in {r["name"] for r in json.loads(out)["components"]}
    status, out = _cli("plugins", "--json", "--config", str(cfg))
    names = {r["name"] for r in json.loads(out)["components"]}
    assert status == 0 and "priority" not in names and "fcfs" in names
    status, out = _cli("plugins", "--json", "--disable", "scheduler_fcfs", "-c", str(cfg))
    names = {r["name"] for r in json.loads(out)["components"]}
    assert not {"fcfs", "priority"} & names
    assert json.loads(out)["plugin_api"] == "%d.%d" % PLUGIN_API_VERSION


def test_corellm_plugins_shows_conflicts_and_check_fails_on_problems(site):
    sched = """
from corellm import hookimpl
from corellm.components import SchedulerSpec
@hookimpl
def corellm_schedulers():
    yield SchedulerSpec(name="{name}", factory=lambda o, c: None, summary="{summary}")
"""
    install_fake_dist(site, "fake-over", "1.0", {"fake_over": sched.format(
        name="fcfs", summary="mine")}, {"fake_over": "fake_over"})
    status, out = _cli("plugins", "--check")
    assert status == 0        # an installed plugin over a built-in is a choice, not a problem
    assert "also provided by corellm:fcfs; the name selects this one" in out
    assert "also provided by fake-over:fcfs; select this one as corellm:fcfs" in out
    install_fake_dist(site, "fake-twin", "1.0", {"fake_twin": sched.format(
        name="fcfs", summary="twin")}, {"fake_twin": "fake_twin"})
    install_fake_dist(site, "fake-typo", "1.0", {"fake_typo": "def corellm_schedulerz():\n"
                                                               "    return []\n"},
                      {"fake_typo": "fake_typo"})
    status, out = _cli("plugins", "--check")
    assert status == 1
    assert "AMBIGUOUS scheduler 'fcfs': provided by" in out
    assert "BROKEN plugin 'fake_typo'" in out and "corellm_schedulerz" in out
    status, out = _cli("plugins", "--json")
    data = json.loads(out)
    [conflict] = data["conflicts"]
    assert conflict["selected"] is None and len(conflict["providers"]) == 3
    assert data["broken"][0]["stage"] == "hooks"
    assert _cli("plugins")[0] == 0                        # listing alone never fails
