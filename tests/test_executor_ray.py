"""The ``ray`` executor (tensor-parallel ranks as Ray actors) and the ``ray`` core launcher
(engine cores, data-parallel replicas, as Ray actors).

Each check runs in its own process in a loopback-only network namespace (tests/ray_cases.py;
``netns`` in conftest.py says why): TP=2 over Ray equals TP=1 and the ``multiproc`` executor
token for token, on one node and across two cluster nodes; a killed rank actor is named, ends
every request and leaves nothing in the cluster, in-process and under ``corellm serve``. An
engine core on a Ray actor answers as the in-process engine does, and its sockets admit no
other peer; two replicas on a two-node cluster serve the openai client, one per node, and a
killed replica's actor is routed around and replaced. Without Ray both are listed as
unavailable with the install hint.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import engine_config, netns


def _case(name: str, path) -> dict:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'corellm[ray]')")
    proc = subprocess.run([*netns(), sys.executable, "-m", "tests.ray_cases", name, str(path)],
                          capture_output=True, text=True, timeout=600)
    out = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0 and out, (proc.stdout[-2000:] + proc.stderr[-6000:])
    return json.loads(out[-1][3:])


def test_tp2_over_ray_equals_tp1_and_multiproc(llama_path):
    got = _case("parity", llama_path)
    assert got["requests"] == 20 and got["preemptions"] > 0


def test_tp2_across_two_cluster_nodes_equals_tp1(llama_path):
    assert _case("two_nodes", llama_path)["nodes"] == 2


def test_a_killed_rank_actor_is_named_and_nothing_is_left(llama_path):
    got = _case("kill_rank", llama_path)
    assert "tensor-parallel rank 1 (Ray actor corellm-tp-" in got["message"]
    assert got["detected_s"] < 30


def test_serve_with_a_rank_actor_killed(llama_path):
    assert "died" in _case("serve_kill", llama_path)["message"]


def test_an_engine_core_on_a_ray_actor_equals_the_in_process_engine(llama_path):
    assert _case("core_launcher", llama_path)["requests"] == 30


def test_dp2_on_ray_two_nodes_serves_spreads_and_replaces_a_killed_replica(llama_path):
    got = _case("dp_two_nodes", llama_path)
    assert set(got["served"]) == {"0", "1"}
    assert "Ray actor corellm-core-" in got["message"] and "died" in got["message"]


def test_without_ray_the_executor_is_listed_unavailable_with_the_hint(llama_path, monkeypatch):
    from corellm import LLM
    from corellm.errors import ConfigError
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray fails, find_spec too
    listing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None; "
                              "from corellm.cli import main; main(['plugins'])"],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    for kind in ("executor", "core_launcher"):
        at = next(i for i, ln in enumerate(lines) if ln.split()[:2] == [kind, "ray"])
        assert lines[at + 1].strip() == ("UNAVAILABLE: needs the optional dependency 'ray' "
                                         "(pip install 'corellm[ray]')")
    with pytest.raises(ConfigError, match=r"executor.*ray.*pip install 'corellm\[ray\]'"):
        LLM(engine_config(llama_path, parallel={"tensor_parallel_size": 2},
                          executor={"name": "ray"}))
    with pytest.raises(ConfigError, match=r"core_launcher.*ray.*pip install 'corellm\[ray\]'"):
        LLM(engine_config(llama_path), data_parallel_backend="ray")
    # nothing else changes: the multiproc default still runs
    llm = LLM(engine_config(llama_path))
    try:
        assert llm.generate("hi", use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_rank_link_is_taken_only_with_the_executors_token(monkeypatch):
    """The executor's listener is on the node's address while the model loads: a connection
    is a rank's only with the token its ranks were given, for a rank it has, and nothing from
    a peer is unpickled before that; a silent peer is dropped after the handshake timeout."""
    import socket

    from corellm_plugins.executor_ray import channel
    token = b"t" * channel.TOKEN_BYTES
    for sent, kind, rank, want in ((token, "link", 1, ("link", 1)),
                                   (token, "bell", 0, ("bell", 0)),
                                   (b"x" * channel.TOKEN_BYTES, "link", 0, None),
                                   (token, "link", 2, None)):
        a, b = socket.socketpair()
        channel.greet(a, sent, kind, rank)
        assert channel.hello(b, token, 2) == want
        a.close()
        b.close()
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.2)
    a, b = socket.socketpair()
    assert channel.hello(b, token, 2) is None          # says nothing: dropped, no hang
    a.close()
    b.close()


def test_engine_cores_on_one_node_claim_different_cpus(tmp_path):
    """The ray launcher's cores on the CPU take CPUs no other core on the node holds (a lock
    file each, released when the holder closes it or its process ends); a core that finds too
    few free ones claims none."""
    import os

    from corellm_plugins.executor_ray.core_actor import claim_cpus
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs in this process's affinity mask")
    first, held = claim_cpus(1, tmp_path)
    second, held2 = claim_cpus(len(cpus) - 1, tmp_path)
    assert len(first) == 1 and not set(first) & set(second)
    assert sorted(first + second) == cpus
    assert claim_cpus(1, tmp_path) == ([], [])              # all taken
    for fd in held:
        os.close(fd)
    again, held3 = claim_cpus(1, tmp_path)
    assert again == first                                    # free again
    for fd in held2 + held3:
        os.close(fd)


def test_a_local_cluster_lingers_after_its_last_engine_then_stops(monkeypatch):
    """A local Ray this process started outlives its last engine by LOCAL_LINGER_S (a replica
    restarting after its back-off finds it up), then stops; it gives way at once to a cluster
    an engine names; a joined cluster is never stopped. Ray itself is stubbed: this is the
    bookkeeping."""
    import time

    from corellm_plugins.executor_ray import cluster
    calls: list = []

    class Ray:
        up = False

        def is_initialized(self) -> bool:
            return self.up

        def init(self, address=None, **kwargs) -> None:
            calls.append(("init", address))
            self.up = True

        def shutdown(self) -> None:
            calls.append(("shutdown",))
            self.up = False

    ray = Ray()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "LOCAL_LINGER_S", 0.3)
    monkeypatch.setattr(cluster, "_users", 0)
    monkeypatch.setattr(cluster, "_started_here", False)
    cluster.join(None, "core_launcher.address")
    cluster.join(None, "executor.address")
    assert calls == [("init", None)] and cluster.started_here()
    cluster.leave()
    cluster.leave()
    cluster.join(None, "core_launcher.address")           # within the linger: the same one
    assert calls == [("init", None)]
    cluster.leave()
    time.sleep(0.8)
    assert calls[-1] == ("shutdown",) and not ray.up
    cluster.join(None, "core_launcher.address")
    cluster.leave()                                       # lingering, unused ...
    cluster.join("10.0.0.1:6379", "core_launcher.address")  # ... gives way to a named one
    assert calls[-2:] == [("shutdown",), ("init", "10.0.0.1:6379")]
    assert not cluster.started_here()
    cluster.leave()
    time.sleep(0.8)
    assert calls[-1] == ("init", "10.0.0.1:6379")         # a joined cluster is left running
    monkeypatch.setattr(cluster, "_users", 0)
