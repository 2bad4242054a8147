"""The example platform, examples/corellm-platform-reference.

The platform every device port starts from runs models on the CPU with corellm's plain torch ops
only. The fast tests register it in-process, or install its metadata on sys.path the way an
editable install does (so discovery goes through its entry point and distribution), and check:
its greedy outputs equal transformers' token for token with tests/test_hf_equivalence.py's
settings (whole prefills, chunked prefills, preemption, prefix-cache hits); the engine really ran
on the reference ops (the core's ``DeviceOps``, no per-layer kernel state, the eager stepper, no
native attention kernels); ``corellm plugins`` lists it, available, under its distribution;
``platform: auto`` never picks it; its ``threads`` option does what it says and a bad option is
a config error naming its key and the distribution; its free memory is the host's; it imports
only public names; and the "A platform" guide quotes it verbatim. The slow test pip-installs it
into a fresh virtual environment and runs it from the command line.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from corellm.errors import ConfigError
from tests import test_hf_equivalence as hf
from tests.conftest import assert_pool_whole, engine_config
from tests.plugin_fixtures import install_fake_dist

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-platform-reference"
EXAMPLE_MODULE = "corellm_platform_reference"
EXAMPLE_ENTRY_POINT = "platform_reference"  # [project.entry-points.corellm] in its pyproject
PROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
REFERENCE = "reference"
SUMMARY = "The CPU with corellm's plain torch ops only: the starting point of a device port."
# The corellm modules a third-party package may import (the example's own list, checked below).
PUBLIC = {"corellm", "corellm.components", "corellm.platforms", "corellm.layers",
          "corellm.ops"}


def _forget_example_modules() -> dict:
    names = [n for n in sys.modules if n == EXAMPLE_MODULE or n.startswith(EXAMPLE_MODULE + ".")]
    return {name: sys.modules.pop(name) for name in names}


@pytest.fixture
def reference_module(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    saved = _forget_example_modules()
    module = importlib.import_module(EXAMPLE_MODULE)
    assert Path(module.__file__).resolve().is_relative_to(EXAMPLE)
    yield module
    _forget_example_modules()
    sys.modules.update(saved)


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    """The example as an editable install has it: its distribution's metadata (name, version and
    the entry points of its pyproject.toml) in a dist-info directory on sys.path, its module
    from the source tree. Discovery then finds it through importlib.metadata, with its
    distribution, as for a pip-installed package."""
    install_fake_dist(tmp_path, PROJECT["name"], PROJECT["version"], {},
                      PROJECT["entry-points"]["corellm"])
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    saved = _forget_example_modules()
    yield
    _forget_example_modules()
    sys.modules.update(saved)
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def hf_reference(make_checkpoint):
    """(checkpoint path, prompts, per prompt (transformers' greedy tokens, logits per step)),
    with tests/test_hf_equivalence.py's prompts and lengths."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = make_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = hf.make_prompts(model.config.vocab_size)
    gen_cfg = GenerationConfig(max_new_tokens=hf.NEW_TOKENS, min_new_tokens=0, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    return path, prompts, hf.hf_greedy(model, prompts, gen_cfg)


def _config(path, platform: dict | None = None, **sections) -> dict:
    # Disable the entry point in case the example is also installed in this environment.
    cfg = engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]},
                        platform={"name": REFERENCE, **(platform or {})}, **sections)
    cfg["model"]["max_model_len"] = hf.MAX_MODEL_LEN
    return cfg


def assert_reference_path(llm) -> None:
    """The engine runs on the reference platform's plain torch path: the core's ops on every
    core layer and in the sampler, no layer with kernel state, the eager stepper, and an
    attention backend that found no platform to build its C kernels."""
    from corellm.ops import REFERENCE_OPS, OpsModule
    from corellm.platforms.interface import ModelStepper

    runner = llm.engine.executor.worker.runner
    assert type(runner.platform).__name__ == "ReferencePlatform"
    assert type(runner.platform).__module__ == f"{EXAMPLE_MODULE}.platform"
    assert runner.platform.ops is REFERENCE_OPS
    layers = [m for m in runner.model.modules() if isinstance(m, OpsModule)]
    assert len(layers) > 4, "the model has no core layers to run through the ops"
    assert all(m.ops is REFERENCE_OPS for m in layers)
    assert all(m.kernel is None for m in layers)
    assert runner.sampler.ops is REFERENCE_OPS
    assert type(runner.stepper) is ModelStepper
    backend = runner.attn_backend
    assert type(backend).__name__ == "TorchSDPABackend"
    assert (backend.decode_path, backend.prefill_path) == ("gather", "sdpa")


# --------------------------------------------------------------------------- through the engine
@pytest.mark.parametrize("setting", [s for s in hf.SETTINGS if s != "native_gemm"])
def test_greedy_matches_transformers(reference_module, hf_reference, setting):
    from corellm import LLM, SamplingParams

    path, prompts, results = hf_reference
    with LLM(_config(path, **hf.SETTINGS[setting]), plugins=[reference_module]) as llm:
        assert_reference_path(llm)
        if setting == "prefix_cached":
            llm.generate([{"prompt_token_ids": p[:len(p) // 2 + 1]} for p in prompts],
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=hf.NEW_TOKENS, temperature=0.0,
                                              ignore_eos=True), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert (llm.get_stats().num_preemptions > 0) == (setting == "preemption")
        if setting == "prefix_cached":
            assert [o.num_cached_tokens for o in outputs] == [
                (len(p) // 2 + 1) // 16 * 16 for p in prompts]
        assert_pool_whole(llm)
    notes = [f"prompt {i} (len {len(prompts[i])}): {note}"
             for i, (o, (theirs, logits)) in enumerate(zip(outputs, results))
             if (note := hf.compare(o.outputs[0].token_ids, theirs, logits))]
    if notes:
        warnings.warn(f"{setting}: accepted near ties: {notes}", stacklevel=1)
    assert len(notes) <= 1, f"too many divergences for near ties to explain: {notes}"


def test_threads_option_sets_the_workers_threads(reference_module, llama_path):
    from corellm import LLM

    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        with LLM(_config(llama_path, platform={"threads": want}),
                 plugins=[reference_module]) as llm:
            assert llm.engine.executor.worker.platform.options.threads == want
            assert torch.get_num_threads() == want       # uniproc: the worker is this process
        torch.set_num_threads(before)
        with LLM(_config(llama_path), plugins=[reference_module]):
            assert torch.get_num_threads() == before     # no option: left as it was
    finally:
        torch.set_num_threads(before)


def test_free_memory_is_the_hosts_available_share(reference_module, llama_path):
    """The platform measures the host's available memory, divided among the workers sharing it,
    and the engine refuses a KV cache larger than that, with both numbers."""
    from corellm import LLM

    platform = reference_module._make(reference_module.ReferenceOptions())
    cpu = platform.device(0)
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024
               for line in Path("/proc/meminfo").read_text().splitlines() if "kB" in line}
    one, two = platform.free_memory(cpu, 1), platform.free_memory(cpu, 2)
    assert 0 < one <= meminfo["MemTotal"]
    assert abs(one - meminfo["MemAvailable"]) < 0.1 * meminfo["MemTotal"]  # measured again
    assert abs(two - one / 2) < 0.1 * meminfo["MemTotal"]

    cfg = _config(llama_path, kv_cache={"num_blocks": 1 << 30})     # 2**30 blocks: > 1 TiB
    with pytest.raises(ConfigError) as err:
        LLM(cfg, plugins=[reference_module])
    message = dict(err.value.problems)["kv_cache.num_blocks"]
    assert "GiB of memory is available" in message, message


# --------------------------------------------------------------------------- discovery and config
def test_corellm_plugins_lists_it_available_under_its_distribution(installed_example, capsys):
    from corellm.cli.commands import main

    assert main(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    plugin = next(p for p in listing["plugins"] if p["name"] == EXAMPLE_ENTRY_POINT)
    assert plugin == {"name": EXAMPLE_ENTRY_POINT, "entry_point": EXAMPLE_MODULE,
                      "distribution": PROJECT["name"], "version": PROJECT["version"],
                      "hooks": ["corellm_platforms"]}
    row = next(r for r in listing["components"]
               if (r["kind"], r["name"]) == ("platform", REFERENCE))
    assert (row["plugin"], row["distribution"], row["version"], row["summary"]) == (
        EXAMPLE_ENTRY_POINT, PROJECT["name"], PROJECT["version"], SUMMARY)
    assert (row["unavailable"], row["auto_priority"], row["auto_selected"]) == (None, None, False)
    assert [o["name"] for o in row["options"]] == ["threads"]
    assert row["options"][0]["default"] is None
    assert listing["broken"] == []

    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert f"{EXAMPLE_ENTRY_POINT} {PROJECT['name']} {PROJECT['version']}" in " ".join(
        text.split("\n\n")[0].split())
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["platform", REFERENCE])
    assert lines[at + 1].strip() == "available (selected by name only)"


def test_auto_never_picks_it(reference_module):
    from corellm.config.compose import load_config
    from corellm.platforms.interface import choose_platform
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[reference_module])
    chosen, skipped = choose_platform(registry)
    assert chosen != REFERENCE and f"{REFERENCE}: chosen by name only" in skipped
    assert load_config({}, registry=registry).platform.name == chosen
    # Not even when it is the only platform installed: auto then finds none.
    platforms = [name for name in registry.plugins if "corellm_platforms" in registry.hooks_of(name)
                 and name != EXAMPLE_MODULE]
    alone = load_registry(disable=[*platforms, EXAMPLE_ENTRY_POINT], plugins=[reference_module])
    assert alone.choices("platform") == [REFERENCE]
    with pytest.raises(ConfigError) as err:
        load_config({}, registry=alone)
    message = dict(err.value.problems)["platform.name"]
    assert "no installed platform is available" in message
    assert f"{REFERENCE}: chosen by name only" in message
    # Named, it runs (and its default block size applies).
    cfg = load_config({"platform": {"name": REFERENCE}}, registry=alone)
    assert (cfg.platform.name, cfg.platform.threads, cfg.kv_cache.block_size) == (
        REFERENCE, None, 16)


def test_bad_options_are_config_errors_naming_key_and_distribution(installed_example):
    from corellm.config.compose import load_config

    distribution = f"{PROJECT['name']} {PROJECT['version']}"
    cfg = load_config({"platform": {"name": REFERENCE, "threads": 3}})
    assert cfg.platform.threads == 3 and type(cfg.platform).__module__ == EXAMPLE_MODULE

    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": REFERENCE, "thread": 3}})
    message = dict(err.value.problems)["platform.thread"]
    assert "unknown option; did you mean threads?" in message
    assert f"plugin {EXAMPLE_ENTRY_POINT!r}" in message and distribution in message

    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": REFERENCE, "threads": 0}})
    assert "greater than or equal to 1" in dict(err.value.problems)["platform.threads"]

    with pytest.raises(ConfigError) as err:     # auto has no options of its own
        load_config({"platform": {"name": "auto", "threads": 3}})
    assert "platform.threads" in dict(err.value.problems)


def test_example_config_validates(reference_module):
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[reference_module])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert (config.platform.name, config.platform.threads) == (REFERENCE, 2)


# --------------------------------------------------------------------------- the package itself
def test_the_example_imports_only_public_names():
    imported = set()
    for f in (EXAMPLE / EXAMPLE_MODULE).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            for name in names:
                if name.split(".")[0] in ("corellm", "corellm_plugins"):
                    assert name in PUBLIC, f"{f.name} imports {name}"
                    imported.add(name)
    assert {"corellm.platforms", "corellm.ops"} <= imported


def test_entry_module_does_not_import_torch():
    """Discovery imports the entry module for every run; torch waits for the factory."""
    code = (f"import sys, {EXAMPLE_MODULE}; "
            "print(sorted({'torch', 'numpy', 'transformers'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------- installed for real
_ENGINE_SCRIPT = '''
import json, sys
from corellm import LLM, SamplingParams
from corellm.ops import REFERENCE_OPS

llm = LLM(json.loads(sys.argv[1]))
runner = llm.engine.executor.worker.runner
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"platform_file": sys.modules[type(runner.platform).__module__].__file__,
                  "reference_ops": runner.platform.ops is REFERENCE_OPS,
                  "tokens": out[0].outputs[0].token_ids}))
llm.shutdown()
'''


@pytest.mark.slow
def test_installed_platform_in_fresh_venv(tmp_path, llama_path):
    """pip-installs the example (a regular, non-editable install) into a fresh virtual
    environment that sees this environment's corellm, and uses it from the command line and
    from Python, discovered through its entry point."""
    from tests.test_example_plugin import _copy_tree
    from tests.plugin_fixtures import fresh_venv

    site_packages, run = fresh_venv(tmp_path, timeout=180)

    copy = _copy_tree(EXAMPLE, tmp_path / "src" / EXAMPLE.name)
    run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
        "--no-cache-dir", "--disable-pip-version-check", str(copy))

    listing = json.loads(run("-m", "corellm", "plugins", "--json").stdout)
    row = next(r for r in listing["components"]
               if (r["kind"], r["name"]) == ("platform", REFERENCE))
    assert (row["plugin"], row["distribution"], row["version"], row["unavailable"]) == (
        EXAMPLE_ENTRY_POINT, PROJECT["name"], PROJECT["version"], None)

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(
        {"model": {"path": str(llama_path), "dtype": "float32", "max_model_len": 256},
         "platform": {"name": REFERENCE, "threads": 1}, "kv_cache": {"num_blocks": 64}}))
    run("-m", "corellm", "config", "validate", str(cfg_file))
    gen = run("-m", "corellm", "generate", "--config", str(cfg_file), "--prompt", "Hello there",
              "--max-tokens", "8", "--ignore-eos", "--no-progress")
    assert gen.stdout.strip(), gen

    cfg = {"model": {"path": str(llama_path), "dtype": "float32", "max_model_len": 256},
           "kv_cache": {"num_blocks": 64}}
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    ours = json.loads(run(str(script), json.dumps({**cfg, "platform": {"name": REFERENCE}}))
                      .stdout.strip().splitlines()[-1])
    assert Path(ours["platform_file"]).resolve().is_relative_to(site_packages.resolve())
    assert ours["reference_ops"] is True
    # The same request on the built-in CPU platform's kernels gives the same greedy tokens.
    cpu = json.loads(run(str(script), json.dumps({**cfg, "platform": {"name": "cpu"}}))
                     .stdout.strip().splitlines()[-1])
    assert cpu["reference_ops"] is False and cpu["tokens"] == ours["tokens"]
