"""Every example package in examples/, pip-installed into one fresh virtual environment with
corellm, discovered through its entry point and run end to end from the command line, with its
own config.yaml: the third-party experience, not an in-process import.

Examples that must not change what greedy decoding produces (a scheduling policy, a KV-cache
manager, an attention backend, a platform, an executor wrapper) are held token for token to
the built-in components' output on the same prompt; the others are checked for what they
promise. The per-example tests (test_example_*.py) check behaviour in detail."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import threading
import tomllib
from pathlib import Path

import httpx
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


XML_TOOLS_OUTPUT = ('<thought>\nhm\n</thought>\n'
                    '<function=get_weather>{"city": "Oslo"}</function>')
_READY = re.compile(r"serving '(?P<model>[^']+)' on (?P<url>http://\S+) ")


def _check_xml_tools(run, tmp_path: Path, overrides: list[str]) -> None:
    """`corellm serve` with corellm-xml-tools' config in the fresh venv (its python and
    environment, as ``run`` uses them), on a free port: a chat request with tools whose output
    a regular expression makes the example's format comes back as reasoning and a call, whole
    and streamed; SIGINT stops the server."""
    python, env = json.loads(run("-c", "import json, os, sys; "
                                       "print(json.dumps([sys.executable, dict(os.environ)]))"
                                 ).stdout)
    config = REPO / "examples" / "corellm-xml-tools" / "config.yaml"
    proc = subprocess.Popen([python, "-m", "corellm", "serve", "-c", str(config), *overrides,
                             "--port", "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    ready = threading.Event()
    found: dict[str, str] = {}

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            if not found and (m := _READY.search(line)):
                found.update(m.groupdict())
                ready.set()
        ready.set()                     # the server exited

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and found, "the server did not start:\n" + "".join(log)
        url, model = found["url"], found["model"]
        tools = [{"type": "function", "function": {
            "name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}]
        body = {"model": model, "tools": tools, "max_tokens": 120, "temperature": 0,
                "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
        if importlib.util.find_spec("xgrammar") is None:
            # No structured outputs here: the random model's text, whatever it is, is read.
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
        else:
            body["structured_outputs"] = {"regex": re.escape(XML_TOOLS_OUTPUT)}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            message = choice["message"]
            assert choice["finish_reason"] == "tool_calls", choice
            assert message["reasoning_content"] == "hm" and message["content"] is None
            call, = message["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
            # Streamed: the reasoning, then the call's id and name once, then its arguments.
            reasoning, names, arguments, finish = "", [], "", None
            with httpx.stream("POST", url + "/v1/chat/completions",
                              json={**body, "stream": True}, timeout=120) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for c in json.loads(line[len("data: "):])["choices"]:
                        delta = c["delta"]
                        reasoning += delta.get("reasoning_content") or ""
                        assert not delta.get("content"), delta
                        for t in delta.get("tool_calls") or ():
                            names += [t["function"]["name"]] if "id" in t else []
                            arguments += t.get("function", {}).get("arguments") or ""
                        finish = c["finish_reason"] or finish
            assert (reasoning, names, finish) == ("hm", ["get_weather"], "tool_calls")
            assert arguments == call["function"]["arguments"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(log[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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

    # The parsers: the OpenAI server of the example's config reads the output (driven by a
    # regular expression into the example's formats) as reasoning and a call of a tool.
    _check_xml_tools(run, tmp_path, overrides)
    checked.add("corellm-xml-tools")

    assert checked == {example.name for example in EXAMPLES}, "an example nothing ran"
