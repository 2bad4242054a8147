"""Tensor parallelism on the CPU (gloo): two ranks give the same tokens as one, faults are named
and leave nothing behind, and a torchrun-style launch (env://, two processes on loopback)
serves the same output.

The reference is TP=1, itself held token for token against transformers by
tests/test_hf_equivalence.py; both sides run the same checkpoints through the same loader.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from corellm import LLM, SamplingParams
from corellm.platforms.distributed import free_port
from corellm.errors import ConfigError
from corellm.interfaces import ExecutorError
from tests.conftest import assert_pool_whole, engine_config

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts() -> list[dict]:
    """Shared 40-token prefixes (prefix-cache hits), prompts longer than the step's token
    budget (chunked prefill), and enough of them to run a small pool out of blocks
    (preemption)."""
    shared = [7 + (j * 5) % 600 for j in range(40)]
    out = []
    for i in range(10):
        body = [11 + (i * 37 + j * 13) % 900 for j in range(8 + 17 * i)]
        out.append({"prompt_token_ids": (shared if i % 2 else []) + body})
    return out


def _config(path, tp: int) -> dict:
    return engine_config(path, kv_cache={"num_blocks": 40, "enable_prefix_caching": True},
                         scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
                         parallel={"tensor_parallel_size": tp})


def _run(cfg: dict, prompts: list, rounds: int = 2) -> tuple[list, object]:
    llm = LLM(cfg)
    try:
        outs = []
        for _ in range(rounds):     # the second round hits the prefix cache
            outs += [o.outputs[0].token_ids
                     for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.get_stats()
        assert_pool_whole(llm)
        return outs, stats
    finally:
        llm.shutdown()


CASES = {
    # heads 4, KV heads 2: both split across the ranks
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),           # QKV bias
    # one KV head for two ranks (replicated), tied embeddings, per-head QK norm, and a
    # vocabulary the ranks do not divide (the last rank's padded rows must never win)
    "qwen3-kv1-tied-oddvocab": ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                         "vocab_size": 1031}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_token_for_token(make_checkpoint, case):
    arch, overrides = CASES[case]
    path = make_checkpoint(arch, **overrides)
    prompts = _prompts()
    ref, ref_stats = _run(_config(path, 1), prompts)
    got, stats = _run(_config(path, 2), prompts)
    assert got == ref
    # The run exercised what it claims to.
    assert stats.num_preemptions > 0 and ref_stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions == ref_stats.num_preemptions


def test_weights_are_sharded_per_rank(make_checkpoint):
    """Each rank holds its half of every sharded layer and its own KV heads."""
    path = make_checkpoint("llama")         # hidden 64, 4 heads of 16, 2 KV heads, MLP 128
    llm = LLM(_config(path, 2))
    try:
        ranks = llm.engine.executor.collective_rpc("describe")
        vocab = llm.engine.model_info.vocab_size
    finally:
        llm.shutdown()
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        p = r["params"]
        assert p["model.layers.0.self_attn.qkv_proj.weight"] == [(2 + 1 + 1) * 16, 64]
        assert p["model.layers.0.self_attn.o_proj.weight"] == [64, 32]
        assert p["model.layers.0.mlp.gate_up_proj.weight"] == [2 * 64, 64]
        assert p["model.layers.0.mlp.down_proj.weight"] == [64, 64]
        assert p["model.embed_tokens.weight"] == [-(-vocab // 2), 64]
        assert r["num_kv_heads"] == 1


# --------------------------------------------------------------------------- config errors
def test_config_errors_name_both_numbers(make_checkpoint):
    path = make_checkpoint("llama")        # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide the model's "
                                          r"num_attention_heads=4"):
        LLM(_config(path, 3))
    cfg = _config(path, 2)
    cfg["executor"] = {"name": "uniproc"}
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size: 2 needs an executor "
                                          r"that runs one worker per rank; executor 'uniproc'"):
        LLM(cfg)
    cfg = _config(path, 2)
    cfg["executor"] = {"tensor_parallel_size": 4}
    with pytest.raises(ConfigError, match=r"executor.tensor_parallel_size: 4 contradicts "
                                          r"parallel.tensor_parallel_size=2"):
        LLM(cfg)


def test_the_platforms_device_count_is_checked():
    import torch

    from corellm.components import PlatformOptions
    from corellm.platforms.distributed import check_tensor_parallel
    from corellm.platforms.interface import Platform
    from corellm.checkpoint.reader import LlamaArchConfig
    arch = LlamaArchConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                                      "hidden_size": 64, "num_hidden_layers": 1,
                                      "num_attention_heads": 8, "num_key_value_heads": 8,
                                      "intermediate_size": 8, "max_position_embeddings": 8})

    class OneGpu(Platform):            # one device per rank, one visible
        device_type = "cuda"

        def device(self, local_rank=0):
            return torch.device("cuda", local_rank)

        def device_count(self):
            return 1

        def free_memory(self, device, local_world_size=1):
            return None

    class SharedHost(OneGpu):          # ranks share the device (the CPU's cores)
        shares_devices = True

    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 exceeds the 1 visible cuda "
                                          r"device\(s\) of platform 'onegpu'"):
        check_tensor_parallel(arch, 2, OneGpu(PlatformOptions(name="onegpu")))
    check_tensor_parallel(arch, 2, SharedHost(PlatformOptions(name="host")))


def test_the_shorthand_and_the_cli_flag_pick_multiproc(make_checkpoint):
    from corellm.cli.commands import _engine_config, build_parser
    from corellm.config.compose import load_config
    path = make_checkpoint("llama")
    cfg = load_config({"model": {"path": str(path)}, "executor": {"tensor_parallel_size": 2}})
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.executor.name == "multiproc"
    args = build_parser().parse_args(["generate", str(path), "-tp", "2"])
    cfg, _ = _engine_config(args, frontend=False)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.executor.name == "multiproc"
    with pytest.raises(ConfigError, match=r"parallel.init_method: .*tcp://HOST:PORT or env://"):
        load_config({"parallel": {"init_method": "udp://1.2.3.4:5"}})


# --------------------------------------------------------------------------- faults
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:       # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_kill_9_of_a_rank_is_named_fails_every_request_and_leaves_no_process(make_checkpoint):
    path = make_checkpoint("llama")
    cfg = engine_config(path, kv_cache={"num_blocks": 128}, parallel={"tensor_parallel_size": 2})
    llm = LLM(cfg)
    procs = llm.engine.executor._impl.procs
    pids = [p.pid for p in procs]
    assert all(_pid_alive(p) for p in pids)
    steps = []
    llm.engine.add_stats_listener(lambda s: steps.append(s.step))

    def killer() -> None:
        _wait(lambda: len(steps) >= 3, 60, "three steps")
        os.kill(pids[1], signal.SIGKILL)
    threading.Thread(target=killer, daemon=True).start()
    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(6)]
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by "
                                            r"signal SIGKILL"):
        llm.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    detected = time.monotonic() - t0
    # Every request ended (with an error), every block back; further use fails clearly.
    assert not llm.engine.has_unfinished_requests()
    assert_pool_whole(llm)
    with pytest.raises(ExecutorError, match="rank 1"):
        llm.generate("again", GREEDY, use_tqdm=False)
    llm.shutdown()
    _wait(lambda: not any(_pid_alive(p) for p in pids), 10, "every worker to exit")
    print(f"\nkill -9 of rank 1 to error: {detected:.2f} s")
    assert detected < 30


def test_a_rank_that_raises_is_named_and_stops_the_rest(make_checkpoint):
    path = make_checkpoint("llama")
    llm = LLM(engine_config(path, parallel={"tensor_parallel_size": 2}))
    pids = [p.pid for p in llm.engine.executor._impl.procs]
    # Every rank raises it; the first to report is named.
    with pytest.raises(ExecutorError, match=r"tensor-parallel rank [01] failed: AttributeError: "
                                            r"'Worker' object has no attribute 'no_such_call'"):
        llm.engine.executor.collective_rpc("no_such_call")
    _wait(lambda: not any(_pid_alive(p) for p in pids), 15, "every worker to exit")
    llm.shutdown()


# --------------------------------------------------------------------------- launchers
def _generate_args(path: Path) -> list[str]:
    return ["generate", str(path), "--tensor-parallel-size", "2", "--max-tokens", "16",
            "--ignore-eos", "--temperature", "0", "--no-progress", "--set",
            "kv_cache.num_blocks=64", "--prompt", "Once upon a time"]


def test_torchrun_style_launch_on_loopback(make_checkpoint):
    """Two processes as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, env://):
    rank 0 runs the engine, rank 1 the worker; the text equals a spawned TP=2 run's and a
    TP=1 run's."""
    path = make_checkpoint("llama")
    args = _generate_args(path)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    launched = [subprocess.Popen([sys.executable, "-m", "corellm", *args, "--set",
                                  "parallel.init_method=env://"],
                                 env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in (1, 0)]
    try:
        results = [p.communicate(timeout=240) for p in launched]
    finally:
        for p in launched:
            p.kill()
    assert [p.returncode for p in launched] == [0, 0], results
    (rank1_out, _), (rank0_out, _) = results
    assert rank1_out == ""                    # the worker prints nothing
    single = subprocess.run([sys.executable, "-m", "corellm", *args[:2], *args[4:]],
                            capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr
    assert rank0_out == single.stdout and rank0_out.strip()


def _worker_pids(engine_pid: int) -> list[int]:
    from tests.test_server_reliability import _children
    return [p for p in _children(engine_pid)
            if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


@contextlib.contextmanager
def _tp_server(path, tmp_path, **frontend):
    """A `corellm serve` with two ranks; yields (server, every process it started); whatever
    the test does, nothing survives it."""
    from tests.test_server import Server, _server_config
    from tests.test_server_reliability import _children
    cfg = _server_config(path)
    cfg["parallel"] = {"tensor_parallel_size": 2}
    if frontend:
        cfg["frontend"] = frontend
    srv = Server(tmp_path, cfg)
    procs = {srv.proc.pid} | _children(srv.proc.pid)
    try:
        assert len(_worker_pids(srv.engine_pid)) == 2
        yield srv, procs
        _wait(lambda: not any(_pid_alive(p) for p in procs), 15, "every process to exit")
    finally:
        srv.stop(signal.SIGKILL)
        for p in procs:
            if _pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_serve_with_a_rank_killed(make_checkpoint, tmp_path):
    """Under corellm serve: a stream in flight when rank 1 is killed ends with an error event
    naming the rank, /health turns 503, SIGTERM exits 0, and no process is left."""
    from tests.test_server import MAX_MODEL_LEN
    from tests.test_server_reliability import _events
    with _tp_server(make_checkpoint("llama"), tmp_path, exit_on_engine_death=False) as (srv, _):
        workers = _worker_pids(srv.engine_pid)
        # 8 samples to the longest context: far more work than the kill takes to land, even
        # where a tensor-parallel step is a millisecond (many cores)
        body = {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "n": 8, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(workers[1], signal.SIGKILL)
            events = _events(lines)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        # The message names the killed worker's rank and pid (which rank it is: /proc lists
        # the children in no guaranteed order).
        message = events[-2]["error"]["message"]
        assert re.search(rf"tensor-parallel rank [01] \(pid {workers[1]}\) was killed by signal "
                         "SIGKILL", message), events[-2]
        # (a /health can take health_timeout_s, 5 s, to answer: more than httpx's default)
        _wait(lambda: httpx.get(srv.url + "/health", timeout=30).status_code == 503, 20,
              "health 503")
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])


def test_serve_sigint_stops_every_rank(make_checkpoint, tmp_path):
    with _tp_server(make_checkpoint("llama"), tmp_path) as (srv, _):
        out = srv.client().completions.create(model=srv.model, prompt="Hi", max_tokens=8,
                                              temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        assert srv.stop(signal.SIGINT) == 0, "".join(srv.log[-30:])
