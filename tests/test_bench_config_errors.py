"""``corellm bench``'s config errors: every target's config is read and validated before the
first run, so an invalid one stops the benchmark before anything runs, with an error that names
the target, its file and the key path (every problem of every target at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corellm.cli.commands import main
from corellm.errors import ConfigError
from corellm_plugins.bench.targets import Target, prepare_configs
from tests.conftest import engine_config

WORKLOAD = ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
            "--num-warmups", "0", "--no-progress"]


def _write(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def configs(llama_path, tmp_path) -> tuple[Path, Path]:
    """A valid config and one with a misspelt scheduler key, for the tiny checkpoint."""
    ok = _write(tmp_path / "ok.json", engine_config(llama_path, scheduler={"max_num_seqs": 2}))
    typo = _write(tmp_path / "typo.json", engine_config(llama_path,
                                                        scheduler={"max_num_seqz": 2}))
    return ok, typo


def test_an_invalid_second_target_stops_the_run_before_the_first_runs(configs, tmp_path,
                                                                      capsys):
    ok, typo = configs
    out = tmp_path / "r.json"
    rc = main(["bench", "-c", f"a={ok}", "-c", f"b={typo}", *WORKLOAD,
               "--result-filename", str(out)])
    captured = capsys.readouterr()
    assert rc == 2
    assert f"target 'b' ({typo}): scheduler.max_num_seqz: unknown option; did you mean " \
           "max_num_seqs?" in captured.err, captured.err
    assert "target 'a'" not in captured.err
    # Nothing ran: no run log line, no table, no result file.
    assert "run 1/1 of 'a'" not in captured.err and "'a' #1" not in captured.err
    assert captured.out == "" and not out.exists()


def test_every_invalid_target_is_reported_at_once(configs, tmp_path, capsys):
    """A missing file, a misspelt key and a bad --set value: one error, each problem at its
    target and file; with --set the file is still named, and so is the default config."""
    ok, typo = configs
    missing = tmp_path / "missing.yaml"
    assert main(["bench", "-c", f"m={missing}", "-c", f"b={typo}", "-c", str(ok),
                 "--set", "kv_cache.block_size=0", *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert f"target 'm' ({missing}): config file '{missing}' does not exist" in err
    assert f"target 'b' ({typo}): scheduler.max_num_seqz: unknown option" in err
    assert f"target 'b' ({typo}): kv_cache.block_size: Input should be greater than" in err
    assert f"target 'ok' ({ok}): kv_cache.block_size: Input should be greater than" in err
    assert "run 1/1" not in err
    assert main(["bench", "--set", "scheduler.max_num_seqz=2", *WORKLOAD]) == 2
    assert ("target 'demo' (the default config): scheduler.max_num_seqz: unknown option"
            in capsys.readouterr().err)


def test_a_single_invalid_config_names_its_file(configs, capsys):
    _, typo = configs
    assert main(["bench", "-c", str(typo), *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert "corellm: error: invalid corellm config:\n" in err, err
    assert f"  target 'typo' ({typo}): scheduler.max_num_seqz: unknown option" in err


def test_a_sweep_names_the_target_file_of_an_invalid_point(configs, capsys):
    ok, _ = configs
    assert main(["bench", "-c", f"a={ok}", "--sweep", "scheduler.max_num_seqs=2,0",
                 *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert f"--sweep max_num_seqs=0 (a, {ok}): scheduler.max_num_seqs: Input should be" in err
    assert "max_num_seqs=2 (" not in err and "run 1/1" not in err


def test_prepare_configs_keeps_the_file_and_the_servers(configs):
    """--set makes a config a dict, which still names its file; a config given as a path is
    left a path (the result file records it); a running server is left alone, and refused
    when there are overrides."""
    ok, typo = configs
    targets = [Target("a", config=str(ok)), Target("s", url="http://127.0.0.1:9")]
    same = prepare_configs(targets)
    assert same[0].config == str(ok) and same[1] is targets[1]
    assert same[0].describe()["config_file"] == str(ok)
    with pytest.raises(ConfigError, match="running server"):
        prepare_configs(targets, [("scheduler.max_num_seqs", 3)])
    [changed] = prepare_configs(targets[:1], [("scheduler.max_num_seqs", 3)])
    assert changed.config["scheduler"] == {"max_num_seqs": 3}
    assert changed.config_file == str(ok) and changed.named() == f"target 'a' ({ok})"
    # A sweep validates each point instead: its base is read (so a missing file is named
    # with its target) but not validated.
    [base] = prepare_configs([Target("b", config=str(typo))], validate=False)
    assert base.config == str(typo)
    with pytest.raises(ConfigError) as exc:
        prepare_configs([Target("m", config=str(ok) + ".missing")], validate=False)
    assert exc.value.problems[0][0] == f"target 'm' ({ok}.missing)"
