"""GGUF checkpoints: llama.cpp's single-file format, read with the ``gguf`` library.

A GGUF file carries everything a Hugging Face checkpoint directory does, in other words: the
architecture's hyperparameters as metadata keys (``llama.block_count``...), the tokenizer
(vocabulary, merges, special ids) and the chat template, and the tensors under llama.cpp's names
(``blk.0.attn_q.weight``), often quantized. This module turns it into what the rest of corellm
already understands, so every model plugin loads GGUF without knowing it exists:

- the metadata becomes a ``config.json``-shaped dict, parsed by the same
  model plugin's config parser (``ModelSpec.config_class``) as a safetensors checkpoint;
- tensors are renamed to their Hugging Face names and, under ``model.quantization: gguf`` (the
  default for a GGUF file), the 2-D ones in a format corellm multiplies directly
  (``corellm.quant.GGUF_FORMATS``) stay in their blocks as ``QuantizedTensor``; the rest are
  dequantized (``gguf.quants.dequantize``) to float32 as they are read, one at a time, and the
  model's ``load_weights`` casts them to the model dtype. llama.cpp stores Llama's Q and K
  projections with the rows of each head interleaved for its rotary kernel; they are put back
  in Hugging Face's order;
- the tokenizer is converted by transformers (``from_pretrained(..., gguf_file=...)``).

Parsing the metadata (``gguf.GGUFReader`` walks every vocabulary entry) and converting the
tokenizer take seconds, so both are done once per file and cached under
``$CORELLM_CACHE/gguf/<name>-<hash>/`` (keyed by the file's path, size and modification time):
``index/`` holds the tensor index (name, type, shape, byte offset), the metadata and the config,
``tokenizer/`` the converted tokenizer files. The two are built independently (a server's two
processes build one each, at once). Later loads read the tensors straight from a memory map of
the file.

Refused at start-up, with the supported alternatives named: architectures with no mapping to a
model family here, tensor types the ``gguf`` library cannot dequantize, and tensors with no
Hugging Face name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from corellm.checkpoint.cache import build_once, cache_dir
from corellm.errors import CheckpointError

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
# llama.cpp's file-name convention: "<model>.Q4_K_M.gguf", "<model>-f16.gguf".
_QUANT_SUFFIX = re.compile(r"[.-](?:[IT]?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF ``general.architecture`` maps onto a Hugging Face model family."""

    hf_architecture: str         # config.json "architectures"[0]: selects the model plugin
    model_type: str
    permuted_qk: bool            # llama.cpp's converter interleaved Q/K rows for its RoPE


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),   # + Mistral
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

# llama.cpp tensor names -> Hugging Face names (the Llama family's layout).
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Array-valued metadata kept out of the cached index (the tokenizer files hold them).
_BULKY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
               "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def display_name(path: Path) -> str:
    """The file's name without ``.gguf`` and a quantization suffix (``.Q4_1``, ``-q4_k_m``)."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def hf_tensor_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{suffix}"
    return None


@cache
def dequantizable_types() -> tuple[str, ...]:
    """Names of the tensor types the installed ``gguf`` library can dequantize (probed)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    names = []
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        block, size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except Exception:           # NotImplementedError, or whatever a broken trait raises
            continue
        names.append(qtype.name)
    return tuple(names)


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    value = field.contents()
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, float) and field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))   # 1e-06, not 9.99999997e-07
    return value


def cache_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                            f"{INDEX_VERSION}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def hf_config(metadata: dict[str, Any], tensors: dict[str, dict[str, Any]],
              source: str) -> dict[str, Any]:
    """A ``config.json``-shaped dict from the GGUF metadata and tensor list."""
    arch_name = metadata.get("general.architecture")
    arch = ARCHITECTURES.get(str(arch_name))
    if arch is None:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch_name!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}")

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch_name}.{name}", default)

    def need(name: str) -> Any:
        value = key(name)
        if value is None:
            raise CheckpointError(f"{source}: GGUF metadata lacks {arch_name}.{name}")
        return value

    if "rope_freqs.weight" in tensors:
        raise CheckpointError(
            f"{source}: per-dimension RoPE frequency factors (tensor rope_freqs.weight, "
            "Llama 3.1-style rope scaling) are not supported in GGUF files")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(key("attention.key_length") or hidden // heads)
    embed = tensors.get("token_embd.weight")
    vocab = key("vocab_size") or (embed["shape"][0] if embed else None)
    if vocab is None:
        raise CheckpointError(f"{source}: cannot tell the vocabulary size (no "
                              f"{arch_name}.vocab_size and no token_embd.weight)")
    kv_heads = key("attention.head_count_kv") or heads
    if isinstance(kv_heads, list):
        raise CheckpointError(f"{source}: per-layer KV head counts are not supported")
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch.model_type != "qwen2" and "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    rope_dims = key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": str(scaling),
                               "factor": float(key("rope.scaling.factor", 1.0))}
        original = key("rope.scaling.original_context_length")
        if original:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(original)
    window = key("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    return cfg


def _build_index(gguf_path: Path, out: Path) -> None:
    """Parse the file once: tensor index, metadata, config; convert the tokenizer."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:      # the reader raises ValueError, struct errors, IndexError...
        raise CheckpointError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc
    metadata = {name: _field_value(f) for name, f in reader.fields.items()
                if name not in _BULKY_KEYS and not name.startswith("GGUF.")}
    source = str(gguf_path)
    parts = metadata.get("split.count")
    if isinstance(parts, int) and parts > 1:
        raise CheckpointError(f"{source}: part {int(metadata.get('split.no', 0)) + 1} of a GGUF "
                              f"file split into {parts} parts; split files are not supported "
                              "(merge them with llama.cpp's gguf-split --merge)")
    supported = set(dequantizable_types())
    tensors: dict[str, dict[str, Any]] = {}
    bad_types: dict[str, list[str]] = {}
    unnamed: list[str] = []
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in supported:
            bad_types.setdefault(qtype, []).append(t.name)
        if hf_tensor_name(t.name) is None and t.name != "rope_freqs.weight":
            unnamed.append(t.name)
        tensors[t.name] = {"type": qtype, "shape": [int(d) for d in reversed(t.shape.tolist())],
                           "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
    if bad_types:
        found = "; ".join(f"{q} ({len(n)} tensors, e.g. {n[0]})" for q, n in bad_types.items())
        raise CheckpointError(
            f"{source}: tensor type(s) the gguf library cannot dequantize: {found}; supported: "
            f"{', '.join(sorted(supported))}")
    try:
        config = hf_config(metadata, tensors, source)
    except (TypeError, ValueError) as exc:       # e.g. a list where a number belongs
        raise CheckpointError(f"{source}: malformed GGUF metadata ({exc})") from exc
    if unnamed:
        raise CheckpointError(
            f"{source}: {len(unnamed)} tensor(s) have no Hugging Face name for GGUF architecture "
            f"{metadata.get('general.architecture')!r}: {', '.join(unnamed[:5])}")
    index = {"version": INDEX_VERSION, "file": str(gguf_path.resolve()), "config": config,
             "metadata": metadata, "tensors": tensors}
    (out / "index.json").write_text(json.dumps(index, default=_json_default))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def _convert_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:       # transformers raises ValueError/KeyError/... per tokenizer
        GGUFCheckpoint(gguf_path)  # an unsupported architecture or type: say that instead
        raise CheckpointError(f"{gguf_path}: transformers cannot build a tokenizer from this "
                              f"GGUF file's metadata ({type(exc).__name__}: {exc})") from exc
    tok.save_pretrained(str(out))


def _file_cache(path: Path) -> Path:
    return cache_dir() / "gguf" / cache_key(path)


def gguf_tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer transformers converts from a GGUF file's metadata, saved as ordinary
    tokenizer files (built on first use). Independent of the tensor index, so that a server's
    API process converts the tokenizer while its engine process parses the index."""
    path = Path(path)
    return build_once(_file_cache(path) / "tokenizer", lambda tmp: _convert_tokenizer(path, tmp),
                      f"converting the tokenizer of {path.name}")


class GGUFCheckpoint:
    """One GGUF file: its config, metadata and tensor index (cached, built on first use)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"model.path: {str(self.path)!r} is not a file")
        self.cache = build_once(_file_cache(self.path) / "index",
                                lambda tmp: _build_index(self.path, tmp),
                                f"reading the GGUF metadata of {self.path.name}")
        index = json.loads((self.cache / "index.json").read_text())
        self.config: dict[str, Any] = index["config"]
        self.metadata: dict[str, Any] = index["metadata"]
        self.tensors: dict[str, dict[str, Any]] = index["tensors"]
        self.permuted_qk = ARCHITECTURES[self.metadata["general.architecture"]].permuted_qk

    def generation_eos_ids(self) -> list[int]:
        """End-of-turn ids beside the end-of-sequence one (llama.cpp's EOT/EOM)."""
        ids = [self.metadata.get(k) for k in ("tokenizer.ggml.eos_token_id",
                                              "tokenizer.ggml.eot_token_id",
                                              "tokenizer.ggml.eom_token_id")]
        return [int(i) for i in ids if i is not None]

    def iter_weights(self, quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) for every tensor, one at a time: float32, dequantized;
        with ``quantized``, a 2-D tensor in a format corellm keeps quantized
        (``corellm.quant.GGUF_FORMATS``) comes as a ``QuantizedTensor`` over the file's blocks
        (its rows copied out of the memory map, reordered for Llama's Q and K) and other
        quantized types are dequantized (logged once per type)."""
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        from corellm.quant import GGUF_FORMATS, QuantizedTensor

        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
        # A plain array over the memory map: np.memmap's subclass hooks run on every slice the
        # dequantizers take (a third of their time).
        with open(self.path, "rb") as f:
            data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ),
                                 dtype=np.uint8)
        dequantized: dict[str, int] = {}
        for name, info in self.tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is None:
                continue
            qtype = GGMLQuantizationType[info["type"]]
            shape = tuple(info["shape"])
            raw = data[info["offset"]:info["offset"] + info["nbytes"]]
            qk_heads = None
            if self.permuted_qk and name.startswith("blk.") and (
                    ".attn_q." in name or ".attn_k." in name):
                qk_heads = heads if ".attn_q." in name else kv_heads
            if quantized and info["type"] in GGUF_FORMATS and len(shape) == 2:
                rows = torch.from_numpy(raw.reshape(shape[0], -1).copy())
                tensor = QuantizedTensor(rows, info["type"], shape[1])
                if qk_heads is not None:
                    tensor = tensor.map_rows(lambda t, h=qk_heads: unpermute_qk(t, h))
                yield hf_name, tensor
                continue
            if quantized and qtype not in floats:
                dequantized[info["type"]] = dequantized.get(info["type"], 0) + 1
            try:
                if qtype in floats:
                    array = dequantize(raw, qtype).reshape(shape)
                else:
                    array = dequantize(raw.reshape(quant_shape_to_byte_shape(shape, qtype)),
                                       qtype)
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: tensor {name} ({info['type']}, shape "
                                      f"{list(shape)}): {exc}") from exc
            # F32 comes back as a view of the read-only memory map: copy it.
            tensor = torch.from_numpy(np.array(array, dtype=np.float32,
                                               copy=qtype == GGMLQuantizationType.F32))
            if qk_heads is not None:
                tensor = unpermute_qk(tensor, qk_heads)
            yield hf_name, tensor
        for qtype, count in dequantized.items():
            logger.info("%s: %d %s tensor(s) dequantized at load (kept quantized: %s)",
                        self.path.name, count, qtype, ", ".join(GGUF_FORMATS))


def permute_qk(w: Any, n_heads: int) -> Any:
    """Hugging Face's Q/K row order -> llama.cpp's (each head's two rotary halves interleaved)."""
    rest = tuple(w.shape[1:])
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *rest)
            .transpose(1, 2).reshape(w.shape))


def unpermute_qk(w: Any, n_heads: int) -> Any:
    """The inverse of :func:`permute_qk`."""
    rest = tuple(w.shape[1:])
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(w.shape))


def find_gguf(directory: Path, key: str = "model.path") -> Path | None:
    """The one ``.gguf`` file in a directory without ``config.json``; None if there is none."""
    files = sorted(directory.glob("*.gguf"))
    if not files:
        return None
    if len(files) > 1:
        raise CheckpointError(f"{key}: {str(directory)!r} holds {len(files)} GGUF files "
                              f"({', '.join(f.name for f in files[:4])}); name one of them")
    return files[0]

