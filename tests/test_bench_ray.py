"""``corellm bench --ray``: a simulated sweep run as Ray tasks gives the local run's results.

Ray advertises the machine's address even when told 127.0.0.1, and test traffic here stays on
loopback: the Ray run goes in a loopback-only network namespace (``unshare -n``, then ``ip link
set lo up``), which needs the permission to make one (skipped, saying so, where it is missing).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import netns
from tests.test_sim import make_profile, sim_config

pytest.importorskip("ray", reason="Ray is not installed (pip install 'corellm[ray]')")


# A run's host-side timings, measured by the process that ran it (not the simulated clock).
HOST_TIMINGS = ("cpu_s", "load_s")


def _comparable(results: dict) -> dict:
    """The results less what differs between any two runs: when and where, the command, and
    each run's host-side timings (``HOST_TIMINGS``)."""
    out = dict(results)
    for key in ("environment", "date"):
        out.pop(key, None)
    out["settings"] = {k: v for k, v in out.get("settings", {}).items() if k != "command"}
    out["runs"] = [{**run, "info": {k: v for k, v in run.get("info", {}).items()
                                    if k not in HOST_TIMINGS}} for run in out["runs"]]
    return out


def test_a_12_point_sweep_on_ray_equals_the_local_run(llama_path, tmp_path):
    from corellm.cli.commands import main

    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump(sim_config(llama_path,
                                             make_profile(llama_path, tmp_path / "p.json"))))
    args = ["bench", "--config", str(cfg), "--sweep", "scheduler.max_num_seqs=1,2,4,8",
            "--sweep", "scheduler.max_num_batched_tokens=64,128,256", "--num-prompts", "24",
            "--random-input-len", "32", "--random-output-len", "8", "--request-rate", "40",
            "--seed", "1", "--no-progress"]
    local, on_ray = tmp_path / "local.json", tmp_path / "ray.json"
    assert main([*args, "--result-filename", str(local)]) == 0
    proc = subprocess.run([*netns(), sys.executable, "-m", "corellm", *args, "--ray",
                           "--result-filename", str(on_ray)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray: started a local cluster" in proc.stderr
    assert "ray: 12/12 runs done" in proc.stderr, proc.stderr[-3000:]
    a, b = json.loads(local.read_text()), json.loads(on_ray.read_text())
    assert len(a["sweep"]["points"]) == 12
    assert _comparable(a) == _comparable(b)


def test_ray_refuses_a_server_target():
    """A server is reached over HTTP from the driver: --ray says so before starting Ray."""
    from corellm_plugins.bench.runner import run_ab
    from corellm_plugins.bench.targets import RunOptions, Target
    with pytest.raises(ValueError, match="in-process targets only; s is a server"):
        run_ab([Target("s", url="http://127.0.0.1:9")], lambda seed: None,
               RunOptions(progress=False), ray_address="auto")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    import sys as _sys

    from corellm_plugins.bench.runner import run_ab
    from corellm_plugins.bench.targets import RunOptions, Target
    monkeypatch.setitem(_sys.modules, "ray", None)             # import ray fails
    with pytest.raises(RuntimeError, match=r"pip install 'corellm\[ray\]'"):
        run_ab([Target("a", config={})], lambda seed: None, RunOptions(progress=False),
               ray_address="auto")
