"""Config composition and its errors: every problem names its key path."""

from __future__ import annotations

import json

import pytest

import corellm
from corellm.cli.commands import main
from corellm.components import SchedulerOptions
from corellm.config.compose import EngineConfig, config_schema, load_config
from corellm.errors import ConfigError
from corellm.plugins.discovery import load_registry


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def problems(data, registry) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(data, registry=registry)
    return dict(info.value.problems)


def test_defaults(registry):
    cfg = load_config({}, registry=registry)
    assert cfg.scheduler.name == "fcfs" and cfg.kv_cache.name == "paged"
    # auto: each worker picks the attention backend for its device (tests/test_attn_triton.py).
    assert cfg.attention.name == "auto" and cfg.executor.name == "uniproc"
    assert cfg.sampler.name == "default" and cfg.frontend is None
    assert cfg.parallel.tensor_parallel_size == 1 and cfg.parallel.init_method.startswith("tcp")
    assert cfg.kv_cache.num_blocks is None and cfg.kv_cache.memory_gib is None
    assert cfg.platform.name == "cpu"            # the one platform available here


class _TestPlatforms:
    """In-process platforms: ``fake16`` (available, auto_priority 100, 16-token blocks) and
    ``absent`` (unavailable, with a reason)."""

    @staticmethod
    def _make(options):
        from corellm.platforms.interface import Platform

        class Fake(Platform):
            device_type = "cpu"
            default_block_size = 16

            def device(self, local_rank=0):
                import torch
                return torch.device("cpu")

            def free_memory(self, device, local_world_size=1):
                return None
        return Fake(options)

    @corellm.hookimpl
    def corellm_platforms(self):
        from corellm.components import PlatformSpec
        yield PlatformSpec(name="fake16", factory=self._make, auto_priority=100,
                           summary="test platform")
        yield PlatformSpec(name="absent", factory=self._make, auto_priority=200,
                           availability=lambda: "no such device here", summary="test platform")


def test_kv_block_size_defaults_per_platform(registry, caplog):
    """Left out, kv_cache.block_size is the platform's default_block_size (vLLM's defaults: 128
    tokens on the CPU, 16 on a GPU); platform auto picks the available platform of the highest
    priority, logging why the others were passed over; a value given is kept."""
    def size(data, reg=registry):
        return load_config(data, registry=reg).kv_cache.block_size
    assert size({"platform": {"name": "cpu"}}) == 128
    assert size({"platform": {"name": "cpu"}, "kv_cache": {"block_size": 16}}) == 16
    with_fake = load_registry(plugins=[_TestPlatforms()])
    assert size({"platform": {"name": "fake16"}}, with_fake) == 16
    with caplog.at_level("INFO", logger="corellm.config.compose"):
        cfg = load_config({}, registry=with_fake)
    assert cfg.platform.name == "fake16" and cfg.kv_cache.block_size == 16
    assert "platform.name: auto -> fake16" in caplog.text
    assert "absent: no such device here" in caplog.text
    assert "cpu: lower auto_priority (10)" in caplog.text


def test_platform_section_errors_name_their_key(registry):
    assert "did you mean weight_packing?" in problems(
        {"platform": {"name": "cpu", "weight_packin": False}}, registry)["platform.weight_packin"]
    assert "unknown platform 'gpu'" in problems({"platform": {"name": "gpu"}},
                                                registry)["platform.name"]
    # With auto, options are the chosen platform's: the CPU's here.
    assert load_config({"platform": {"weight_packing": False}},
                       registry=registry).platform.weight_packing is False
    msg = problems({"platform": {"gpu_memory_utilization": 0.8}},
                   registry)["platform.gpu_memory_utilization"]
    assert "unknown option" in msg and "platform.name: auto chose it here" in msg
    with_fake = load_registry(plugins=[_TestPlatforms()])
    msg = problems({"platform": {"name": "absent"}}, with_fake)["platform.name"]
    assert "not available here: no such device here" in msg


def test_the_model_keys_the_platform_section_took_over_are_refused_naming_it(registry):
    """model.device, model.cpu_weight_packing and model.cpu_fused_ops moved to the platform
    section in 0.4 and were removed in 0.6: each is an error at its key path naming its
    replacement, not an unknown option."""
    bad = problems({"model": {"device": "cpu", "cpu_fused_ops": False,
                              "cpu_weight_packing": False}}, registry)
    assert bad["model.device"] == ("removed in corellm 0.6 (the platform section took it "
                                   "over); use platform.name")
    assert bad["model.cpu_fused_ops"].endswith("use platform.fused_ops")
    assert bad["model.cpu_weight_packing"].endswith("use platform.weight_packing")
    assert len(bad) == 3


def test_a_platform_for_another_interface_version_is_refused():
    from corellm.components import PlatformSpec
    from corellm.errors import PluginError

    class Old:
        @corellm.hookimpl
        def corellm_platforms(self):
            yield PlatformSpec(name="old", factory=lambda o: None, interface_version=(0, 9))
    with pytest.raises(PluginError, match="platform 'old' was written for platform interface "
                                          "0.9; this corellm has 1.2"):
        load_registry(plugins=[Old()])


def test_auto_attention_takes_no_backend_options(registry):
    found = problems({"attention": {"name": "auto", "block_m": 32}}, registry)
    assert found == {"attention.block_m": "unknown option (attention.name: auto (name a "
                                          "backend to set its options) takes no options "
                                          "besides name)"}
    schema = config_schema(registry)["properties"]["attention"]["oneOf"]
    names = {v["properties"]["name"].get("const") or v["properties"]["name"]["enum"][0]
             for v in schema}
    assert names >= {"auto", "torch_sdpa", "triton"}


def test_sections_are_the_plugins_typed_options(registry):
    cfg = load_config({"scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}},
                      registry=registry)
    assert isinstance(cfg.scheduler, SchedulerOptions)
    assert type(cfg.scheduler) is registry.get("scheduler", "fcfs").spec.options
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (8, 256)
    # round trip through a dict keeps everything
    assert load_config(cfg.to_dict(), registry=registry) == cfg


def test_yaml_toml_json_and_dict_agree(tmp_path, registry):
    data = {"model": {"path": "/some/ckpt", "dtype": "float32", "max_model_len": 1024},
            "scheduler": {"name": "fcfs", "max_num_seqs": 4},
            "kv_cache": {"block_size": 32, "num_blocks": 100},
            "executor": {"tensor_parallel_size": 1}}
    (tmp_path / "c.yaml").write_text(
        "model: {path: /some/ckpt, dtype: float32, max_model_len: 1024}\n"
        "scheduler:\n  name: fcfs\n  max_num_seqs: 4\n"
        "kv_cache: {block_size: 32, num_blocks: 100}\nexecutor: {tensor_parallel_size: 1}\n")
    (tmp_path / "c.toml").write_text(
        '[model]\npath = "/some/ckpt"\ndtype = "float32"\nmax_model_len = 1024\n'
        '[scheduler]\nname = "fcfs"\nmax_num_seqs = 4\n'
        '[kv_cache]\nblock_size = 32\nnum_blocks = 100\n[executor]\ntensor_parallel_size = 1\n')
    (tmp_path / "c.json").write_text(json.dumps(data))
    expected = load_config(data, registry=registry)
    for name in ("c.yaml", "c.toml", "c.json"):
        assert load_config(tmp_path / name, registry=registry) == expected
    assert expected.model.max_model_len == 1024 and expected.kv_cache.block_size == 32


def test_misspelt_option_suggests_the_key(registry):
    p = problems({"scheduler": {"max_num_seq": 8}}, registry)
    assert p["scheduler.max_num_seq"].startswith("unknown option; did you mean max_num_seqs?")
    assert "scheduler_fcfs" in p["scheduler.max_num_seq"]       # names the plugin
    p = problems({"model": {"max_modle_len": 8}}, registry)
    assert p["model.max_modle_len"] == "unknown option; did you mean max_model_len?"


def test_prefix_caching_options(registry):
    cfg = load_config({}, registry=registry)
    assert cfg.kv_cache.enable_prefix_caching is True           # on by default
    assert cfg.kv_cache.cache_salt is None and cfg.kv_cache.hash_seed is None
    cfg = load_config({"kv_cache": {"enable_prefix_caching": False, "cache_salt": "t"}},
                      registry=registry)
    assert cfg.kv_cache.enable_prefix_caching is False and cfg.kv_cache.cache_salt == "t"
    p = problems({"kv_cache": {"enable_prefix_cache": True}}, registry)
    assert p["kv_cache.enable_prefix_cache"].startswith(
        "unknown option; did you mean enable_prefix_caching?")
    p = problems({"kv_cache": {"enable_prefix_caching": "sometimes"}}, registry)
    assert "valid boolean" in p["kv_cache.enable_prefix_caching"]


def test_misspelt_section(registry):
    assert problems({"schedular": {}}, registry)["schedular"] == \
        "unknown section; did you mean scheduler?"


def test_wrong_type_and_out_of_range(registry):
    p = problems({"scheduler": {"max_num_seqs": "many", "max_num_batched_tokens": 0},
                  "kv_cache": {"block_size": 0, "memory_gib": -1},
                  "model": {"dtype": "float64"}}, registry)
    assert "valid integer" in p["scheduler.max_num_seqs"] and "'many'" in p["scheduler.max_num_seqs"]
    assert "greater than or equal to 1" in p["scheduler.max_num_batched_tokens"]
    assert "greater than or equal to 1" in p["kv_cache.block_size"]
    assert "greater than 0" in p["kv_cache.memory_gib"]
    assert "'float32'" in p["model.dtype"]


def test_plugin_enforces_its_own_bounds(registry):
    p = problems({"executor": {"name": "multiproc", "ring_slots": 1}}, registry)
    assert "greater than or equal to 2" in p["executor.ring_slots"]


def test_unknown_plugin_lists_choices(registry):
    p = problems({"scheduler": {"name": "fcsf"}}, registry)
    assert "unknown scheduler 'fcsf'; available: fcfs, priority; did you mean 'fcfs'?" in p["scheduler.name"]


def test_section_must_be_a_mapping(registry):
    assert problems({"kv_cache": 5}, registry)["kv_cache"] == "expected a mapping, got int"


def test_all_problems_reported_at_once(registry):
    p = problems({"schedular": {}, "kv_cache": {"block_sise": 4}, "model": {"dtype": 1}}, registry)
    assert set(p) == {"schedular", "kv_cache.block_sise", "model.dtype"}


def test_file_errors(tmp_path, registry):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", registry=registry)
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad, registry=registry)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad, registry=registry)


def test_engine_config_passthrough(registry):
    cfg = EngineConfig()
    assert load_config(cfg, registry=registry) is cfg


def test_schema_covers_installed_plugins(registry):
    schema = config_schema(registry)
    sched = schema["properties"]["scheduler"]["oneOf"]
    # Every spelling that selects the component: bare, by distribution, by plugin.
    assert [v["properties"]["name"]["enum"] for v in sched] == [
        ["fcfs", "corellm:fcfs", "scheduler_fcfs:fcfs"],
        ["priority", "corellm:priority", "scheduler_priority:priority"]]
    assert "max_num_seqs" in sched[0]["properties"]
    assert "preempt_lower_priority" in sched[1]["properties"]
    assert f"corellm {corellm.__version__}" in sched[0]["description"]
    assert schema["properties"]["model"]["properties"]["max_model_len"]


def test_cli_validate_and_schema(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("scheduler: {max_num_seqs: 2}\n")
    assert main(["config", "validate", str(good), "--show"]) == 0
    assert "max_num_seqs: 2" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: {max_num_seq: 2}\n")
    assert main(["config", "validate", str(bad)]) == 2
    assert "scheduler.max_num_seq: unknown option; did you mean max_num_seqs?" in \
        capsys.readouterr().err
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "corellm engine config"


# --------------------------------------------------------------------------- vLLM's engine args
def test_llm_takes_vllms_engine_arguments(llama_path):
    """``LLM(model=..., max_num_seqs=...)``, a vLLM user's first line: each argument sets the
    config key its ``corellm serve`` flag sets, over the config given; dtype takes vLLM's
    spellings."""
    from corellm import LLM, SamplingParams
    from tests.conftest import engine_config

    with LLM(engine_config(llama_path), dtype="fp32", max_model_len=128, max_num_seqs=3,
             max_num_batched_tokens=256, block_size=16, seed=7,
             enable_prefix_caching=False) as llm:
        c = llm.config
        assert (c.model.dtype, c.model.max_model_len, c.model.seed) == ("float32", 128, 7)
        assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (3, 256)
        assert c.kv_cache.block_size == 16 and c.kv_cache.enable_prefix_caching is False
        assert c.kv_cache.num_blocks == 256                  # the config's own keys are kept
        out = llm.generate([{"prompt_token_ids": [5, 6]}] * 4,
                           SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in out)


def test_an_unknown_engine_argument_names_the_closest(llama_path):
    from corellm import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'; did you "
                                        "mean 'max_num_seqs'"):
        LLM(model=str(llama_path), max_num_seq=4)
    with pytest.raises(TypeError, match="'swap_space'.*engine arguments: async_scheduling, block_size"):
        LLM(model=str(llama_path), swap_space=4)


def test_engine_arguments_of_none_keep_the_default():
    """vLLM's None means "the default": the config key is left alone."""
    from corellm.config.schema import engine_arg_overrides

    assert engine_arg_overrides({"seed": None, "max_num_batched_tokens": None,
                                 "max_num_seqs": 8}) == [("scheduler.max_num_seqs", 8)]
