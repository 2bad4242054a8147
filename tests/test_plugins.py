"""Plugin discovery and its errors: every message names the entry point, distribution, version."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

import corellm
from corellm.errors import ConfigError, PluginError
from corellm.plugins.discovery import load_registry
from tests.plugin_fixtures import install_fake_dist

SCHED_PLUGIN = """
from corellm import hookimpl
from corellm.components import SchedulerSpec

@hookimpl
def corellm_schedulers():
    yield SchedulerSpec(name="{name}", factory=lambda o, c: None, summary="test")
"""


def test_builtins_found_through_entry_points():
    reg = load_registry()
    for section, name in [("scheduler", "fcfs"), ("kv_cache", "paged"),
                          ("attention", "torch_sdpa"), ("executor", "uniproc"),
                          ("sampler", "default")]:
        entry = reg.get(section, name)
        assert entry.plugin.distribution == "corellm"
        assert entry.plugin.value.startswith("corellm_plugins.")
    assert set(reg.models_by_arch) >= {"LlamaForCausalLM", "Qwen2ForCausalLM",
                                       "Qwen3ForCausalLM", "MistralForCausalLM"}


def test_third_party_plugin_discovered(site):
    install_fake_dist(site, "fake-sched", "1.2.3", {"fake_sched": SCHED_PLUGIN.format(name="lifo")},
                      {"fake_sched": "fake_sched"})
    entry = load_registry().get("scheduler", "lifo")
    assert (entry.plugin.distribution, entry.plugin.version) == ("fake-sched", "1.2.3")
    assert "fake-sched 1.2.3" in entry.plugin.describe()


def test_broken_import_is_a_warning_until_used(site, caplog, llama_path):
    install_fake_dist(site, "fake-broken", "0.9", {"fake_broken": "import no_such_module_xyz\n"},
                      {"fake_broken": "fake_broken"})
    with caplog.at_level(logging.WARNING):
        reg = load_registry()
    assert "fake-broken 0.9" in caplog.text and "no_such_module_xyz" in caplog.text
    assert reg.broken and reg.broken[0].info.distribution == "fake-broken"
    # The config does not use it: start-up goes on.
    from corellm.config.compose import load_config
    load_config({"model": {"path": str(llama_path)}}, registry=reg)
    # The config names a component it might have provided: start-up stops, naming the failure.
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"name": "broken_policy"}}, registry=reg)
    msg = str(info.value)
    assert "scheduler.name" in msg and "unknown scheduler 'broken_policy'" in msg
    assert "fake-broken 0.9" in msg and "ModuleNotFoundError" in msg and "available: fcfs" in msg


def test_duplicate_component_names_both_distributions(site, llama_path):
    """Two installed packages providing one name break nothing until the name is selected;
    then the error names both distributions and how to pick one, and either spelling picks."""
    install_fake_dist(site, "fake-a", "1.0", {"fake_a": SCHED_PLUGIN.format(name="twin")},
                      {"fake_a": "fake_a"})
    install_fake_dist(site, "fake-b", "2.0", {"fake_b": SCHED_PLUGIN.format(name="twin")},
                      {"fake_b": "fake_b"})
    reg = load_registry()
    assert "twin" in reg.choices("scheduler") and "twin" not in reg.components["scheduler"]
    from corellm.config.compose import load_config
    load_config({"model": {"path": str(llama_path)}}, registry=reg)     # not selected: fine
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"name": "twin"}}, registry=reg)
    msg = str(info.value)
    assert "scheduler.name" in msg and "scheduler 'twin' is provided by 2 plugins" in msg
    assert "fake-a 1.0" in msg and "fake-b 2.0" in msg
    assert "'fake-a:twin' or 'fake-b:twin'" in msg and "plugins.disable" in msg
    assert reg.get("scheduler", "fake-b:twin").plugin.distribution == "fake-b"
    assert reg.get("scheduler", "fake_a:twin").plugin.distribution == "fake-a"   # the plugin name
    with pytest.raises(PluginError, match="provided by 2 plugins"):
        reg.get("scheduler", "twin", usable=False)
    cfg = load_config({"model": {"path": str(llama_path)},
                       "scheduler": {"name": "fake-a:twin", "max_num_seqs": 3}}, registry=reg)
    assert cfg.scheduler.name == "fake-a:twin" and cfg.scheduler.max_num_seqs == 3
    with pytest.raises(PluginError, match="no plugin or distribution 'fake-z' provides 'twin'"):
        reg.get("scheduler", "fake-z:twin")
    # Disabling one resolves the name.
    assert load_registry(disable=["fake_b"]).get("scheduler", "twin").plugin.distribution == \
        "fake-a"
    [conflict] = [c for c in reg.conflicts() if c.name == "twin"]
    assert conflict.chosen is None and len(conflict.providers) == 2


def test_installed_plugin_takes_precedence_over_a_builtin_name(site, caplog):
    install_fake_dist(site, "fake-c", "1.0", {"fake_c": SCHED_PLUGIN.format(name="fcfs")},
                      {"fake_c": "fake_c"})
    reg = load_registry()
    with caplog.at_level(logging.INFO, logger="corellm.plugins.discovery"):
        entry = reg.get("scheduler", "fcfs")
    assert entry.plugin.distribution == "fake-c"
    assert "scheduler 'fcfs': using scheduler 'fcfs' of plugin 'fake_c'" in caplog.text
    assert "'corellm:fcfs'" in caplog.text                 # how to get the built-in back
    builtin = reg.get("scheduler", "corellm:fcfs")
    assert builtin.plugin.builtin and f"from corellm {corellm.__version__}" in \
        builtin.plugin.describe()
    assert reg.get("scheduler", "scheduler_fcfs:fcfs") is builtin         # by plugin name
    [conflict] = reg.conflicts()
    assert conflict.chosen is entry


def test_duplicate_architecture_is_chosen_by_model_implementation(site, caplog):
    """A package implementing a built-in architecture takes precedence (stated and logged);
    model.implementation picks either; two packages for one architecture need it."""
    src = """
        from corellm import hookimpl
        from corellm.components import ModelSpec
        @hookimpl
        def corellm_models():
            yield ModelSpec(name="{name}", architectures=["LlamaForCausalLM"], factory=None)
    """
    install_fake_dist(site, "fake-m", "1.0", {"fake_m": src.format(name="my-llama")},
                      {"fake_m": "fake_m"})
    reg = load_registry()
    with caplog.at_level(logging.INFO, logger="corellm.plugins.discovery"):
        chosen = reg.model_for(["LlamaForCausalLM"])
    assert chosen.spec.name == "my-llama"
    assert "architecture 'LlamaForCausalLM': using model 'my-llama'" in caplog.text
    assert reg.model_for(["LlamaForCausalLM"], "llama").plugin.builtin
    assert reg.model_for(["LlamaForCausalLM"], "fake-m:my-llama") is chosen
    with pytest.raises(PluginError, match="model.implementation: 'llama' .* implements .*not "
                                          "the checkpoint's GPT2LMHeadModel"):
        reg.model_for(["GPT2LMHeadModel"], "llama")
    install_fake_dist(site, "fake-n", "1.0", {"fake_n": src.format(name="other-llama")},
                      {"fake_n": "fake_n"})
    reg = load_registry()
    with pytest.raises(PluginError) as info:
        reg.model_for(["LlamaForCausalLM"])
    msg = str(info.value)
    assert "architecture 'LlamaForCausalLM' is provided by 3 plugins" in msg
    assert "fake-m 1.0" in msg and "fake-n 1.0" in msg
    assert "model.implementation: 'fake-m:my-llama' or 'fake-n:other-llama' or 'corellm:llama'" \
        in msg
    assert reg.model_for(["LlamaForCausalLM"], "other-llama").plugin.distribution == "fake-n"


def test_a_package_implementing_a_builtin_architecture_runs_when_chosen(site, llama_path):
    """End to end: a private LlamaForCausalLM package takes over the architecture (its factory
    runs), and model.implementation gets the built-in back with its outputs."""
    install_fake_dist(site, "fake-private", "1.0", {"fake_private": """
        from corellm import hookimpl
        from corellm.components import ModelSpec
        def make(arch, ctx):
            raise RuntimeError("private llama factory ran")
        @hookimpl
        def corellm_models():
            yield ModelSpec(name="private-llama", architectures=["LlamaForCausalLM"],
                            factory=make)
    """}, {"fake_private": "fake_private"})
    from corellm import LLM, SamplingParams
    base = {"model": {"path": str(llama_path), "dtype": "float32"},
            "kv_cache": {"num_blocks": 32}}
    with pytest.raises(PluginError, match=r"model 'private-llama' of plugin 'fake_private' "
                                          r".*fake-private 1.0.*private llama factory ran"):
        LLM(base)
    with LLM({**base, "model": {**base["model"], "implementation": "corellm:llama"}}) as llm:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("source, stage, needle", [
    ("from corellm import hookimpl\n@hookimpl\ndef corellm_step_finished(stats, extra_arg):\n"
     "    pass\n", "does not match corellm.hookspecs", "extra_arg"),
    # A misspelt hook (unmarked, as plugin authors often write them) is caught, not ignored.
    ("def corellm_scheduler():\n    return []\n", "does not match corellm.hookspecs",
     "unknown hook 'corellm_scheduler'"),
    ("def corellm_schedulers():\n    return [{'name': 'dict-instead-of-spec'}]\n",
     "registered invalid components", "expected SchedulerSpec objects"),
    ("from corellm.components import SchedulerSpec, NoOptions\n"
     "def corellm_schedulers():\n    yield SchedulerSpec(name='x', factory=None, "
     "options=NoOptions)\n", "registered invalid components",
     "must subclass corellm.components.SchedulerOptions"),
    ("def corellm_schedulers():\n    raise ValueError('boom')\n",
     "registered invalid components", "corellm_schedulers() raised ValueError('boom')"),
    ("CORELLM_PLUGIN_API = '2.0'\n", "was not loaded",
     "written for corellm plugin API 2.0"),
    # Malformed beyond what the checks expect: a non-string name; a lazy module whose
    # __getattr__ raises for any attribute corellm reads.
    ("from corellm.components import SchedulerSpec\ndef corellm_schedulers():\n"
     "    yield SchedulerSpec(name=5, factory=None)\n", "registered invalid components",
     "cannot be checked"),
    ("def __getattr__(name):\n    raise ImportError('lazy ' + name)\n", "was not loaded",
     "reading CORELLM_PLUGIN_API raised ImportError('lazy CORELLM_PLUGIN_API')"),
])
def test_a_bad_installed_plugin_is_set_aside(site, llama_path, caplog, source, stage, needle):
    """Whatever is wrong with an installed package, corellm keeps working: the plugin is left
    out, with a warning and a BROKEN entry naming its distribution; strict mode
    (CORELLM_STRICT_PLUGINS) makes it an error, as it always is for an in-process plugin."""
    install_fake_dist(site, "fake-bad", "3.1", {"fake_bad": source + SCHED_PLUGIN.format(
        name="bad_sched") if "corellm_schedulers" not in source else source},
                      {"fake_bad": "fake_bad"})
    with caplog.at_level(logging.WARNING):
        reg = load_registry()
    [broken] = reg.broken
    assert broken.info.distribution == "fake-bad"
    text = broken.describe()
    assert "fake-bad 3.1" in text and stage in text and needle in text, text
    assert "fake_bad" not in reg.plugins and "fake_bad" in caplog.text
    assert "bad_sched" not in reg.choices("scheduler")      # none of its components stay
    from corellm.config.compose import load_config
    load_config({"model": {"path": str(llama_path)}}, registry=reg)
    with pytest.raises(PluginError, match="CORELLM_STRICT_PLUGINS") as info:
        load_registry(strict=True)
    assert needle in str(info.value)


def test_plugin_api_version_declared_by_a_plugin(site):
    from corellm.plugins.discovery import PLUGIN_API_VERSION, parse_api_version
    major, minor = PLUGIN_API_VERSION
    for declared, ok in [(f"{major}.{minor}", True), (f"{major}.0", True), ((major, minor), True),
                         (major, True), (f"{major}.{minor + 1}", False),
                         (f"{major + 1}.0", False), ("one", False)]:
        for mod in [m for m in sys.modules if m.startswith("fake_")]:
            del sys.modules[mod]
        name = f"fake_api{abs(hash(str(declared))) % 10**6}"
        install_fake_dist(site, name.replace("_", "-"), "1.0", {
            name: f"CORELLM_PLUGIN_API = {declared!r}\n" + SCHED_PLUGIN.format(name=name)},
                          {name: name})
        reg = load_registry()
        assert (name in reg.choices("scheduler")) == ok, (declared, reg.broken)
        if not ok:
            [broken] = [b for b in reg.broken if b.info.name == name]
            if declared == f"{major}.{minor + 1}":
                assert (f"needs corellm plugin API {major}.{minor + 1}" in broken.error
                        and f"provides plugin API {major}.{minor}: upgrade corellm"
                        in broken.error), broken.error
            elif declared == f"{major + 1}.0":
                assert "different major versions are incompatible" in broken.error
        install_dir = site / f"{name}-1.0.dist-info"
        import shutil
        shutil.rmtree(install_dir)
        (site / f"{name}.py").unlink()
        importlib.invalidate_caches()
    assert parse_api_version("1") == (1, 0)


def test_in_process_plugin_declaring_another_api_is_an_error():
    class Future:
        CORELLM_PLUGIN_API = "99.0"
    with pytest.raises(PluginError, match="Future.*written for corellm plugin API 99.0"):
        load_registry(plugins=[Future()])


def test_two_distributions_with_one_entry_point_name(site, caplog):
    install_fake_dist(site, "fake-x", "1.0", {"fake_x1": SCHED_PLUGIN.format(name="x1")},
                      {"samename": "fake_x1"})
    install_fake_dist(site, "fake-y", "1.0", {"fake_y1": SCHED_PLUGIN.format(name="y1")},
                      {"samename": "fake_y1"})
    with caplog.at_level(logging.WARNING):
        reg = load_registry()
    assert {"x1", "y1"} <= set(reg.choices("scheduler")) and not reg.broken
    assert "two distributions have a corellm entry point named 'samename'" in caplog.text
    names = {reg.get("scheduler", n).plugin.name for n in ("x1", "y1")}
    assert "samename" in names and len(names) == 2
    # disable by entry-point name: both; by distribution:name: one.
    assert not {"x1", "y1"} & set(load_registry(disable=["samename"]).choices("scheduler"))
    left = set(load_registry(disable=["fake-y:samename"]).choices("scheduler"))
    assert "x1" in left and "y1" not in left


def test_disable_and_allow_list(site, monkeypatch):
    install_fake_dist(site, "fake-d", "1.0", {"fake_d": SCHED_PLUGIN.format(name="lifo")},
                      {"fake_d": "fake_d"})
    assert "lifo" in load_registry().choices("scheduler")
    assert "lifo" not in load_registry(disable=["fake_d"]).choices("scheduler")
    monkeypatch.setenv("CORELLM_PLUGINS", "scheduler_fcfs,kv_paged")
    reg = load_registry()
    assert reg.choices("scheduler") == ["fcfs"] and reg.choices("kv_cache") == ["paged"]
    assert reg.choices("attention") == []
    with pytest.raises(PluginError, match="unknown attention 'torch_sdpa'; available: \\(none\\)"):
        reg.get("attention", "torch_sdpa")


def test_config_plugins_disable(site):
    from corellm.engine.llm import build_config
    install_fake_dist(site, "fake-e", "1.0", {"fake_e": "raise RuntimeError('should not load')"},
                      {"fake_e": "fake_e"})
    _, reg = build_config({"plugins": {"disable": ["fake_e"]}}, None, ())
    assert not reg.broken


def test_in_process_plugin_object():
    class Observer:
        def __init__(self):
            self.calls = 0

        def corellm_schedulers(self):
            from corellm.components import SchedulerSpec
            return [SchedulerSpec(name="inproc", factory=lambda o, c: None)]
    reg = load_registry(plugins=[Observer()])
    entry = reg.get("scheduler", "inproc")
    assert entry.plugin.distribution is None and "registered in-process" in entry.plugin.describe()


def test_unknown_names_in_disable_and_allow_list_warn(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING):
        load_registry(disable=["no_such_plugin"])
    assert "plugins.disable names 'no_such_plugin'" in caplog.text
    assert "scheduler_fcfs" in caplog.text                 # lists what is installed
    caplog.clear()
    monkeypatch.setenv("CORELLM_PLUGINS", "scheduler_fcfs,shedluer_typo")
    with caplog.at_level(logging.WARNING):
        load_registry()
    assert "CORELLM_PLUGINS names 'shedluer_typo'" in caplog.text


def test_registration_hook_wrappers_rejected():
    import pluggy

    class Wrapper:
        @pluggy.HookimplMarker("corellm")(wrapper=True)
        def corellm_schedulers(self):
            return (yield)
    with pytest.raises(PluginError, match="registration hook; it takes plain implementations"):
        load_registry(plugins=[Wrapper()])


def test_a_renamed_builtin_entry_point_still_answers_to_its_old_name(monkeypatch):
    """A built-in entry point that is renamed (``RENAMED_BUILTINS``; the sim executor's plugin
    was executor_sim until 0.5, bench since) keeps answering to its old name for a release:
    it selects, disables and allows the plugin, with a deprecation warning."""
    from corellm.errors import CorellmDeprecationWarning
    from corellm.plugins import registry as registry_module

    monkeypatch.setitem(registry_module.RENAMED_BUILTINS, "executor_sim", ("bench", "9.9"))
    with pytest.warns(CorellmDeprecationWarning, match="'executor_sim'.*9.9; use 'bench'"):
        assert "sim" not in load_registry(disable=["executor_sim"]).choices("executor")
    with pytest.warns(CorellmDeprecationWarning):
        assert "sim" not in load_registry(disable=["corellm:executor_sim"]).choices("executor")
    registry = load_registry()
    with pytest.warns(CorellmDeprecationWarning):
        assert registry.get("executor", "executor_sim:sim").plugin.entry_point == "bench"
    monkeypatch.setenv("CORELLM_PLUGINS", "executor_sim,executor_uniproc")
    with pytest.warns(CorellmDeprecationWarning):
        assert load_registry().choices("executor") == ["sim", "uniproc"]
    monkeypatch.delitem(registry_module.RENAMED_BUILTINS, "executor_sim")
    monkeypatch.delenv("CORELLM_PLUGINS")
    with pytest.raises(PluginError, match="executor_sim"):
        load_registry().get("executor", "executor_sim:sim")


def test_a_broken_plugin_is_logged_once_per_process_and_named_only_where_it_could_help(
        site, caplog):
    """Every registry of a process (an engine's, its workers', a server's) meets the same broken
    plugin: the warning is logged once. An unknown-name error lists a broken plugin only for
    the kinds it registers (or any kind, when it failed before corellm could see its hooks)."""
    install_fake_dist(site, "fake-bad-sampler", "1.0", {"fake_bad_sampler": """
        from corellm import hookimpl
        CORELLM_PLUGIN_API = "9.0"

        @hookimpl
        def corellm_samplers():
            return []
    """}, {"fake_bad_sampler": "fake_bad_sampler"})
    install_fake_dist(site, "fake-unimportable", "1.0", {"fake_unimportable": """
        import no_such_module_for_this_test
    """}, {"fake_unimportable": "fake_unimportable"})
    with caplog.at_level(logging.WARNING, logger="corellm.plugins.discovery"):
        registry = load_registry()
        load_registry()
        load_registry()
    assert caplog.text.count("fake-bad-sampler 1.0") == 1
    assert caplog.text.count("fake-unimportable 1.0") == 1
    with pytest.raises(PluginError) as scheduler_error:
        registry.get("scheduler", "nope")
    assert "fake_bad_sampler" not in str(scheduler_error.value)       # registers no scheduler
    assert "fake_unimportable" in str(scheduler_error.value)          # might have
    with pytest.raises(PluginError) as sampler_error:
        registry.get("sampler", "nope")
    assert "fake_bad_sampler" in str(sampler_error.value)


def test_an_empty_allow_list_is_named_by_the_errors_it_causes(monkeypatch):
    monkeypatch.setenv("CORELLM_PLUGINS", "")
    registry = load_registry()
    assert registry.choices("scheduler") == []
    with pytest.raises(PluginError, match=r"unknown scheduler 'fcfs'; available: \(none\)\n"
                                          r"  note: CORELLM_PLUGINS='' is set: entry-point "
                                          r"plugins left out: .*scheduler_fcfs"):
        registry.get("scheduler", "fcfs")
    monkeypatch.delenv("CORELLM_PLUGINS")
    with pytest.raises(PluginError) as error:
        load_registry().get("scheduler", "nope")
    assert "CORELLM_PLUGINS" not in str(error.value)


def test_a_command_reports_a_broken_plugin_once(site, tmp_path, capsys):
    """The command line loads a registry before logging is configured, silenced (to list
    plugin commands); that load must not use up the warning the command's own load gives."""
    from corellm.cli.commands import main

    install_fake_dist(site, "fake-broken-cli", "0.9",
                      {"fake_broken_cli": "import no_such_module_for_the_cli\n"},
                      {"fake_broken_cli": "fake_broken_cli"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    assert main(["config", "validate", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert err.count("fake-broken-cli 0.9") == 1 and "no_such_module_for_the_cli" in err
