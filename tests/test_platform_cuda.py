"""The CUDA platform (plugins/platform_cuda): what can be checked without a GPU is checked here on
any machine (the KV budget's arithmetic, the staging buffers' reuse and ordering, availability and
config errors); what needs one is marked ``gpu`` and skipped, with the reason, where no CUDA
device is visible."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from corellm.config import load_config
from corellm.errors import ConfigError
from corellm.plugins import load_registry
from corellm_plugins import platform_cuda
from corellm_plugins.platform_cuda.staging import StagingBuffer, kv_budget_bytes
from tests.conftest import assert_pool_whole, engine_config

GIB = 1 << 30
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="needs a CUDA device (none visible)")


def test_kv_budget_is_the_share_left_after_weights_activations_and_other_users():
    assert kv_budget_bytes(80 * GIB, 0.9, 10 * GIB, 2 * GIB) == int(72 * GIB) - 12 * GIB
    # memory used outside torch that the allocator's figures already cover is not negative
    assert kv_budget_bytes(10 * GIB, 0.5, 1 * GIB, -5) == 4 * GIB
    with pytest.raises(ConfigError, match=r"platform.gpu_memory_utilization: 0.1 of 80.00 GiB "
                                          r"leaves no room for the KV cache"):
        kv_budget_bytes(80 * GIB, 0.1, 7 * GIB, 1 * GIB)


class _Event:
    """Stands for torch.cuda.Event: records the order of records and waits."""

    log: list[str] = []

    def record(self):
        _Event.log.append("record")

    def synchronize(self):
        _Event.log.append("wait")


def test_staging_buffers_are_reused_and_never_overwritten_while_copied():
    _Event.log = []
    buf = StagingBuffer(4, torch.int64, torch.device("cpu"), pin=False, event=_Event)
    storage = buf.device_buf.data_ptr()
    a = buf.put(np.array([1, 2, 3], dtype=np.int64))
    assert a.tolist() == [1, 2, 3] and a.data_ptr() == storage      # a view, not a new tensor
    b = buf.put(np.array([7, 8], dtype=np.int64))
    assert b.tolist() == [7, 8] and b.data_ptr() == storage
    # the second put waited for the first copy before writing the host buffer
    assert _Event.log == ["record", "wait", "record"]
    big = buf.put(np.arange(9, dtype=np.int64))                      # grows, doubling at least
    assert big.tolist() == list(range(9)) and buf.capacity == 9 and buf.grown == 1
    assert buf.put(np.arange(5, dtype=np.int64)).data_ptr() == buf.device_buf.data_ptr()


def test_unavailable_here_is_listed_with_its_reason_and_refused_by_name(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the platform is available")
    reason = platform_cuda.availability()
    assert reason and ("without CUDA" in reason or "no CUDA device" in reason)
    from corellm.cli import main
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["components"]
    cuda = next(r for r in rows if r["kind"] == "platform" and r["name"] == "cuda")
    assert cuda["unavailable"] == reason and not cuda["auto_selected"]
    registry = load_registry()
    assert load_config({}, registry=registry).platform.name == "cpu"
    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": "cuda"}}, registry=registry)
    assert reason in dict(err.value.problems)["platform.name"]


def test_a_bad_option_names_its_key(monkeypatch):
    monkeypatch.setattr(platform_cuda, "availability", lambda: None)
    registry = load_registry()          # the spec captures the patched probe
    cfg = load_config({"platform": {"name": "cuda", "gpu_memory_utilization": 0.5}},
                      registry=registry)
    assert cfg.platform.gpu_memory_utilization == 0.5 and cfg.kv_cache.block_size == 16
    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": "cuda", "gpu_memory_utilization": 1.5}},
                    registry=registry)
    assert "less than or equal to 1" in dict(err.value.problems)["platform.gpu_memory_utilization"]


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_matches_transformers_on_cuda(make_checkpoint, dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from corellm import LLM, SamplingParams
    from tests.test_hf_equivalence import compare, hf_greedy, make_prompts
    path = make_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    prompts = make_prompts(model.config.vocab_size)[:6]
    gen = GenerationConfig(max_new_tokens=12, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    results = hf_greedy(model, prompts, gen)
    cfg = engine_config(path, platform={"name": "cuda"}, model={"dtype": dtype})
    with LLM(cfg) as llm:
        assert llm.engine.executor.worker.runner.device.type == "cuda"
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        assert_pool_whole(llm)
    notes = [n for o, (theirs, logits) in zip(outputs, results)
             if (n := compare(o.outputs[0].token_ids, theirs, logits))]
    assert len(notes) <= (1 if dtype == "float32" else 3), notes


@pytest.mark.gpu
@no_cuda
def test_kv_cache_sized_from_gpu_memory_utilization(llama_path):
    from corellm import LLM
    sizes = {}
    for util in (0.3, 0.6):
        cfg = engine_config(llama_path, platform={"name": "cuda", "gpu_memory_utilization": util})
        del cfg["kv_cache"]["num_blocks"]
        with LLM(cfg) as llm:
            sizes[util] = llm.engine.kv_cache_manager.num_blocks
    assert sizes[0.6] > 1.5 * sizes[0.3]

