"""The command line, including the README quickstart on the built-in demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from corellm import __version__
from corellm.cli import main
from tests.conftest import engine_config


def corellm(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "corellm", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)


def test_demo_model_quickstart(tmp_path):
    """`corellm generate` with no config builds the demo model once, then reuses it."""
    env = {"CORELLM_CACHE": str(tmp_path / "cache")}
    first = corellm("generate", "--prompt", "Hello", "--max-tokens", "8", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "building the demo model" in first.stdout
    demo = tmp_path / "cache" / "demo-llama-v1"
    assert (demo / ".complete").exists() and (demo / "model.safetensors").exists()
    second = corellm("generate", "--prompt", "Hello", "--max-tokens", "8", "--stats", env=env,
                     cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stdout
    # Deterministic: the same weights, greedy, the same text.
    assert first.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]
    assert "num_generation_tokens=" in second.stderr


def test_generate_with_config_file(tmp_path, llama_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(engine_config(llama_path)))
    rc = main(["generate", "--config", str(cfg), "-p", "one", "-p", "two", "--max-tokens", "4",
               "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- prompt: 'one' (finish_reason=length)" in out
    assert "--- prompt: 'two' (finish_reason=length)" in out


def test_generate_reports_errors_cleanly(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "-p", "x"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: model.path:" in err and "does not exist" in err


def test_plugins_listing(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "scheduler" in out and "fcfs" in out and f"corellm {__version__}" in out
    assert "max_num_seqs: int = 64" in out
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["components"]
    fcfs = next(r for r in rows if r["name"] == "fcfs")
    assert fcfs["distribution"] == "corellm" and fcfs["plugin"] == "scheduler_fcfs"
    assert {"name": "max_num_seqs", "type": "int", "default": 64,
            "description": "Most requests running at once."} in fcfs["options"]
    llama = next(r for r in rows if r["name"] == "llama")
    assert llama["architectures"] == ["LlamaForCausalLM"]
