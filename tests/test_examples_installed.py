"""Every example package in examples/, pip-installed into one fresh virtual environment with
corellm, discovered through its entry point and run end to end from the command line, with its
own config.yaml: the third-party experience, not an in-process import.

Examples that must not change what greedy decoding produces (a scheduling policy, a KV-cache
manager, an attention backend, a platform, an executor wrapper) are held token for token to
the built-in components' output on the same prompt; the others are checked for what they
promise. The per-example tests (test_example_*.py) check behaviour in detail."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.plugin_fixtures import fresh_venv

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.parent for p in (REPO / "examples").glob("*/pyproject.toml"))
PROMPT = "Hello there, how are you today?"
_BAN_SCRIPT = """
import json, sys
from corellm import LLM, SamplingParams

base = json.loads(sys.argv[1])
prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], [100, 3, 250, 9, 14, 77], [42])]
greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
with LLM(base) as llm:
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
ids = sorted({tokens[0] for tokens in free})
with LLM({**base, "sampler": {"name": "ban_tokens", "token_ids": ids}}) as llm:
    sampler = llm.engine.executor.worker.runner.sampler
    banned = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
print(json.dumps({"free": free, "banned": banned, "ids": ids,
                  "sampler_file": sys.modules[type(sampler).__module__].__file__}))
"""


def _copy_tree(src: Path, dst: Path) -> Path:
    """pip builds a local directory in place (build/, *.egg-info): build from a copy."""
    import shutil

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in ("__pycache__", ".pytest_cache", ".git", "build", "dist")
                or n.endswith(".egg-info") or n.startswith(".venv")}
        if Path(directory) == REPO:
            skip |= {"benchmarks", "examples", "docs"} & set(names)
        return skip

    shutil.copytree(src, dst, ignore=ignore)
    return dst


@pytest.mark.slow
def test_every_example_installs_and_runs_from_the_command_line(tmp_path, llama_path):
    site_packages, run = fresh_venv(tmp_path, timeout=300)
    sources = [REPO, *EXAMPLES]
    copies = [str(_copy_tree(src, tmp_path / "src" / src.name)) for src in sources]
    run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
        "--no-cache-dir", "--disable-pip-version-check", *copies, timeout=600)

    # Discovery: every example's entry points, from its distribution, nothing broken or
    # ambiguous (--check), and corellm's own plugin API.
    listing = json.loads(run("-m", "corellm", "plugins", "--json", "--check").stdout)
    assert listing["broken"] == [] and listing["conflicts"] == []
    found = {(r["name"], r["distribution"]) for r in listing["plugins"]}
    for example in EXAMPLES:
        project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
        for entry_point in project["entry-points"]["corellm"]:
            assert (entry_point, project["name"]) in found, (example.name, entry_point)
    for row in listing["plugins"]:
        module = row["entry_point"].split(":")[0]
        path = run("-c", f"import {module} as m; print(m.__file__)").stdout.strip()
        assert Path(path).resolve().is_relative_to(site_packages.resolve()), (row, path)

    overrides = ["--set", f"model.path={llama_path}", "--set", "model.max_model_len=256"]

    def generate(config: Path | None, *extra: str) -> str:
        args = ["-m", "corellm", "generate", "--prompt", PROMPT, "--max-tokens", "12",
                "--ignore-eos", "--no-progress", *overrides, *extra]
        if config is not None:
            args += ["--config", str(config)]
        return run(*args, timeout=300).stdout

    reference = generate(None, "--set", "model.dtype=float32")
    assert reference.strip()
    checked = set()
    for example in EXAMPLES:
        config = example / "config.yaml"
        data = yaml.safe_load(config.read_text())
        if "frontend" in data or data.get("sampler", {}).get("name", "default") != "default":
            continue                    # checked below: they change what is produced
        workdir_report = tmp_path / "step-times.json"
        out = generate(config, "--set", f"executor.report={workdir_report}") \
            if data.get("executor", {}).get("name") == "timing" else generate(config)
        assert out == reference, (example.name, out, reference)
        checked.add(example.name)
    assert json.loads((tmp_path / "step-times.json").read_text())["steps"] > 0

    # The executor wrapper around multiproc, under tensor parallelism, from the command line.
    timing = REPO / "examples" / "corellm-timing-executor" / "config.yaml"
    tp_report = tmp_path / "tp-step-times.json"
    out = generate(timing, "--set", "parallel.tensor_parallel_size=2",
                   "--set", "executor.delegate.name=multiproc",
                   "--set", f"executor.report={tp_report}")
    assert out == reference
    assert json.loads(tp_report.read_text())["steps"] > 0
    # The sampler wrapper, discovered through its entry point: its config file runs, and banning
    # each prompt's first greedy token (the reference's) changes it and keeps every banned id out.
    generate(REPO / "examples" / "corellm-banned-tokens" / "config.yaml")
    script = tmp_path / "ban.py"
    script.write_text(_BAN_SCRIPT)
    base = {"model": {"path": str(llama_path), "dtype": "float32", "max_model_len": 256},
            "kv_cache": {"num_blocks": 64}}
    result = json.loads(run(str(script), json.dumps(base)).stdout.strip().splitlines()[-1])
    assert Path(result["sampler_file"]).resolve().is_relative_to(site_packages.resolve())
    for free, banned_run in zip(result["free"], result["banned"]):
        assert banned_run[0] != free[0] and not set(banned_run) & set(result["ids"])
    checked.add("corellm-banned-tokens")

    # The front end: `corellm serve` runs it, prompts on standard input, one JSON line each, in
    # input order (the blank line keeps its number), the same greedy text as `generate`.
    lines = REPO / "examples" / "corellm-line-frontend" / "config.yaml"
    out = run("-m", "corellm", "serve", "-c", str(lines), *overrides,
              "--set", "frontend.max_tokens=12", "--set", "frontend.ignore_eos=true",
              input=f"{PROMPT}\n\nOnce upon a time\n", timeout=300).stdout
    answers = [json.loads(line) for line in out.splitlines()]
    assert [(a["line"], a["prompt"], a["finish_reason"]) for a in answers] == [
        (1, PROMPT, "length"), (3, "Once upon a time", "length")]
    assert answers[0]["text"] + "\n" == reference
    checked.add("corellm-line-frontend")

    assert checked == {example.name for example in EXAMPLES}, "an example nothing ran"
