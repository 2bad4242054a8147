"""Writing a GGUF file from a Hugging Face checkpoint directory with the ``gguf`` library's writer,
the way llama.cpp's converter lays one out (tensor names, Llama's Q/K row interleave, metadata keys,
a byte-level BPE tokenizer as ``gpt2``), so the tests can load it back and compare with the
safetensors original."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Hugging Face name pieces -> llama.cpp's, the inverse of corellm.checkpoint.gguf's table (written
# out again
# here on purpose: the test must not derive its expectations from the code under test).
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)          # model.layers.<i>.<rest>
    return f"blk.{layer}.{_BLOCK[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's ``LlamaModel.permute`` (rotary halves -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(ckpt: Path, out: Path, tensor_type: str = "F32", *, arch: str | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None,
               split_max_tensors: int = 0) -> Path:
    """Write ``ckpt`` (config.json, model.safetensors, tokenizer) as one GGUF file.

    2-D weights are stored as ``tensor_type`` (F32, F16, Q8_0, Q4_0...); norms and biases as F32,
    as llama.cpp does. ``arch`` overrides general.architecture (to test refusals).
    """
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((ckpt / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                    "qwen3": "qwen3"}[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_name(ckpt.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or
                               (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    special = set(tok.all_special_tokens) | {a["content"] for a in json.loads(
        tok.backend_tokenizer.to_str())["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)

    qtype = gguf.GGMLQuantizationType[tensor_type]
    tensors = load_file(str(ckpt / "model.safetensors"))
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if arch == "llama" and ".self_attn.q_proj." in name:
            t = llama_cpp_permute(t, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            t = llama_cpp_permute(t, kv_heads)
        if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), t)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), t.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
