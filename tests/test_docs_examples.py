"""The guides' examples are real: the code blocks of docs/plugins.md's attention-backend and model
sections are excerpts of the example code the tests run, its metrics sink runs, and the policy
package of docs/ab-testing.md, written out file by file from the page, works as a package."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import types
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import assert_pool_whole, engine_config
from tests.plugin_fixtures import fresh_venv

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "plugins.md"
AB_GUIDE = REPO / "docs" / "ab-testing.md"

# Section of the guide -> the files its Python blocks quote.
QUOTED = {
    "An attention backend": [
        *(REPO / "examples" / "corellm-naive-attention" / "corellm_naive_attn").glob("*.py"),
        REPO / "tests" / "test_example_attention.py"],
    "A model": [*(REPO / "plugins" / "models_phi").glob("*.py")],
    # The example, the test that runs it, and the core modules the guide explains (the
    # platform interface, the ops, the layers that call them).
    "A platform": [
        *(REPO / "examples" / "corellm-platform-reference" / "corellm_platform_reference")
        .glob("*.py"), REPO / "tests" / "test_example_platform.py",
        *(REPO / "corellm" / name for name in ("platforms/interface.py", "platforms/devices.py",
                                                "ops.py", "layers/layers.py"))],
    # The example, and the core's sampling module, interface and default sampler it composes.
    "A sampler": [REPO / "examples" / "corellm-banned-tokens" / "corellm_ban_tokens"
                  / "__init__.py",
                  *(REPO / name for name in ("corellm/sampling.py", "corellm/interfaces.py",
                                             "plugins/sampler_default/sampler.py"))],
    "A front end": [
        *(REPO / "examples" / "corellm-line-frontend" / "corellm_line_frontend").glob("*.py")],
    "A KV-cache manager": [REPO / "examples" / "corellm-lfu-kv" / "corellm_lfu_kv"
                           / "__init__.py"],
    "Wrapping a component": [REPO / "examples" / "corellm-timing-executor" / "corellm_timing"
                             / "__init__.py", REPO / "tests" / "test_wrappers.py"],
    "An executor": [REPO / "examples" / "corellm-timing-executor" / "corellm_timing"
                    / "__init__.py"],
}


def section(title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", GUIDE.read_text(),
                      flags=re.DOTALL | re.MULTILINE)
    assert found is not None, f"docs/plugins.md has no '## {title}' section"
    return found.group(1)


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^ *```python\n(.*?)^ *```", markdown, flags=re.DOTALL | re.MULTILINE)


def contains_lines(source: str, excerpt: str) -> bool:
    """Whether ``excerpt``'s lines occur consecutively in ``source`` at one indentation."""
    want = textwrap.dedent(excerpt).strip("\n").splitlines()
    have = source.splitlines()
    for i in range(len(have) - len(want) + 1):
        if textwrap.dedent("\n".join(have[i:i + len(want)])).splitlines() == want:
            return True
    return False


@pytest.mark.parametrize("title", list(QUOTED))
def test_guide_quotes_the_code_verbatim(title):
    sources = [p.read_text() for p in QUOTED[title]]
    blocks = python_blocks(section(title))
    assert len(blocks) >= 2
    for block in blocks:
        assert any(contains_lines(src, block) for src in sources), \
            f"'{title}' quotes code that is not in {[str(p) for p in QUOTED[title]]}:\n{block}"


def test_command_example_runs(capsys):
    """"A command": the guide's plugin, registered in-process, is a `corellm trace` command
    with its help, its flags and its exit status."""
    from corellm.cli.commands import main

    blocks = python_blocks(section("A command"))
    assert len(blocks) == 1
    plugin = types.ModuleType("trace_plugin")
    exec(compile(blocks[0], "docs/plugins.md", "exec"), plugin.__dict__)
    with pytest.raises(SystemExit):
        main(["--help"], plugins=[plugin])
    assert "record a step trace of one config" in capsys.readouterr().out
    assert main(["trace", "--config", "x.yaml", "--steps", "3"], plugins=[plugin]) == 0


def test_metrics_sink_example_runs(tmp_path):
    """The observer section's sink, run as printed: one line per step, from one engine, in
    order, written out before the engine's shutdown returned."""
    blocks = python_blocks(section("Observer hooks: a metrics sink"))
    assert len(blocks) == 1
    env = {**os.environ, "CORELLM_DEFAULT_MODEL": "random", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert out.stdout.strip() == (tmp_path / "steps.jsonl").read_text().strip()
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert len(lines) >= 8 and len({line["engine"] for line in lines}) == 1
    assert lines[0]["tokens"] > 2 and lines[-1]["tokens"] <= 2
    times = [line["time"] for line in lines]
    assert times == sorted(times)


def test_metrics_sink_example_serves_two_engines_and_an_unclosed_one(tmp_path):
    """The same sink class with one instance in two engines (an A/B run), the second never shut
    down: both engines' steps are written, and the process exits (the stop hook runs at exit,
    before Python waits for threads)."""
    block = python_blocks(section("Observer hooks: a metrics sink"))[0]
    definitions = block[:block.index('sink = JsonLinesSink("steps.jsonl")')]
    script = definitions + textwrap.dedent("""
        sink = JsonLinesSink("steps.jsonl")
        cfg = {"model": {"max_model_len": 1024}}
        a, b = LLM(cfg, plugins=[sink]), LLM(cfg, plugins=[sink])
        for llm in (a, b):
            llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
        a.shutdown()
        print("end of script", flush=True)
        """)
    env = {**os.environ, "CORELLM_DEFAULT_MODEL": "random", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "end of script"
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    by_engine: dict[str, list[int]] = {}
    for line in lines:
        by_engine.setdefault(line["engine"], []).append(line["step"])
    assert len(by_engine) == 2
    assert all(sorted(steps) == list(range(1, 5)) for steps in by_engine.values()), by_engine


# --------------------------------------------------------------------------- ab-testing.md
# "Writing a policy" prints a whole package, one fenced block per file, each preceded by an HTML
# comment naming the file (invisible when the page is rendered).
POLICY_PACKAGE = "corellm-aged-spf"
POLICY_MODULE = "corellm_aged_spf"
POLICY_FILES = {"pyproject.toml", f"{POLICY_MODULE}.py", "config.yaml"}


def policy_section() -> str:
    found = re.search(r"^## Writing a policy\n(.*?)(?=^## |\Z)", AB_GUIDE.read_text(),
                      flags=re.DOTALL | re.MULTILINE)
    assert found is not None, "docs/ab-testing.md has no '## Writing a policy' section"
    return found.group(1)


def write_policy_package(root: Path) -> Path:
    """The package's files, as the page prints them, in ``root/corellm-aged-spf``."""
    files = re.findall(r"^<!-- file: (\S+) -->\n```\w*\n(.*?)^```", policy_section(),
                       flags=re.DOTALL | re.MULTILINE)
    assert {name for name, _ in files} == POLICY_FILES and len(files) == len(POLICY_FILES), \
        [name for name, _ in files]
    package = root / POLICY_PACKAGE
    package.mkdir(parents=True)
    for name, text in files:
        (package / name).write_text(text)
    return package


@pytest.fixture
def policy_package(tmp_path, monkeypatch):
    """(the package's directory, its module imported from there)."""
    package = write_policy_package(tmp_path)
    monkeypatch.syspath_prepend(str(package))
    saved = sys.modules.pop(POLICY_MODULE, None)
    yield package, importlib.import_module(POLICY_MODULE)
    sys.modules.pop(POLICY_MODULE, None)
    if saved is not None:
        sys.modules[POLICY_MODULE] = saved


def finish_order(llm, requests: list[tuple[str, int, float]]) -> list[str]:
    """Submit (request id, prompt tokens, seconds since it arrived) in one batch, step the
    engine until all have finished, and return the ids in finishing order. With
    ``max_num_seqs: 1`` that is the order the policy admitted them in."""
    from corellm import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid, n, waited in requests:
        _, request = llm.processor.process(
            rid, {"prompt_token_ids": list(range(10, 10 + n))}, params)
        request.arrival_time -= waited
        llm.engine.add_request(request)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [out.request_id for out in llm.engine.step() if out.finished]
    return order


def test_policy_package_is_complete(tmp_path):
    """The page names what a newcomer needs (the Request field with the prompt length, the
    hook), the entry point names the module the page prints, and the printed commands are
    valid for this corellm and name files that exist."""
    from corellm.cli.commands import build_parser

    section = policy_section()
    for needed in ("`num_prompt_tokens`", "@hookimpl", "policy_scheduler(",
                   "[project.entry-points.corellm]", "pip install"):
        assert needed in section, needed
    package = write_policy_package(tmp_path)
    project = tomllib.loads((package / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["corellm"] == {"scheduler_aged_spf": POLICY_MODULE}
    assert project["tool"]["setuptools"]["py-modules"] == [POLICY_MODULE]

    commands = re.findall(r"^```bash\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    assert len(commands) == 1
    lines = commands[0].replace("\\\n", " ").splitlines()
    bench = [shlex.split(line, comments=True) for line in lines if line.startswith("corellm bench")]
    assert len(bench) == 1
    args = build_parser().parse_args(bench[0][1:])
    assert args.repeats >= 3
    assert (REPO / args.workload).is_file()
    configs = dict(c.split("=", 1) for c in args.config)
    assert (REPO / configs["fcfs"]).is_file()
    assert configs["aged_spf"] == f"{POLICY_PACKAGE}/config.yaml"
    # The package's config is fcfs.yaml with the scheduler replaced, as the page says.
    fcfs = yaml.safe_load((REPO / configs["fcfs"]).read_text())
    ours = yaml.safe_load((package / "config.yaml").read_text())
    assert {k: v for k, v in ours.items() if k != "scheduler"} == \
        {k: v for k, v in fcfs.items() if k != "scheduler"}
    shared = {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"}
    assert {k: ours["scheduler"][k] for k in shared} == {k: fcfs["scheduler"][k] for k in shared}


def test_policy_package_in_process(policy_package, llama_path):
    """The module, registered in-process, gives the scheduler aged_spf with its option, and the
    policy orders as the page says: shortest prompt first, and a prompt that arrived 1 s
    earlier counts aging_tokens_per_s (50) tokens less."""
    from corellm import LLM
    from corellm.config.compose import load_config
    from corellm.errors import ConfigError
    from corellm.plugins.discovery import load_registry

    package, module = policy_package
    registry = load_registry(plugins=[module])
    config = load_config(package / "config.yaml", registry=registry)
    assert (config.scheduler.name, config.scheduler.aging_tokens_per_s) == ("aged_spf", 50)
    with pytest.raises(ConfigError) as bad:
        load_config({"scheduler": {"name": "aged_spf", "aging_tokens_per_s": -1}},
                    registry=registry)
    assert "scheduler.aging_tokens_per_s: Input should be greater than or equal to 0" \
        in str(bad.value)

    scheduler = {**yaml.safe_load((package / "config.yaml").read_text())["scheduler"],
                 "max_num_seqs": 1}
    with LLM(engine_config(llama_path, scheduler=scheduler), plugins=[module]) as llm:
        policy = llm.engine.scheduler.policy
        assert type(policy) is module.AgedSPFPolicy and policy.rate == 50
        assert llm.registry.get("scheduler", "aged_spf").plugin.name == POLICY_MODULE
        # Arrived together: shortest prompt first, equal lengths in arrival order.
        together = [("long", 40, 0.0), ("tie_a", 9, 0.0), ("mid", 20, 0.0), ("tie_b", 9, 0.0),
                    ("short", 3, 0.0)]
        assert finish_order(llm, together) == ["short", "tie_a", "tie_b", "mid", "long"]
        # 1 s earlier: 40 - 50 goes before 3; 90 - 50 goes after 3 but before 45.
        aged = [("short", 3, 0.0), ("mid", 45, 0.0), ("old_long", 40, 1.0),
                ("old_longer", 90, 1.0)]
        assert finish_order(llm, aged) == ["old_long", "short", "old_longer", "mid"]
        assert_pool_whole(llm)

    # Without aging the same requests go strictly by prompt length: the check above tells
    # aging apart from plain shortest prompt first.
    with LLM(engine_config(llama_path, scheduler={**scheduler, "aging_tokens_per_s": 0}),
             plugins=[module]) as llm:
        assert finish_order(llm, aged) == ["short", "old_long", "mid", "old_longer"]

    # Under KV pressure the victim is the running request the policy would start last.
    policy = module.AgedSPFPolicy(50)
    running = [SimpleNamespace(num_prompt_tokens=n, arrival_time=100.0 - waited, arrival_seq=i)
               for i, (n, waited) in enumerate([(40, 1.0), (30, 0.0), (80, 1.0)])]
    assert policy.choose_victim(running, None) is running[2]      # 80 - 50 > 30 > 40 - 50


@pytest.mark.slow
def test_policy_package_installs_in_a_fresh_venv(tmp_path):
    """pip-installed with corellm into a fresh virtual environment, the package printed on the
    page is found through its entry point and its config validates, as the page's commands
    say."""
    from tests.test_example_plugin import _copy_tree

    package = write_policy_package(tmp_path / "pkg")
    site_packages, run = fresh_venv(tmp_path, timeout=300)
    run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
        "--no-cache-dir", "--disable-pip-version-check",
        str(_copy_tree(REPO, tmp_path / "src" / REPO.name)), str(package))

    listing = json.loads(run("-m", "corellm", "plugins", "--json").stdout)
    assert listing["broken"] == []
    rows = [r for r in listing["components"] if (r["kind"], r["name"]) == ("scheduler", "aged_spf")]
    assert len(rows) == 1, listing["components"]
    row = rows[0]
    assert (row["plugin"], row["distribution"], row["version"]) == (
        "scheduler_aged_spf", POLICY_PACKAGE, "0.1.0")
    assert {o["name"] for o in row["options"]} >= {"aging_tokens_per_s", "max_num_seqs"}
    where = run("-c", f"import {POLICY_MODULE} as m; print(m.__file__)").stdout.strip()
    assert Path(where).resolve().is_relative_to(site_packages.resolve()), where
    out = run("-m", "corellm", "config", "validate", str(package / "config.yaml"), "--show")
    assert "aging_tokens_per_s: 50" in out.stdout, out.stdout
