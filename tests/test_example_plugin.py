"""The example out-of-tree plugin, examples/corellm-spf-scheduler.

The fast tests register its module in-process. The slow test pip-installs corellm and the example
(as regular, non-editable installs) into a fresh virtual environment and checks that the scheduler
is discovered through its entry point and really orders requests shortest prompt first.
"""

from __future__ import annotations

import inspect
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import assert_pool_whole, engine_config
from tests.plugin_fixtures import fresh_venv, source_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-spf-scheduler"
EXAMPLE_MODULE = "corellm_spf"
EXAMPLE_ENTRY_POINT = "scheduler_spf"      # [project.entry-points.corellm] in its pyproject.toml
SPF = "shortest_prompt_first"

# Prompt lengths in tokens, in the order the requests are submitted. With max_num_seqs=1, each
# request runs to completion before the next is admitted, so the finishing order is the admission
# order. For SPF that is shortest prompt first, with equal lengths in arrival order. For FCFS it
# is the submission order.
PROMPT_LENGTHS = {"long": 40, "tie_a": 9, "mid": 20, "tie_b": 9, "short": 3}
SPF_ORDER = ["short", "tie_a", "tie_b", "mid", "long"]


def finish_order(llm, lengths: dict[str, int]) -> list[str]:
    """Submit one request per entry of ``lengths`` in a single batch, step the engine until all
    have finished, and return the request ids in finishing order.

    The slow test copies this function's source into a script that runs in the virtual
    environment, so everything it uses is imported inside it.
    """
    from corellm import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid, n in lengths.items():
        _, request = llm.processor.process(
            rid, {"prompt_token_ids": list(range(10, 10 + n))}, params)
        llm.engine.add_request(request)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [out.request_id for out in llm.engine.step() if out.finished]
    return order


@pytest.fixture
def spf_module(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    yield from source_module(monkeypatch, EXAMPLE, EXAMPLE_MODULE)


def _spf_config(path, **sections) -> dict:
    # Disable the entry point in case the example is also installed in this environment. Otherwise
    # the module would be registered twice, once from the entry point and once in-process.
    return engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]}, **sections)


def test_in_process_plugin_orders_shortest_prompt_first(spf_module, llama_path):
    from corellm import LLM

    cfg = _spf_config(llama_path, scheduler={"name": SPF, "max_num_seqs": 1})
    with LLM(cfg, plugins=[spf_module]) as llm:
        assert type(llm.engine.scheduler.policy) is spf_module.ShortestPromptFirstPolicy
        assert llm.registry.get("scheduler", SPF).plugin.name == EXAMPLE_MODULE
        assert finish_order(llm, PROMPT_LENGTHS) == SPF_ORDER
        assert_pool_whole(llm)

    # The same requests under FCFS finish in submission order, so the check above tells the two
    # policies apart.
    with LLM(engine_config(llama_path, scheduler={"name": "fcfs", "max_num_seqs": 1})) as llm:
        assert finish_order(llm, PROMPT_LENGTHS) == list(PROMPT_LENGTHS)


def test_in_process_plugin_preempts_longest_prompt(spf_module, llama_path):
    """A KV pool too small for every running request forces preemption. Each victim is the
    running request with the longest prompt, every request still finishes, and no block leaks."""
    from corellm import LLM, SamplingParams

    cfg = _spf_config(llama_path, model={"max_model_len": 64},
                      kv_cache={"num_blocks": 4, "block_size": 16},
                      scheduler={"name": SPF, "max_num_seqs": 4})
    with LLM(cfg, plugins=[spf_module]) as llm:
        policy = llm.engine.scheduler.policy
        choose = policy.choose_victim
        victims = []

        def spy(running, ctx):
            victim = choose(running, ctx)
            victims.append((victim.num_prompt_tokens, max(r.num_prompt_tokens for r in running)))
            return victim

        policy.choose_victim = spy
        lengths = {"a": 10, "b": 18, "c": 14}     # 40 + 48 + 44 tokens at the end > 64 slots
        prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in lengths.values()]
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [30, 30, 30]
        assert victims and all(v == longest for v, longest in victims), victims
        assert llm.get_stats().num_preemptions == len(victims)
        assert_pool_whole(llm)


def test_example_config_validates(spf_module):
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[spf_module])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert config.scheduler.name == SPF


# --------------------------------------------------------------------------- installed for real
_ORDER_SCRIPT = '''
import json, sys
from pathlib import Path

from corellm import LLM

{finish_order}

cfg, lengths = json.loads(Path(sys.argv[1]).read_text())
llm = LLM(cfg)
policy = type(llm.engine.scheduler.policy)
print(json.dumps({{
    "files": {{name: sys.modules[name].__file__
               for name in ("corellm", "corellm_plugins", policy.__module__)}},
    "policy": f"{{policy.__module__}}.{{policy.__qualname__}}",
    "order": finish_order(llm, lengths),
}}))
'''


def _copy_tree(src: Path, dst: Path) -> Path:
    """Copy a source tree without build products and VCS data.

    pip builds a local directory in place, which writes ``build/`` and ``*.egg-info`` into it. An
    old ``build/lib`` can put stale modules into the wheel, and two test runs at the same time
    would write to the same folder. Building from a copy avoids both.
    """
    import shutil

    top_level = {".git", "build", "dist", ".benchmarks", "bench-results"}

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in ("__pycache__", ".pytest_cache", ".hypothesis")
                or n.endswith(".egg-info") or n.startswith(".venv")}
        if Path(directory) == src:
            skip |= top_level & set(names)
        return skip

    shutil.copytree(src, dst, ignore=ignore)
    return dst


@pytest.mark.slow
def test_installed_plugin_in_fresh_venv(tmp_path, llama_path):
    site_packages, run = fresh_venv(tmp_path)

    for src in (REPO, EXAMPLE):
        copy = _copy_tree(src, tmp_path / "src" / src.name)
        run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
            "--no-cache-dir", "--disable-pip-version-check", str(copy))

    # 1. Discovery: the example's entry point and the built-ins, each under its distribution.
    listing = json.loads(run("-m", "corellm", "plugins", "--json").stdout)
    assert listing["broken"] == []
    rows = {(r["kind"], r["name"]): r for r in listing["components"]}
    spf = rows[("scheduler", SPF)]
    example = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert (spf["plugin"], spf["distribution"], spf["version"]) == (
        EXAMPLE_ENTRY_POINT, "corellm-spf-scheduler", example["version"])
    assert {o["name"] for o in spf["options"]} >= {"max_num_seqs", "max_num_batched_tokens"}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    builtin_plugins = set(project["entry-points"]["corellm"])
    builtin_rows = [r for r in listing["components"] if r["plugin"] in builtin_plugins]
    assert {(r["kind"], r["name"]) for r in builtin_rows} >= {
        ("scheduler", "fcfs"), ("kv_cache_manager", "paged"), ("executor", "uniproc")}
    for row in builtin_rows:
        assert (row["distribution"], row["version"]) == ("corellm", project["version"]), row

    # 2. The command line, with a config file that selects the plugin's scheduler.
    base = {"model": {"path": str(llama_path), "dtype": "float32"}, "kv_cache": {"num_blocks": 64}}
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(
        {**base, "scheduler": {"name": SPF, "max_num_seqs": 2}}))
    run("-m", "corellm", "config", "validate", str(cfg_file))
    gen = run("-m", "corellm", "generate", "--config", str(cfg_file), "--prompt", "Hello there",
              "--max-tokens", "8", "--ignore-eos")
    assert gen.stdout.strip(), gen

    # 3. The engine really runs the plugin's policy, imported from the venv, and it orders
    # requests shortest prompt first.
    script = tmp_path / "order.py"
    script.write_text(_ORDER_SCRIPT.format(finish_order=inspect.getsource(finish_order)))
    args = tmp_path / "order.json"
    args.write_text(json.dumps([{**base, "scheduler": {"name": SPF, "max_num_seqs": 1}},
                                PROMPT_LENGTHS]))
    result = json.loads(run(str(script), str(args)).stdout.strip().splitlines()[-1])
    for name, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(site_packages.resolve()), (name, file)
    assert result["policy"] == f"{EXAMPLE_MODULE}.ShortestPromptFirstPolicy"
    assert result["order"] == SPF_ORDER
