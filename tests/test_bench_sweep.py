"""``corellm bench --sweep``: parsing the values, the grid of targets (every point's config
validated before anything runs), and an end-to-end sweep on the simulated executor whose table,
JSON and plot carry every point with the noise of its repeats."""

from __future__ import annotations

import json

import pytest
import yaml

from corellm.errors import ConfigError
from corellm_plugins.bench.sweep import expand_targets, format_sweep, parse_sweep
from corellm_plugins.bench.targets import Target
from tests.test_sim import make_profile, sim_config


def test_values_are_read_as_yaml_and_split_outside_brackets():
    axis = parse_sweep("scheduler.max_num_seqs=4,8,16")
    assert axis.key == "scheduler.max_num_seqs" and axis.values == (4, 8, 16)
    assert parse_sweep("kv_cache.enable_prefix_caching=true,false").values == (True, False)
    axis = parse_sweep("plugins.disable=[a,b],[],'x,y'")
    assert axis.values == (["a", "b"], [], "x,y") and axis.texts == ("[a,b]", "[]", "'x,y'")


@pytest.mark.parametrize("text, words", [
    ("scheduler.max_num_seqs", "expected KEY=V1,V2"),
    ("scheduler.max_num_seqs=", "expected KEY=V1,V2"),
    ("scheduler.max_num_seqs=4,,8", "expected KEY=V1,V2"),
    ("=4,8", "expected KEY=V1,V2"),
    ("scheduler.max_num_seqs=4,4", "given twice"),
])
def test_malformed_sweeps_name_the_flag(text, words):
    with pytest.raises(ConfigError) as exc:
        parse_sweep(text)
    assert exc.value.problems[0][0] == "--sweep" and words in exc.value.problems[0][1]


def test_the_grid_is_every_point_for_every_config(llama_path, tmp_path):
    cfg = sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"))
    bases = [Target("a", config=cfg), Target("b", config=dict(cfg, scheduler={"name": "fcfs"}))]
    axes = [parse_sweep("scheduler.max_num_seqs=2,4"),
            parse_sweep("kv_cache.enable_prefix_caching=true,false")]
    targets, points = expand_targets(bases, axes)
    assert len(targets) == 8 and len({t.label for t in targets}) == 8
    assert targets[0].label == "a max_num_seqs=2,enable_prefix_caching=true"
    assert targets[-1].config["scheduler"] == {"name": "fcfs", "max_num_seqs": 4}
    assert targets[-1].config["kv_cache"]["enable_prefix_caching"] is False
    assert cfg.get("scheduler") is None            # the base config is not changed
    assert [p.values for p in points[:2]] == [
        (("scheduler.max_num_seqs", 2), ("kv_cache.enable_prefix_caching", True)),
        (("scheduler.max_num_seqs", 2), ("kv_cache.enable_prefix_caching", False))]
    with pytest.raises(ConfigError, match="swept twice"):
        expand_targets(bases, [axes[0], parse_sweep("scheduler.max_num_seqs=8")])


def test_an_invalid_point_stops_the_sweep_before_it_runs(llama_path, tmp_path):
    cfg = sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"))
    with pytest.raises(ConfigError) as exc:
        expand_targets([Target("a", config=cfg)], [parse_sweep("scheduler.max_num_seqs=4,0")])
    (where, message), = exc.value.problems
    assert where.startswith("--sweep max_num_seqs=0 (a): scheduler.max_num_seqs"), where
    with pytest.raises(ConfigError) as exc:
        expand_targets([Target("a", config=cfg)], [parse_sweep("scheduler.max_num_seq=4")])
    assert "did you mean max_num_seqs" in str(exc.value)
    with pytest.raises(ConfigError, match="running server"):
        expand_targets([Target("s", url="http://127.0.0.1:9")],
                       [parse_sweep("scheduler.max_num_seqs=4")])


def test_a_sweep_end_to_end_on_the_simulator(llama_path, tmp_path, capsys):
    """One seat against four on the same Poisson workload: with one seat requests queue, so
    TTFT rises; the table, the JSON's sweep section and the plot carry both points, each with
    its two repeats."""
    from corellm.cli.commands import main

    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump(sim_config(llama_path,
                                             make_profile(llama_path, tmp_path / "p.json"))))
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["bench", "--config", str(cfg), "--sweep", "scheduler.max_num_seqs=1,4",
               "--num-prompts", "40", "--random-input-len", "32", "--random-output-len", "8",
               "--request-rate", "40", "--seed", "1", "--repeats", "2", "--no-progress",
               "--sweep-metrics", "output_throughput,mean_ttft_ms,p90_e2el_ms",
               "--result-filename", str(out), "--plot", str(plot)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "sweep (mean ± sample std over the repeats)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("1 ", "4 "))]
    assert [r[0] for r in rows] == ["1", "4"] and all("±" in r for r in rows)
    assert "overall" not in text                   # the per-target table is in the JSON
    res = json.loads(out.read_text())
    sweep = res["sweep"]
    assert sweep["keys"] == ["scheduler.max_num_seqs"] and sweep["values"] == {
        "scheduler.max_num_seqs": [1, 4]}
    one, four = sweep["points"]
    assert one["values"] == {"scheduler.max_num_seqs": 1} and one["label"] == "max_num_seqs=1"
    assert all(len(p["metrics"][m]["values"]) == 2 for p in (one, four)
               for m in sweep["metrics"])
    assert one["metrics"]["mean_ttft_ms"]["mean"] > 2 * four["metrics"]["mean_ttft_ms"]["mean"]
    assert res["settings"]["sweep"] == ["scheduler.max_num_seqs=1,4"]
    assert [t["config"]["scheduler"]["max_num_seqs"] for t in res["targets"]] == [1, 4]
    assert plot.stat().st_size > 0 and (tmp_path / "sweep-cdf.png").stat().st_size > 0
    assert format_sweep(sweep).splitlines()[1].split()[:2] == ["scheduler.max_num_seqs",
                                                               "output"]


def test_set_overrides_every_config_target(llama_path, tmp_path, capsys):
    from corellm.cli.commands import main

    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump(sim_config(llama_path,
                                             make_profile(llama_path, tmp_path / "p.json"))))
    out = tmp_path / "set.json"
    assert main(["bench", "--config", f"A={cfg}", "--set", "scheduler.max_num_seqs=3",
                 "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "2",
                 "--no-progress", "--result-filename", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["targets"][0]["config"]["scheduler"] == {"max_num_seqs": 3}
    assert res["runs"][0]["info"]["max_num_seqs"] == 3
    assert main(["bench", "--config", str(cfg), "--sweep", "scheduler.max_num_seqs=1,x",
                 "--no-progress"]) != 0
    assert "scheduler.max_num_seqs" in capsys.readouterr().err
