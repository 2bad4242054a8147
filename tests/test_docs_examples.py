"""The plugin guide's examples are real: the code blocks of docs/plugins.md's attention-backend and
model sections are excerpts of the example code the tests run, and its metrics sink runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "plugins.md"

# Section of the guide -> the files its Python blocks quote.
QUOTED = {
    "An attention backend": [
        *(REPO / "examples" / "corellm-naive-attention" / "corellm_naive_attn").glob("*.py"),
        REPO / "tests" / "test_example_attention.py"],
    "A model": [*(REPO / "plugins" / "models_phi").glob("*.py")],
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
    assert len(blocks) >= 3
    for block in blocks:
        assert any(contains_lines(src, block) for src in sources), \
            f"'{title}' quotes code that is not in {[str(p) for p in QUOTED[title]]}:\n{block}"


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
