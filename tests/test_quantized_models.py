"""Models served with quantized weights (``model.quantization``), end to end through the engine.

- The default model (SmolLM2-135M, Q4_1 with a Q8_0 embedding) kept quantized: its layers hold
  the file's blocks and no float copy; its perplexity on a fixed text within 1% of the
  dequantized path's; greedy outputs token for token against llama.cpp on the same file (where
  llama-cpp-python is installed: a test-time reference only).
- ``int8`` (weight-only, per channel, quantized at load) on the Llama, Qwen2, Qwen3 and Phi test
  checkpoints and on the default model dequantized: perplexity within 2% of float32.
- A GGUF file's quantized weights split over two tensor-parallel ranks give the outputs of one.

Perplexity is measured through the engine itself: a logits processor forces each next token of
the text and records its log-probability under the logits the model gave (teacher forcing, one
decode step per token), so every matmul of the quantized path is on the measured path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from corellm import LLM, SamplingParams, hookimpl
from corellm.components import LogitsProcessorSpec
from corellm.errors import ConfigError
from corellm.interfaces import LogitsProcessor
from corellm.layers.quantize import weight_memory
from tests.conftest import assert_pool_whole, engine_config
from tests.gguf_writer import write_gguf
from tests.test_gguf import needs_smollm2, smollm2_path

TEXT = ("The river rose in the spring, as it did every year, and the people of the valley moved "
        "their animals to the high pastures. Nobody remembered a flood like the one their "
        "grandparents spoke of, but every family kept a boat tied behind the house. In the "
        "evenings the children counted the marks on the old bridge and argued about which one "
        "was the highest the water had ever reached. Their teacher, who had come from the city "
        "ten years before, told them that rivers are older than the mountains they cut through, "
        "and that the valley itself had been carved by water over a very long time. The "
        "children did not believe her at first. They asked how something as soft as water could "
        "break stone, and she answered that it needed only patience, and that a river has more "
        "patience than anything else in the world. Later that year a storm came over the hills "
        "and it rained for three days without stopping. The river climbed past the lowest mark "
        "on the bridge, then the second, and on the third morning it reached a line that nobody "
        "had ever seen covered. The families loaded their boats with bread, blankets and tools, "
        "and waited on the slope above the church. By evening the rain had stopped, and the water "
        "began to fall as quickly as it had risen. When they came down the next day they found "
        "mud in every kitchen, a cow standing calmly on the roof of the mill, and a new mark on "
        "the bridge, which the children painted red so that everyone would remember it.")


class TeacherForcing(LogitsProcessor):
    """``extra_args={"force": [ids]}``: the request's next tokens are these, whatever the model
    says; the log-probability the model gave each is recorded (in ``logprobs[req_id]``)."""

    logprobs: dict[str, list[float]] = {}

    def new_request(self, req_id, params, prompt_token_ids, output_token_ids):
        force = (params.extra_args or {}).get("force")
        if force is None:
            return None
        TeacherForcing.logprobs[req_id] = []
        return {"id": req_id, "force": force, "i": len(output_token_ids)}

    def apply(self, logits, rows, states):
        for row, state in zip(rows, states):
            target = state["force"][state["i"]]
            lp = torch.log_softmax(logits[row].double(), dim=-1)[target]
            TeacherForcing.logprobs[state["id"]].append(float(lp))
            logits[row] = float("-inf")
            logits[row, target] = 0.0

    def accept(self, state, token_id):
        state["i"] += 1
        return True


class Plugin:
    @staticmethod
    @hookimpl
    def corellm_logits_processors():
        yield LogitsProcessorSpec(name="teacher_forcing", factory=lambda o, c: TeacherForcing(),
                                  extra_args=("force",), summary="test: forces a text")


def perplexity(llm: LLM, ids: list[int], prefix: int = 1) -> float:
    """exp(mean negative log-likelihood) of ``ids[prefix:]`` given what precedes each."""
    TeacherForcing.logprobs.clear()
    target = ids[prefix:]
    params = SamplingParams(max_tokens=len(target), min_tokens=len(target), temperature=0.0,
                            ignore_eos=True, extra_args={"force": target})
    out = llm.generate([{"prompt_token_ids": ids[:prefix]}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == target
    (lps,) = TeacherForcing.logprobs.values()
    assert len(lps) == len(target)
    return math.exp(-sum(lps) / len(lps))


def _quantized_layers(llm: LLM) -> dict[str, int]:
    model = llm.engine.executor.worker.runner.model
    qtypes: dict[str, int] = {}
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if q is not None:
            assert module.weight.is_meta, "a quantized layer keeps no float weight"
            for t in q.qtypes:
                qtypes[t] = qtypes.get(t, 0) + 1
    return qtypes


@needs_smollm2
def test_default_model_kept_quantized_perplexity_within_1pct_of_dequantized():
    path = smollm2_path()
    results = {}
    for quant in ("gguf", "none"):
        with LLM({"model": {"path": str(path), "max_model_len": 512, "quantization": quant},
                  "kv_cache": {"num_blocks": 16}}, plugins=[Plugin]) as llm:
            ids = llm.tokenizer.encode(TEXT)
            results[quant] = perplexity(llm, ids)
            layers = _quantized_layers(llm)
            memory = weight_memory(llm.engine.executor.worker.runner.model)
            assert_pool_whole(llm)
        if quant == "gguf":
            # 30 layers x (qkv, o, gate_up, down) in Q4_1; the tied Q8_0 embedding and head.
            assert layers == {"Q4_1": 120, "Q8_0": 2}, layers
            assert memory["Q4_1"] < 70e6 and memory["Q8_0"] < 31e6, memory
            assert memory["float32"] < 1e6, memory         # the norms alone
        else:
            assert layers == {} and memory["float32"] > 500e6, memory
    assert 3 < results["none"] < 100, results              # a real model on plain English
    assert abs(results["gguf"] / results["none"] - 1) <= 0.01, results


@needs_smollm2
def test_default_model_norms_and_silu_run_inside_the_quantized_layers(monkeypatch):
    """On the CPU platform each decoder layer's QKV projection runs with the RMSNorm before it,
    and its gate/up projection with its RMSNorm and the SiLU-and-multiply after it, one C call
    each (``QuantLinear.fused``): the log-probabilities of a text are those of the layers run
    one by one (and without ``platform.weight_prefetch``), bit for bit. Eager steps (no
    ``cpu_graphs``): the calls are counted in Python."""
    from corellm_plugins.platform_cpu.ops import CpuDeviceOps
    from corellm_plugins.platform_cpu.qlinear import QuantLinear

    calls = {"norm": 0, "norm+silu": 0}
    fused = QuantLinear.fused

    def counting(self, x, bias, norm=None, silu_mul=False):
        calls["norm+silu" if silu_mul else "norm"] += norm is not None
        return fused(self, x, bias, norm, silu_mul)

    monkeypatch.setattr(QuantLinear, "fused", counting)
    path, logprobs = smollm2_path(), {}
    for how in ("fused", "one by one"):
        if how == "one by one":
            monkeypatch.setattr(CpuDeviceOps, "_fused_quant", lambda self, *a, **k: None)
        with LLM({"model": {"path": str(path), "max_model_len": 256, "quantization": "gguf"},
                  "kv_cache": {"num_blocks": 8},
                  "platform": {"weight_prefetch": how == "fused", "cpu_graphs": False}},
                 plugins=[Plugin]) as llm:
            kernels = [m.kernel for m in llm.engine.executor.worker.runner.model.modules()
                       if isinstance(getattr(m, "kernel", None), QuantLinear)]
            assert len(kernels) == 122 and {k.prefetch for k in kernels} == {how == "fused"}
            ids = llm.tokenizer.encode(TEXT)[:40]
            perplexity(llm, ids)
            (logprobs[how],) = TeacherForcing.logprobs.values()
            assert_pool_whole(llm)
        if how == "fused":        # 30 layers, one prefill and 38 decode steps
            assert calls == {"norm": 30 * 39, "norm+silu": 30 * 39}, calls
    assert logprobs["fused"] == logprobs["one by one"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi"])
def test_int8_perplexity_within_2pct_of_float32(make_checkpoint, arch):
    ckpt = make_checkpoint(arch)
    ids = list(range(5, 5 + 96))
    ppl = {}
    for quant in ("int8", "none"):
        with LLM(engine_config(ckpt, model={"quantization": quant}), plugins=[Plugin]) as llm:
            ppl[quant] = perplexity(llm, ids, prefix=8)
            layers = _quantized_layers(llm)
            assert_pool_whole(llm)
        # every linear layer but the embedding and LM head
        assert (set(layers) == {"int8"} and layers["int8"] >= 8) if quant == "int8" \
            else not layers, layers
    assert abs(ppl["int8"] / ppl["none"] - 1) <= 0.02, ppl


@needs_smollm2
def test_int8_on_the_default_model_within_2pct_of_float32():
    """A real model: the GGUF file dequantized, then its linear layers quantized to int8."""
    path = smollm2_path()
    ppl = {}
    for quant in ("int8", "none"):
        with LLM({"model": {"path": str(path), "max_model_len": 512, "quantization": quant},
                  "kv_cache": {"num_blocks": 16}}, plugins=[Plugin]) as llm:
            ppl[quant] = perplexity(llm, llm.tokenizer.encode(TEXT))
    assert abs(ppl["int8"] / ppl["none"] - 1) <= 0.02, ppl


def test_gguf_quantization_of_a_safetensors_checkpoint_is_a_config_error(llama_path):
    with pytest.raises(ConfigError, match="model.quantization") as info:
        LLM(engine_config(llama_path, model={"quantization": "gguf"}))
    assert "int8" in str(info.value)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_quantized_gguf_over_two_ranks_matches_one(make_checkpoint, tmp_path, tensor_type):
    ckpt = make_checkpoint("llama")
    path = write_gguf(ckpt, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    prompts = [[5, 6, 7, 8, 9], [100, 3, 250, 9, 14, 77, 31]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        cfg = engine_config(path, parallel={"tensor_parallel_size": tp},
                            executor={"name": "multiproc" if tp > 1 else "uniproc"})
        with LLM(cfg) as llm:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            if tp == 1:
                assert set(_quantized_layers(llm)) == {tensor_type}
            assert_pool_whole(llm)
    assert outs[1] == outs[2]


# --------------------------------------------------------------------------- llama.cpp
QUESTIONS = ["Name the capital of France.", "What is the capital of France?",
             "Write a haiku about the sea.", "List three prime numbers.", "Who wrote Hamlet?",
             "Explain photosynthesis in two sentences."]


# A greedy token may differ from llama.cpp's only where llama.cpp's own two best logits are
# closer than this (a near tie that rounding decides).
NEAR_TIE = 0.5


@needs_smollm2
def test_greedy_matches_llama_cpp_on_the_default_model():
    """Token for token against llama.cpp on the same Q4_1 file, 48 tokens per chat prompt.

    Both quantize the activations to int8 per 32-value block and multiply the blocks exactly in
    integers; what differs is float rounding: the order in which the blocks' products are summed
    (llama.cpp's Q4_1 dot product keeps 8 partial sums per row; corellm's interleaved kernels one
    per output, a block at a time), RoPE's angles (llama.cpp multiplies them up in float32),
    attention and the norms' reductions. A last-bit difference upstream of an activation that
    lies on an int8 rounding boundary becomes a whole quantization step, so the log-probabilities
    differ by up to a few tenths and a free-running greedy continuation parts at the first near
    tie, after which the two texts are no longer comparable.

    So each of llama.cpp's 48 greedy tokens is checked given the same context (llama.cpp's own
    continuation so far, fed to corellm as the prompt): corellm's greedy token must be
    llama.cpp's wherever llama.cpp's top two logits are NEAR_TIE or more apart. Measured: 283 of
    the 288 positions agree, and the 5 that differ lie at margins of 0.011-0.239. The README's
    prompt also runs free: 48 tokens equal, and its answer."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference "
                                    "here (pip install llama-cpp-python==0.3.36)")
    path = str(smollm2_path())
    n = 48
    ref = llama_cpp.Llama(path, n_threads=2, n_ctx=1024, verbose=False, seed=0,
                          type_k=0, type_v=0, logits_all=True)   # GGML_TYPE_F32 KV cache
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM({"model": {"path": path, "max_model_len": 512},
              "kv_cache": {"num_blocks": 64}}) as llm:
        prompts = [list(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False)) for q in QUESTIONS]
        theirs, margins = [], []
        for prompt in prompts:
            tokens = []
            for token in ref.generate(prompt, temp=0.0, top_k=1, reset=True):
                tokens.append(token)
                if len(tokens) == n:
                    break
            ref.reset()
            ref.eval(prompt + tokens)
            top2 = np.sort(np.asarray(ref.scores[len(prompt) - 1:len(prompt) + n - 1],
                                      dtype=np.float64), axis=1)[:, -2:]
            theirs.append(tokens)
            margins.append(top2[:, 1] - top2[:, 0])
        forced = llm.generate([{"prompt_token_ids": p + t[:i]} for p, t in zip(prompts, theirs)
                               for i in range(n)],
                              SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        ours = np.array([o.outputs[0].token_ids[0] for o in forced]).reshape(len(prompts), n)
        free = list(llm.generate([{"prompt_token_ids": prompts[0]}], greedy,
                                 use_tqdm=False)[0].outputs[0].token_ids)
        readme_answer = llm.tokenizer.decode(free).split("<|im_end|>")[0]
        assert_pool_whole(llm)
    parted = [(q, i, round(float(margins[q][i]), 3)) for q in range(len(prompts))
              for i in range(n) if ours[q][i] != theirs[q][i]]
    assert all(margin < NEAR_TIE for _, _, margin in parted), (
        f"(prompt, position, llama.cpp's top-2 margin) where the greedy tokens differ: {parted}")
    assert len(parted) <= len(prompts) * n // 20, parted        # at most 5% of the positions
    assert readme_answer == "The capital of France is Paris.", readme_answer
    assert free == theirs[0], (free, theirs[0])               # the README's prompt, free-running
