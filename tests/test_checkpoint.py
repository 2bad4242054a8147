"""Loading checkpoints: sharded safetensors, both transformers config spellings, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from corellm import LLM, SamplingParams
from corellm.errors import CheckpointError
from corellm.checkpoint.reader import LlamaArchConfig
from tests.conftest import engine_config

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40)]


def run(path, **kw):
    llm = LLM(engine_config(path, **kw))
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference_tokens(llama_path):
    return run(llama_path)


def test_sharded_checkpoint(tmp_path, llama_path, reference_tokens):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_path / f, out / f)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("*.safetensors"))) > 2
    assert run(out) == reference_tokens


def test_transformers4_config_spelling(tmp_path, llama_path, reference_tokens):
    copy = tmp_path / "old"
    shutil.copytree(llama_path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (copy / "config.json").write_text(json.dumps(cfg))
    assert run(copy) == reference_tokens


def test_config_spellings_normalize_alike():
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=10,
                hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    new = LlamaArchConfig.from_dict({**base, "dtype": "bfloat16", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    old = LlamaArchConfig.from_dict({**base, "torch_dtype": "bfloat16", "rope_theta": 5e5,
                                     "rope_scaling": {"type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}})
    assert new == old
    assert new.rope_theta == 5e5 and new.rope_scaling["rope_type"] == "llama3"
    assert new.checkpoint_dtype == "bfloat16" and new.head_dim == 4 and new.num_key_value_heads == 2


def test_llama3_rope_matches_transformers(tmp_path, make_checkpoint):
    """Scaled RoPE (Llama 3.1 style) against transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM
    path = make_checkpoint("llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ids = list(range(7, 107))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    ours = LLM(engine_config(path)).generate({"prompt_token_ids": ids}, GREEDY,
                                             use_tqdm=False)[0].outputs[0].token_ids
    assert ours == ref


@pytest.mark.parametrize("mutate,message", [
    (lambda p: shutil.rmtree(p), "does not exist"),
    (lambda p: (p / "config.json").unlink(), "has no config.json"),
    (lambda p: (p / "config.json").write_text("{not json"), "malformed JSON"),
    (lambda p: [f.unlink() for f in p.glob("*.safetensors")], "has no \\*.safetensors weights"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "not a readable safetensors"),
    (lambda p: _edit(p, vocab_size=None), "missing required key 'vocab_size'"),
    (lambda p: _edit(p, num_hidden_layers=3), "checkpoint is missing .* model.layers.2"),
    (lambda p: _edit(p, num_hidden_layers=1), "does not use, e.g. model.layers.1"),
    (lambda p: _edit(p, hidden_size=32, head_dim=8), "checkpoint shape"),
    (lambda p: _edit(p, architectures=["GPT2LMHeadModel"]),
     "no model plugin implements architecture GPT2LMHeadModel; supported: "),
    (lambda p: _edit(p, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type 'yarn' is not supported"),
])
def test_bad_checkpoints(tmp_path, llama_path, mutate, message):
    from corellm.errors import CorellmError
    copy = tmp_path / "ckpt"
    shutil.copytree(llama_path, copy)
    mutate(copy)
    with pytest.raises(CorellmError, match=message):
        LLM({"model": {"path": str(copy)}, "kv_cache": {"num_blocks": 64}})


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_model_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="is a file but not a .gguf one"):
        LLM({"model": {"path": str(f)}})


def test_max_model_len_beyond_positions(llama_path):
    with pytest.raises(CheckpointError, match="exceeds the checkpoint's max_position_embeddings=512"):
        LLM(engine_config(llama_path, model={"max_model_len": 4096}))


def test_sliding_window_is_the_backends_to_support(tmp_path, llama_path):
    """A window shorter than max_model_len runs on a backend that supports windows (torch_sdpa);
    one that does not (the default of AttentionBackend.supports) refuses the model at start-up,
    naming the layer and the fix, and accepts it once the window covers every sequence."""
    from corellm.errors import ConfigError
    from tests.test_hooks import NaiveAttentionPlugin

    copy = tmp_path / "mistral"
    shutil.copytree(llama_path, copy)
    _edit(copy, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    with LLM(engine_config(copy)) as llm:
        assert llm.engine.model_info.max_model_len == 512
        layers = llm.engine.executor.worker.runner.attn_layers
        assert [layer.sliding_window for layer in layers] == [128, 128]
    naive = {"name": "naive"}
    with pytest.raises(ConfigError, match=r"attention.name: 'naive' \(plugin .*\) cannot run "
                       r"layer 0 of .* sliding_window=128 is not supported \(the backend computes "
                       r"full attention\); model.max_model_len <= 128 makes the window full "
                       r"attention"):
        LLM(engine_config(copy, attention=naive), plugins=[NaiveAttentionPlugin()])
    with LLM(engine_config(copy, attention=naive, model={"max_model_len": 128}),
             plugins=[NaiveAttentionPlugin()]) as llm:
        assert llm.engine.model_info.max_model_len == 128


def test_plain_tokenizers_skip_autotokenizer_and_load_the_same(llama_path, tmp_path):
    """A tokenizer.json tokenizer of the generic fast class is loaded by that class directly
    (AutoTokenizer's model registry costs seconds at start-up); the result is the same."""
    from transformers import AutoTokenizer

    from corellm.checkpoint.reader import _plain_fast_tokenizer_class, load_tokenizer

    assert _plain_fast_tokenizer_class(llama_path) is not None
    ours, reference = load_tokenizer(str(llama_path)), AutoTokenizer.from_pretrained(llama_path)
    assert type(ours) is type(reference)
    text = "Hello <|im_start|> world\n\n  it's Ünïcödé"
    assert ours.encode(text) == reference.encode(text)
    assert ours.chat_template == reference.chat_template and ours.chat_template
    assert ours.eos_token_id == reference.eos_token_id
    # A model-specific class (or remote code) still goes through AutoTokenizer.
    other = tmp_path / "tok"
    shutil.copytree(llama_path, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"x": "y"}}))
    assert _plain_fast_tokenizer_class(other) is None
    (other / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "LlamaTokenizer"}))
    assert _plain_fast_tokenizer_class(other) is None


@pytest.mark.parametrize("extra,expected", [
    # Mistral: every layer slides.
    ({"model_type": "mistral", "sliding_window": 8}, [8, 8, 8]),
    # Qwen2 without layer_types: as Hugging Face's Qwen2Config, layers from max_window_layers.
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, [None, 8, 8]),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8}, [None] * 3),
    # Explicit per-layer kinds (Hugging Face's layer_types) win.
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     [8, None, 8]),
])
def test_per_layer_sliding_windows(extra, expected):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, **extra}
    arch = LlamaArchConfig.from_dict(cfg)
    assert [arch.layer_sliding_window(i) for i in range(3)] == expected


def test_layer_types_must_cover_every_layer():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
           "model_type": "mistral", "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(CheckpointError, match=r"'layer_types' has 2 entries for "
                                              r"num_hidden_layers=3"):
        LlamaArchConfig.from_dict(cfg)
