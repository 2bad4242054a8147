"""Shared fixtures: small random-weight checkpoints saved with transformers and loaded back by
corellm through the same code path a user's checkpoint takes."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")   # the test process is ours to tune

# Architecture -> transformers config kwargs. Grouped-query attention everywhere (heads 4, KV 2).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _hf_config(arch: str, vocab_size: int, eos: int):
    import transformers as tf

    common = dict(TINY, vocab_size=vocab_size, eos_token_id=eos, bos_token_id=None,
                  pad_token_id=eos, tie_word_embeddings=False)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "phi":          # not Llama-shaped: LayerNorm, parallel block, partial rotary 0.5
        return tf.PhiConfig(**common, hidden_act="gelu_new", partial_rotary_factor=0.5)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tokenizer():
    from corellm.checkpoint.demo import train_tokenizer
    return train_tokenizer(vocab_size=1024)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, tokenizer):
    """make_checkpoint(arch, **config_overrides) -> path of a cached tiny checkpoint."""
    from corellm.checkpoint.demo import write_random_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cfg = _hf_config(arch, len(tokenizer), tokenizer.eos_token_id)
            for k, v in overrides.items():
                setattr(cfg, k, v)
            path = tmp_path_factory.mktemp(f"ckpt-{arch}")
            write_random_checkpoint(path, cfg, tokenizer, seed=1234, init_std=0.15)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_path(make_checkpoint) -> Path:
    return make_checkpoint("llama")


def netns() -> list[str]:
    """The command prefix that runs a command in a loopback-only network namespace: Ray
    advertises the machine's address even when told 127.0.0.1, and test traffic stays on
    loopback. Skips the test, saying why, where one cannot be made."""
    import shutil
    import subprocess
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("no unshare or ip command: cannot make a loopback-only network namespace")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -n is not permitted here ({probe.stderr.strip()}): Ray would "
                    "advertise the machine's address")
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def engine_config(path, **sections) -> dict:
    """A config dict for a tiny checkpoint with a small KV pool (fast to allocate)."""
    cfg = {"model": {"path": str(path), "dtype": "float32"},
           "kv_cache": {"num_blocks": 256, "block_size": 16}}
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def assert_pool_whole(llm) -> None:
    stats = llm.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    kv = llm.engine.kv_cache_manager
    if hasattr(kv, "check_invariants"):
        kv.check_invariants()


_ENGINES: list = []      # weak references to every engine built in the session
_NEW_ENGINES: list = []  # strong references to the engines built by the current test


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Record every EngineCore the tests build (wrapping __init__ for the whole session)."""
    import weakref

    from corellm.engine.core import EngineCore
    original = EngineCore.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _ENGINES.append(weakref.ref(self))
        _NEW_ENGINES.append(self)
    EngineCore.__init__ = init
    yield
    EngineCore.__init__ = original


@pytest.fixture(autouse=True)
def _plugin_warnings_per_test():
    """A plugin warning is logged once per process; each test is a process of its own here."""
    from corellm.plugins import discovery
    discovery._warned.clear()


@pytest.fixture(autouse=True)
def _every_kv_block_returns(request):
    """After every test, every live engine is idle and its KV pool is whole: nothing is lost."""
    yield
    engines = {id(e): e for e in _NEW_ENGINES}           # this test's, even if unreachable now
    _NEW_ENGINES.clear()
    for ref in list(_ENGINES):                           # and every older one still alive
        engine = ref()
        if engine is None:
            _ENGINES.remove(ref)
        else:
            engines[id(engine)] = engine
    for engine in engines.values():
        stats = engine.get_stats()
        assert not engine.has_unfinished_requests(), f"{request.node.nodeid} left requests behind"
        assert stats.kv_blocks_free == stats.kv_blocks_total, \
            f"{request.node.nodeid} leaked {stats.kv_blocks_total - stats.kv_blocks_free} KV blocks"
        check = getattr(engine.kv_cache_manager, "check_invariants", None)
        if check is not None:
            check()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path for ``install_fake_dist``; the fake modules (``fake_*``) are
    forgotten after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[mod]
