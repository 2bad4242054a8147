"""The example front end, examples/corellm-line-frontend, registered in-process: built by its
FrontendSpec's factory with a BuildContext, as `corellm serve` builds it, and run on files.
Its answers are held to the offline `LLM.generate` greedy outputs for the same prompts; the
command line, through the installed entry point, is in tests/test_examples_installed.py.
Also here: `AsyncLLM` is importable from `corellm` (the example's only engine import), and
docs/server.md's `AsyncLLM` example runs."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import engine_config
from tests.plugin_fixtures import source_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-line-frontend"
EXAMPLE_MODULE = "corellm_line_frontend"
EXAMPLE_ENTRY_POINT = "frontend_lines"
PROMPTS = ["The capital of France is", "Once upon a time", "1 2 3 4 5",
           "Ünïcödé prompts are fine too", "A", "The meaning of life is"]


@pytest.fixture
def lines_module(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    yield from source_module(monkeypatch, EXAMPLE, EXAMPLE_MODULE)


def build_frontend(module, path, **options):
    """What `corellm serve` does before `run()`: validate the config, build the front end."""
    from corellm.components import BuildContext
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    # The entry point is disabled in case the example is also installed here.
    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[module])
    cfg = engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]},
                        frontend={"name": "lines", **options})
    config = load_config(cfg, registry=registry)
    return BuildContext(config=config, registry=registry).build(config.frontend)


@pytest.fixture
def pool_at_shutdown(monkeypatch):
    """The engine's stats as the front end shuts it down, once every request has ended."""
    from corellm import AsyncLLM

    seen = []
    shutdown = AsyncLLM.shutdown

    async def checked_shutdown(self, timeout: float = 10.0):
        if not self.is_dead:
            seen.append(await self.get_stats())
        await shutdown(self, timeout)

    monkeypatch.setattr(AsyncLLM, "shutdown", checked_shutdown)
    return seen


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_answers_equal_offline_greedy_outputs_in_input_order(lines_module, llama_path, tmp_path,
                                                             pool_at_shutdown):
    from corellm import LLM, SamplingParams

    # A blank line is skipped but counted; Windows line ends are stripped.
    source = tmp_path / "prompts.txt"
    source.write_bytes(("\n".join(PROMPTS[:3]) + "\n\n" + "\r\n".join(PROMPTS[3:]) + "\r\n")
                       .encode())
    answers = tmp_path / "answers.jsonl"
    frontend = build_frontend(lines_module, llama_path, input=str(source),
                              output=str(answers), max_tokens=12)
    assert frontend.run() == 0

    with LLM(engine_config(llama_path)) as llm:
        reference = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0),
                                 use_tqdm=False)
    got = read_jsonl(answers)
    assert [a["line"] for a in got] == [1, 2, 3, 5, 6, 7]
    assert [a["prompt"] for a in got] == PROMPTS
    assert [(a["text"], a["finish_reason"]) for a in got] == [
        (r.outputs[0].text, r.outputs[0].finish_reason) for r in reference]
    assert {a["finish_reason"] for a in got} <= {"stop", "length"}
    assert any(a["text"] for a in got)
    [stats] = pool_at_shutdown
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


def test_a_bad_prompt_is_answered_with_its_error_and_the_rest_go_on(lines_module, llama_path,
                                                                    tmp_path):
    """One line over the model's length is refused alone; the run still exits 0."""
    source = tmp_path / "prompts.txt"
    source.write_text("Hello\n" + "word " * 600 + "\nGoodbye\n")
    answers = tmp_path / "answers.jsonl"
    frontend = build_frontend(lines_module, llama_path, input=str(source), output=str(answers),
                              max_tokens=4, ignore_eos=True)
    assert frontend.run() == 0
    hello, long, bye = read_jsonl(answers)
    assert (hello["line"], bye["line"]) == (1, 3)
    assert hello["finish_reason"] == bye["finish_reason"] == "length"
    assert "text" not in long and "prompt" in long["error"], long


def test_standard_input_and_output(lines_module, llama_path, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nOnce upon a time\n"))
    frontend = build_frontend(lines_module, llama_path, max_tokens=3, ignore_eos=True)
    assert frontend.run() == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(a["line"], a["prompt"], a["finish_reason"]) for a in got] == [
        (1, "Hello", "length"), (2, "Once upon a time", "length")]


def _when_running(frontend, n: int, action) -> threading.Thread:
    """Run ``action(engine)`` from a thread once ``n`` requests are running in the engine."""
    def wait() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            engine = frontend.engine
            stats = engine.latest_stats if engine is not None else None
            if stats is not None and stats.scheduler.num_running_reqs >= n:
                action(engine)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _long_running(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "prompts.txt"
    source.write_text("one\ntwo\nthree\n")
    return source, tmp_path / "answers.jsonl"


def test_ctrl_c_aborts_what_is_in_flight(lines_module, llama_path, tmp_path, caplog,
                                         pool_at_shutdown):
    source, answers = _long_running(tmp_path)
    frontend = build_frontend(lines_module, llama_path, input=str(source), output=str(answers),
                              max_tokens=400, ignore_eos=True)
    ended = []

    def interrupt(engine) -> None:
        engine.finished_callbacks.append(ended.extend)
        os.kill(os.getpid(), signal.SIGINT)

    thread = _when_running(frontend, 3, interrupt)
    with caplog.at_level(logging.WARNING, logger=EXAMPLE_MODULE):
        status = frontend.run()
    thread.join(5)
    assert status == 128 + signal.SIGINT
    assert answers.read_text() == ""
    assert sorted(s.request_id for s in ended) == ["line-1", "line-2", "line-3"]
    assert {s.abort_reason for s in ended} == {"interrupted"}
    assert "SIGINT: aborted 3 requests in flight" in caplog.text
    [stats] = pool_at_shutdown               # the aborts reached the core before its stop
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    # The handlers were the front end's only while it ran.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_engine_death_is_a_non_zero_exit(lines_module, llama_path, tmp_path):
    source, answers = _long_running(tmp_path)
    frontend = build_frontend(lines_module, llama_path, input=str(source), output=str(answers),
                              max_tokens=400, ignore_eos=True)
    thread = _when_running(frontend, 1, lambda engine: os.kill(engine.engine_pid, signal.SIGKILL))
    assert frontend.run() == 1
    thread.join(5)
    assert answers.read_text() == ""


def test_bad_options_are_config_errors_at_their_key_paths(lines_module, llama_path, tmp_path):
    from corellm.errors import ConfigError

    cases = [({"max_tokens": 0}, "frontend.max_tokens"),
             ({"temperature": -1}, "frontend.temperature"),
             ({"max_token": 3}, "frontend.max_token"),
             ({"input": str(tmp_path / "missing.txt")}, "frontend.input"),
             ({"output": str(tmp_path / "no-such-dir" / "a.jsonl")}, "frontend.output")]
    for options, key in cases:
        with pytest.raises(ConfigError) as err:
            build_frontend(lines_module, llama_path, **options)
        assert [path for path, _ in err.value.problems] == [key], (options, str(err.value))
    # The factory's own checks name the plugin.
    with pytest.raises(ConfigError, match=r"frontend\.input: .*missing\.txt' is not a file "
                                          r"\(frontend 'lines' of plugin 'corellm_line_fr"):
        build_frontend(lines_module, llama_path, input=str(tmp_path / "missing.txt"))


def test_example_config_validates(lines_module):
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[lines_module])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert (config.frontend.name, config.frontend.input, config.frontend.max_tokens) == (
        "lines", "-", 32)


def test_entry_module_does_not_import_torch():
    """Discovery imports the entry module on every run; the engine waits for `run()`."""
    code = (f"import sys, {EXAMPLE_MODULE}; "
            "print(sorted({'torch', 'numpy', 'transformers'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_async_llm_is_exported_and_import_corellm_stays_light():
    code = ("import sys, corellm; light = 'torch' not in sys.modules; "
            "from corellm import AsyncLLM; from corellm.engine.async_llm import AsyncLLM as A; "
            "print(light, AsyncLLM is A, 'AsyncLLM' in corellm.__all__)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True"]


def test_server_md_async_llm_example_runs(tmp_path):
    """docs/server.md's `AsyncLLM` example, run as printed, as a script."""
    import re

    doc = (REPO / "docs" / "server.md").read_text()
    found = re.search(r"^## From Python: `AsyncLLM`\n(.*?)(?=^## )", doc, re.DOTALL | re.MULTILINE)
    assert found is not None, "docs/server.md has no '## From Python: `AsyncLLM`' section"
    [block] = re.findall(r"^```python\n(.*?)^```", found.group(1), re.DOTALL | re.MULTILINE)
    assert "from corellm import AsyncLLM" in block
    script = tmp_path / "example.py"
    script.write_text(block)
    env = {**os.environ, "CORELLM_DEFAULT_MODEL": "random", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr
