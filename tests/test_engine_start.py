"""Start-up failure paths: nothing is left running, and the error names what is wrong."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from corellm import LLM
from corellm.engine.async_llm import AsyncLLM
from corellm.errors import CheckpointError, ConfigError
from tests.conftest import engine_config


def _children_after(deadline_s: float = 10.0) -> list:
    end = time.monotonic() + deadline_s
    while multiprocessing.active_children() and time.monotonic() < end:
        time.sleep(0.05)
    return multiprocessing.active_children()


@pytest.mark.parametrize("delay,slow_spawn", [(0.0, False), (0.5, False), (0.0, True)])
def test_a_failing_tokenizer_leaves_no_engine_process(llama_path, tmp_path, monkeypatch, delay,
                                                      slow_spawn):
    """The engine process starts while the tokenizer loads; when the tokenizer fails, the
    engine is killed: once running (delay), or while it is still being spawned (slow_spawn:
    the failure lands inside Process.start)."""
    import multiprocessing.context

    import corellm.engine.async_llm as async_llm

    if slow_spawn:
        start = multiprocessing.context.SpawnProcess.start

        def slow_start(self):
            time.sleep(0.5)
            start(self)
        monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", slow_start)

    real = async_llm.load_tokenizer

    def failing(path, key):
        time.sleep(delay)
        return real(str(tmp_path / "missing"), key)

    monkeypatch.setattr(async_llm, "load_tokenizer", failing)
    assert not multiprocessing.active_children()
    with pytest.raises(CheckpointError, match="does not exist"):
        asyncio.run(AsyncLLM.create(engine_config(llama_path)))
    assert _children_after() == []


def test_a_kv_cache_larger_than_memory_is_refused_at_start(llama_path):
    cfg = engine_config(llama_path)
    cfg["kv_cache"] = {"memory_gib": 100_000}
    with pytest.raises(ConfigError, match=r"kv_cache.memory_gib: the KV cache needs .* GiB but "
                                          r"only .* GiB of memory is available"):
        LLM(cfg)


def test_the_setup_is_resolved_once(llama_path, monkeypatch):
    """The checkpoint's config is read once per engine (``corellm.config.setup.resolve_setup``), and
    the worker takes its facts from the resulting ``EngineSetup``: the batch limits are the
    scheduler's own options, the block size the config's."""
    import corellm.checkpoint.reader as mc
    from corellm import LLM
    from tests.conftest import engine_config

    reads = []
    real = mc.read_checkpoint_config
    monkeypatch.setattr(mc, "read_checkpoint_config", lambda p: (reads.append(p), real(p))[1])
    cfg = engine_config(llama_path, scheduler={"max_num_seqs": 5, "max_num_batched_tokens": 96})
    with LLM(cfg) as llm:
        runner = llm.engine.executor.worker.runner
        assert runner.setup is llm.engine.setup
        assert (runner.limits.max_num_seqs, runner.limits.max_num_batched_tokens) == (5, 96)
        assert llm.engine.setup.platform == "cpu" and llm.engine.setup.block_size == 16
    assert len(reads) == 1
