"""Model plugins own their config: the plugin chosen by `architectures` parses config.json, the
core checks only what the engine relies on. The Phi plugin (not Llama-shaped: LayerNorm, a
parallel block, partial rotary) is built through the interfaces a third party has; its
greedy outputs against transformers under every scheduler setting are in test_hf_equivalence.
"""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.components import ModelSpec
from corellm.errors import CheckpointError, PluginError
from corellm.layers import get_rope
from corellm.checkpoint.reader import (ConfigReader, LlamaArchConfig, ModelArchConfig, RopeConfig,
                                  load_arch_config)
from corellm.plugins.discovery import load_registry
from tests.conftest import assert_pool_whole, engine_config
from tests.test_hf_equivalence import compare, hf_greedy, make_prompts

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_phi_variants_match_transformers(make_checkpoint):
    """QK LayerNorm (Phi's option) and tied embeddings with a biased head, with chunked prefill
    and preemption at once."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = make_checkpoint("phi", qk_layernorm=True, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25})
    arch = load_arch_config(path)
    assert type(arch).__name__ == "PhiArchConfig"
    assert (arch.qk_layernorm, arch.tie_word_embeddings, arch.rotary_dim) == (True, True, 4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size, seed=3)[:6]
    ref = hf_greedy(model, prompts, GenerationConfig(max_new_tokens=12, do_sample=False,
                                                     eos_token_id=None, pad_token_id=0))
    cfg = engine_config(path, scheduler={"max_num_batched_tokens": 32},
                        kv_cache={"num_blocks": 12})
    cfg["model"]["max_model_len"] = 160
    llm = LLM(cfg)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    notes = [compare(o.outputs[0].token_ids, tokens, logits)
             for o, (tokens, logits) in zip(outs, ref)]
    assert sum(n is not None for n in notes) <= 1, notes
    assert llm.get_stats().num_preemptions > 0
    assert_pool_whole(llm)


def test_phi_plugin_uses_only_public_interfaces():
    """What a third-party author has: corellm's public modules and the plugin's own package."""
    public = {"corellm", "corellm.components", "corellm.errors", "corellm.interfaces",
              "corellm.layers", "corellm.checkpoint.reader", "corellm.platforms.distributed"}
    for file in (REPO / "plugins" / "models_phi").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name and name.split(".")[0] in ("corellm", "corellm_plugins"):
                    own = name.startswith("corellm_plugins.models_phi")
                    assert name in public or own, f"{file.name} imports {name}"


# --------------------------------------------------------------------------- the core's parser
def test_llama_parser_refuses_partial_rotary_and_points_to_the_config_class():
    """A model plugin whose architecture rotates part of each head needs its own parser: the
    message says so (config_class) before it mentions the layer that rotates."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
               intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
               partial_rotary_factor=0.5)
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor=0\.5: the default parser "
                                              r"\(LlamaArchConfig\).*ModelSpec\.config_class.*"
                                              r"'The config class'.*rotary_dim"):
        LlamaArchConfig.from_dict(cfg)


@pytest.mark.parametrize("key, value, message", [
    ("sliding_window", "abc", "'sliding_window' must be an integer, got 'abc'"),
    ("layer_types", "full_attention", "'layer_types' must be a list"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0},
     "rope_type 'yarn' is not supported \\(supported: default, linear, llama3\\)"),
    ("rope_parameters", [1, 2], "'rope_parameters' must be a mapping"),
    ("tie_word_embeddings", "yes", "'tie_word_embeddings' must be true or false"),
])
def test_llama_parser_names_bad_values(key, value, message):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
               intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(CheckpointError, match=f"^config.json: {message}"):
        LlamaArchConfig.from_dict({**cfg, key: value})
    assert LlamaArchConfig.from_dict({**cfg, "tie_word_embeddings": 1}).tie_word_embeddings


def test_length_limit_under_rope_scaling():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
                intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=4096)
    linear = {"rope_type": "linear", "factor": 4.0}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}
    assert LlamaArchConfig.from_dict(base).max_len_limit() == 4096
    assert LlamaArchConfig.from_dict({**base, "rope_scaling": linear}).max_len_limit() is None
    assert LlamaArchConfig.from_dict({**base, "rope_scaling": llama3}).max_len_limit() == 4096


def test_config_reader_names_the_file_and_key():
    r = ConfigReader({"n_embd": 64, "n_layer": "two", "flag": 2, "eps": None},
                     "ckpt/config.json")
    assert r.int("hidden_size", "n_embd") == 64
    assert r.float("eps", default=1e-5) == 1e-5          # null counts as absent
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: missing required key "
                                              r"'num_attention_heads' \(or 'n_head'\)"):
        r.int("num_attention_heads", "n_head")
    with pytest.raises(CheckpointError, match="'n_layer' must be an integer, got 'two'"):
        r.int("num_hidden_layers", "n_layer")
    with pytest.raises(CheckpointError, match="'flag' must be true or false, got 2"):
        r.bool("flag")


def test_rope_config_reads_both_transformers_spellings():
    new = RopeConfig.read(ConfigReader({"rope_parameters": {
        "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}}))
    old = RopeConfig.read(ConfigReader({"rope_theta": 5e5, "partial_rotary_factor": 0.25}))
    assert new == old == RopeConfig(5e5, None, 0.25)
    with pytest.raises(CheckpointError, match="partial_rotary_factor must be in"):
        RopeConfig.read(ConfigReader({"partial_rotary_factor": 0}))
    with pytest.raises(CheckpointError, match="rope_theta must be a positive number, got 'x'"):
        RopeConfig.read(ConfigReader({"rope_parameters": {"rope_theta": "x"}}))


def test_partial_rotary_matches_transformers():
    """The layer library's partial RoPE against transformers' Phi rotary embedding."""
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb

    head_dim, rotary_dim = 32, 8
    cfg = PhiConfig(hidden_size=128, num_attention_heads=4, partial_rotary_factor=0.25)
    positions = torch.tensor([0, 3, 17, 100])
    q, k = torch.randn(4, 4, head_dim), torch.randn(4, 2, head_dim)
    ours_q, ours_k = get_rope(head_dim, 128, 10000.0, None, rotary_dim=rotary_dim)(positions, q, k)
    cos, sin = PhiRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q[None, ..., :rotary_dim].transpose(1, 2),
                                        k[None, ..., :rotary_dim].transpose(1, 2), cos, sin)
    torch.testing.assert_close(ours_q[..., :rotary_dim], ref_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k[..., :rotary_dim], ref_k[0].transpose(0, 1))
    assert torch.equal(ours_q[..., rotary_dim:], q[..., rotary_dim:])


# --------------------------------------------------------------------------- a third party's parser
@dataclass(frozen=True, kw_only=True)
class GPT2NamedConfig(LlamaArchConfig):
    """A Llama decoder whose config.json uses GPT-2's key names, and a field of its own."""

    greeting: str

    @classmethod
    def parse_fields(cls, r: ConfigReader) -> dict[str, Any]:
        heads = r.int("n_head")
        return dict(architectures=("RenamedLlamaForCausalLM",), vocab_size=r.int("vocab_size"),
                    hidden_size=r.int("n_embd"), num_hidden_layers=r.int("n_layer"),
                    num_attention_heads=heads, num_key_value_heads=r.int("n_kv_head"),
                    head_dim=r.int("n_embd") // heads, max_position_embeddings=r.int("n_ctx"),
                    intermediate_size=r.int("n_inner"), rms_norm_eps=r.float("eps"),
                    greeting=r.str("greeting"))


class RenamedPlugin:
    def __init__(self, config_class=GPT2NamedConfig):
        self.config_class = config_class
        self.seen: list[ModelArchConfig] = []

    def corellm_models(self):
        def build(arch, ctx):
            self.seen.append(arch)
            return ctx.registry.get("model", "llama").spec.factory(arch, ctx)
        yield ModelSpec(name="renamed", architectures=("RenamedLlamaForCausalLM",),
                        factory=build, config_class=self.config_class)


def _renamed_checkpoint(llama_path, tmp_path, **extra) -> Path:
    copy = tmp_path / "renamed"
    shutil.copytree(llama_path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    renamed = {"architectures": ["RenamedLlamaForCausalLM"], "vocab_size": cfg["vocab_size"],
               "n_embd": cfg["hidden_size"], "n_layer": cfg["num_hidden_layers"],
               "n_head": cfg["num_attention_heads"], "n_kv_head": cfg["num_key_value_heads"],
               "n_ctx": cfg["max_position_embeddings"], "n_inner": cfg["intermediate_size"],
               "eps": cfg["rms_norm_eps"], "greeting": "hello", **extra}
    (copy / "config.json").write_text(json.dumps(renamed))
    return copy


def test_a_plugin_parses_config_keys_the_core_has_never_heard_of(llama_path, tmp_path):
    """No hidden_size, no num_hidden_layers: the model plugin's own parser reads the file."""
    copy = _renamed_checkpoint(llama_path, tmp_path)
    plugin = RenamedPlugin()
    ours = LLM(engine_config(copy), plugins=[plugin])
    ref = LLM(engine_config(llama_path))
    assert [type(a) for a in plugin.seen] == [GPT2NamedConfig]
    assert plugin.seen[0].greeting == "hello" and plugin.seen[0].raw["n_embd"] == 64
    prompt = {"prompt_token_ids": [9, 8, 7, 6]}
    assert ours.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        ref.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_the_core_checks_what_it_relies_on(llama_path, tmp_path):
    copy = _renamed_checkpoint(llama_path, tmp_path, n_kv_head=3)
    with pytest.raises(CheckpointError, match="num_attention_heads=4 is not a multiple of "
                                              "num_key_value_heads=3"):
        LLM(engine_config(copy), plugins=[RenamedPlugin()])
    copy = _renamed_checkpoint(llama_path, tmp_path / "2", n_layer=0)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers must be a positive integer, "
                                              r"got 0 \(as parsed by GPT2NamedConfig"):
        LLM(engine_config(copy), plugins=[RenamedPlugin()])


def test_a_broken_parser_is_named(llama_path, tmp_path):
    class Crashing(GPT2NamedConfig):
        @classmethod
        def parse_fields(cls, r):
            return {}["boom"]

    copy = _renamed_checkpoint(llama_path, tmp_path)
    with pytest.raises(PluginError, match=r"model 'renamed'.*Crashing.from_dict failed .*"
                                          r"KeyError\('boom'\)"):
        LLM(engine_config(copy), plugins=[RenamedPlugin(Crashing)])


def test_config_class_must_be_a_model_arch_config():
    with pytest.raises(PluginError, match="config_class must subclass "
                                          "corellm.arch.ModelArchConfig"):
        load_registry(plugins=[RenamedPlugin(config_class=dict)])


def test_missing_architectures_is_named(llama_path, tmp_path):
    copy = tmp_path / "noarch"
    shutil.copytree(llama_path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["architectures"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no 'architectures' key: corellm chooses the "
                                              "model plugin by it"):
        LLM(engine_config(copy))


def test_attention_layers_are_the_attention_modules():
    """``CausalLM.attention_layers()``'s default: one spec per ``corellm.layers.Attention``
    (subclasses included), by layer index; another module that keeps a reference to a layer's
    spec is not a second layer."""
    import torch.nn as nn

    from corellm.interfaces import AttentionLayerSpec, attention_layer_specs
    from corellm.layers import Attention

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.attn = (Attention if i == 0 else type("MyAttention", (Attention,), {}))(
                None, i, 4, 2, 8)
            self.spec = self.attn.spec            # a convenience copy, not a layer

    model = nn.Sequential(Block(1), Block(0))
    specs = attention_layer_specs(model)
    assert [s.layer_idx for s in specs] == [0, 1]
    assert all(isinstance(s, AttentionLayerSpec) for s in specs)
