"""Plugin discovery and its errors: every message names the entry point, distribution, version."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

import corellm
from corellm.errors import ConfigError, PluginError
from corellm.plugins import load_registry
from tests.plugin_fixtures import install_fake_dist

SCHED_PLUGIN = """
from corellm import hookimpl
from corellm.components import SchedulerSpec

@hookimpl
def corellm_schedulers():
    yield SchedulerSpec(name="{name}", factory=lambda o, c: None, summary="test")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[mod]


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
    from corellm.config import load_config
    load_config({"model": {"path": str(llama_path)}}, registry=reg)
    # The config names a component it might have provided: start-up stops, naming the failure.
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"name": "broken_policy"}}, registry=reg)
    msg = str(info.value)
    assert "scheduler.name" in msg and "unknown scheduler 'broken_policy'" in msg
    assert "fake-broken 0.9" in msg and "ModuleNotFoundError" in msg and "available: fcfs" in msg


def test_duplicate_component_names_both_distributions(site):
    install_fake_dist(site, "fake-a", "1.0", {"fake_a": SCHED_PLUGIN.format(name="twin")},
                      {"fake_a": "fake_a"})
    install_fake_dist(site, "fake-b", "2.0", {"fake_b": SCHED_PLUGIN.format(name="twin")},
                      {"fake_b": "fake_b"})
    with pytest.raises(PluginError, match="two plugins provide scheduler 'twin'") as info:
        load_registry()
    assert "fake-a 1.0" in str(info.value) and "fake-b 2.0" in str(info.value)


def test_duplicate_of_a_builtin_name(site):
    install_fake_dist(site, "fake-c", "1.0", {"fake_c": SCHED_PLUGIN.format(name="fcfs")},
                      {"fake_c": "fake_c"})
    with pytest.raises(PluginError, match="fake-c 1.0") as info:
        load_registry()
    assert f"from corellm {corellm.__version__}" in str(info.value)


def test_duplicate_architecture(site):
    install_fake_dist(site, "fake-m", "1.0", {"fake_m": """
        from corellm import hookimpl
        from corellm.components import ModelSpec
        @hookimpl
        def corellm_models():
            yield ModelSpec(name="my-llama", architectures=["LlamaForCausalLM"], factory=None)
    """}, {"fake_m": "fake_m"})
    with pytest.raises(PluginError, match="architecture 'LlamaForCausalLM' is implemented twice"):
        load_registry()


def test_hook_signature_mismatch_rejected(site):
    install_fake_dist(site, "fake-sig", "3.1", {"fake_sig": """
        from corellm import hookimpl
        @hookimpl
        def corellm_step_finished(stats, extra_arg):
            pass
    """}, {"fake_sig": "fake_sig"})
    with pytest.raises(PluginError, match="does not match corellm.hookspecs") as info:
        load_registry()
    assert "fake-sig 3.1" in str(info.value) and "extra_arg" in str(info.value)


def test_unknown_hook_rejected(site):
    # A misspelt hook (unmarked, as plugin authors often write them) is caught, not ignored.
    install_fake_dist(site, "fake-typo", "1.0", {"fake_typo": """
        def corellm_scheduler():
            return []
    """}, {"fake_typo": "fake_typo"})
    with pytest.raises(PluginError, match="implements a hook corellm does not define") as info:
        load_registry()
    assert "corellm_scheduler" in str(info.value) and "fake-typo 1.0" in str(info.value)


def test_wrong_spec_type_rejected(site):
    install_fake_dist(site, "fake-wrong", "1.0", {"fake_wrong": """
        def corellm_schedulers():
            return [{"name": "dict-instead-of-spec"}]
    """}, {"fake_wrong": "fake_wrong"})
    with pytest.raises(PluginError, match="expected SchedulerSpec objects"):
        load_registry()


def test_options_must_extend_the_section_base(site):
    install_fake_dist(site, "fake-opts", "1.0", {"fake_opts": """
        from corellm.components import SchedulerSpec, NoOptions
        def corellm_schedulers():
            yield SchedulerSpec(name="x", factory=None, options=NoOptions)
    """}, {"fake_opts": "fake_opts"})
    with pytest.raises(PluginError, match="must subclass corellm.components.SchedulerOptions"):
        load_registry()


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
