"""CPU graphs (``platform.cpu_graphs``): decode steps recorded once and replayed.

- Greedy outputs with graphs on equal those with graphs off, token for token, on every model
  family's test checkpoint and on the default model kept quantized (its log-probabilities too,
  bit for bit), with steps of several row counts replayed.
- A recording is trusted only after its first replay matched the eager step: a step whose work
  the recorder cannot see (memory written through numpy) and a step that reads a value back to
  Python (``.item()``) are never replayed, and the outputs stay those of the eager steps.
- No recordings where the attention metadata is not at fixed addresses (the gather decode path)
  or the option is off; a step beyond the scheduler's limits turns them off.
- ``DeviceArray(fixed=True)``: the same addresses and strides for every step within its shape.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.attention import DeviceArray
from corellm.platforms import StepInputs
from corellm_plugins.platform_cpu.replay import CpuStepper, NotReplayable, StepRecorder
from tests.conftest import assert_pool_whole, engine_config
from tests.test_gguf import needs_smollm2, smollm2_path

PROMPTS = ["the cat sat on", "a b c d e f", "one two", "hello there my friend, how are"]


def _stepper(llm: LLM) -> CpuStepper:
    stepper = llm.engine.executor.worker.runner.stepper
    assert isinstance(stepper, CpuStepper)
    return stepper


def _greedy(path, graphs: bool, prompts=PROMPTS, max_tokens: int = 12, hook=None,
            **sections) -> tuple[list[list[int]], CpuStepper]:
    cfg = engine_config(path, platform={"cpu_graphs": graphs}, **sections)
    with LLM(cfg) as llm:
        if hook is not None:
            llm.engine.executor.worker.runner.model.register_forward_hook(hook)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # one request alone, then the batch: decode steps of 1 and of 1-4 rows
        outs = llm.generate(prompts[:1], params, use_tqdm=False)
        outs += llm.generate(prompts, params, use_tqdm=False)
        assert_pool_whole(llm)
        return [o.outputs[0].token_ids for o in outs], _stepper(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi"])
def test_replayed_decode_steps_give_the_eager_tokens(make_checkpoint, arch):
    path = make_checkpoint(arch)
    eager, off = _greedy(path, False)
    replayed, stepper = _greedy(path, True)
    assert replayed == eager
    assert off.replays == 0 and not off.programs
    assert stepper.replays > 0 and stepper.off is None and not stepper.refused
    assert {1, 4} <= {n for n, p in stepper.programs.items() if p.verified}


@needs_smollm2
def test_default_model_quantized_replay_is_bit_for_bit():
    """SmolLM2 kept quantized (the C kernels, fused norms, weight prefetching): the logits of
    replayed steps equal the eager steps' exactly."""
    path = smollm2_path()
    logits = {}
    for graphs in (False, True):
        cfg = {"model": {"path": str(path), "max_model_len": 256, "quantization": "gguf"},
               "kv_cache": {"num_blocks": 8}, "platform": {"cpu_graphs": graphs}}
        with LLM(cfg) as llm:
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
            out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
            logits[graphs] = (out.outputs[0].token_ids,
                              [sorted(d.items()) for d in out.outputs[0].logprobs])
            stepper = _stepper(llm)
            # 23 decode steps: the first recorded, the second checked beside an eager step
            assert stepper.replays == (21 if graphs else 0)
            assert_pool_whole(llm)
    assert logits[True] == logits[False]


def test_work_the_recorder_cannot_see_is_never_replayed(llama_path, caplog):
    """A forward hook that changes the hidden states through numpy (invisible to the
    recorder): the first replay differs from the eager step, so the row count runs eagerly."""
    def through_numpy(module, args, out):
        np.multiply(out.numpy(), 1.5, out=out.numpy())

    eager, _ = _greedy(llama_path, False, hook=through_numpy)
    with caplog.at_level(logging.WARNING, logger="corellm_plugins.platform_cpu.replay"):
        replayed, stepper = _greedy(llama_path, True, hook=through_numpy)
    assert replayed == eager
    assert stepper.replays == 0 and not stepper.programs
    assert set(stepper.refused) >= {1, 4}
    assert all("replay differed from the eager step" in r for r in stepper.refused.values())
    assert "decode steps of 1 row(s) run eagerly" in caplog.text


def test_a_value_read_back_to_python_is_not_recorded(llama_path):
    seen = []

    def reads_back(module, args, out):
        seen.append(out.float().abs().sum().item())

    eager, _ = _greedy(llama_path, False, hook=reads_back)
    n_eager = len(seen)
    replayed, stepper = _greedy(llama_path, True, hook=reads_back)
    assert replayed == eager and len(seen) == 2 * n_eager    # every step ran the hook
    assert stepper.replays == 0 and not stepper.programs
    assert all("read back to Python" in r for r in stepper.refused.values())


def test_recorder_refuses_a_python_read_and_records_in_place_and_functional_ops():
    x = torch.arange(4.0)
    with pytest.raises(NotReplayable, match="read back to Python"):
        with StepRecorder():
            bool((x > 1).any())
    y = torch.zeros(4)
    with StepRecorder() as rec:
        z = x * 2                 # functional: replayed into z
        y.add_(z)                 # in place: replayed as called
        w = z.view(2, 2)          # a view: nothing to replay
    from corellm_plugins.platform_cpu.replay import StepProgram
    program = StepProgram(rec, w)
    assert len(program.steps) == 2
    x.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    program.replay()
    assert z.tolist() == [2.0] * 4 and w.data_ptr() == z.data_ptr()
    assert y.tolist() == [2.0, 4.0, 6.0, 8.0]       # 0,2,4,6 + 2


def test_no_recordings_on_the_gather_decode_path_or_with_the_option_off(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="corellm_plugins.platform_cpu.replay"):
        _, stepper = _greedy(llama_path, True, attention={"name": "torch_sdpa",
                                                          "decode": "gather"})
    assert stepper.replays == 0 and not stepper.programs
    assert "does not declare replayable" in stepper.off
    assert "does not declare replayable" in caplog.text
    _, stepper = _greedy(llama_path, False)
    assert stepper.off == "platform.cpu_graphs is false"


def test_a_step_beyond_the_limits_turns_recordings_off():
    class Limits:
        max_num_seqs, max_num_batched_tokens = 4, 8

    stepper = CpuStepper(model=None, device=torch.device("cpu"), limits=Limits(), max_rows=8)
    stepper.enable(None)
    ids, rows = np.zeros(3, dtype=np.int64), np.arange(3)
    step = StepInputs(ids, ids, rows, None, num_reqs=3, num_decodes=3)
    assert stepper._rows(step) == 3
    other_rows = StepInputs(ids, ids, rows[::-1].copy(), None, num_reqs=3, num_decodes=3)
    assert stepper._rows(other_rows) is None        # a program's logits are of rows 0..n-1
    prefill = StepInputs(ids, ids, ids[:1], None, num_reqs=1, num_decodes=0)
    assert stepper._rows(prefill) is None and stepper.off is None
    big = np.arange(9)
    assert stepper._rows(StepInputs(big, big, big, None, num_reqs=9, num_decodes=9)) is None
    assert "exceeded the scheduler's limits" in stepper.off
    assert stepper._rows(step) is None


def test_fixed_device_array_keeps_addresses_and_strides():
    arr = DeviceArray((4, 6), torch.int64, torch.device("cpu"), fixed=True)
    a = arr.put(np.arange(6).reshape(2, 3))
    b = arr.put(np.arange(12).reshape(3, 4) + 100)
    assert a.data_ptr() == b.data_ptr() and a.stride() == b.stride() == (6, 1)
    assert b.tolist() == (np.arange(12).reshape(3, 4) + 100).tolist()
    big = arr.put(np.ones((5, 2), dtype=np.int64))         # beyond the shape: its own view
    assert big.data_ptr() != a.data_ptr() and big.tolist() == [[1, 1]] * 5
    plain = DeviceArray((4,), torch.int64, torch.device("cpu"))
    assert plain.fixed is None
