"""Reading checkpoints: a Hugging Face directory (its config in both transformers 4 and 5
spellings, safetensors weights in one file or sharded with an index), or a GGUF file
(``corellm.gguf``), which is turned into the same config dict and Hugging Face tensor names. Model
plugins see only the normalized ``ModelArchConfig`` and ``(name, tensor)`` pairs, whichever format
the checkpoint is in."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corellm.errors import CheckpointError

if TYPE_CHECKING:
    from corellm.config import EngineConfig


@dataclass(frozen=True)
class ModelArchConfig:
    """The architecture facts model plugins need, normalized from ``config.json``."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None     # rope_type and its parameters, None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None
    eos_token_id: int | list[int] | None
    checkpoint_dtype: str | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArchConfig:
        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            return cfg[key]

        # Rope: transformers >= 5 nests theta and scaling in `rope_parameters`; 4.x spells them
        # `rope_theta` and `rope_scaling` (whose type key was once `type`).
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            rope_params = rope_params["full_attention"]   # per-layer-type form
        if isinstance(rope_params, dict):
            rope = dict(rope_params)
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        else:
            rope = dict(cfg.get("rope_scaling") or {})
            theta = float(cfg.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default")) or "default"
        partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise CheckpointError(f"{source}: partial_rotary_factor={partial} is not supported")
        rope_scaling = None if rope_type == "default" and not rope else {"rope_type": rope_type, **rope}

        model_type = str(cfg.get("model_type", ""))
        sliding = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if layer_types is not None:
            if "sliding_attention" not in layer_types:
                sliding = None
        elif model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        return cls(
            architectures=tuple(cfg.get("architectures") or ()),
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            sliding_window=int(sliding) if sliding else None,
            eos_token_id=cfg.get("eos_token_id"),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            raw=cfg,
        )


def model_path(config: EngineConfig) -> str:
    """The checkpoint the config names, or the default model (``corellm.demo.default_model``)."""
    if config.model.path is not None:
        return config.model.path
    from corellm.demo import default_model
    return str(default_model()[0])


def locate_checkpoint(path: str | Path, key: str = "model.path") -> Path:
    """The checkpoint ``path`` names: a Hugging Face directory, or a ``.gguf`` file (named, or
    the only one in a directory without ``config.json``)."""
    from corellm.gguf import find_gguf, is_gguf

    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{key}: {str(p)!r} does not exist")
    if p.is_file():
        if is_gguf(p):
            return p
        raise CheckpointError(f"{key}: {str(p)!r} is a file but not a .gguf one (expected a "
                              "Hugging Face checkpoint directory with config.json and "
                              "*.safetensors, or a GGUF file)")
    if not (p / "config.json").is_file():
        return find_gguf(p, key) or p
    return p


def checkpoint_dir(path: str | Path, key: str = "model.path") -> Path:
    """A Hugging Face checkpoint directory (GGUF files are refused here)."""
    p = locate_checkpoint(path, key)
    if p.is_file():
        raise CheckpointError(f"{key}: {str(p)!r} is a GGUF file; a directory is needed here")
    return p


def open_gguf(path: str | Path) -> Any:
    """The ``GGUFCheckpoint`` for a ``.gguf`` path (its cached index, built on first use)."""
    from corellm.gguf import GGUFCheckpoint, cache_key

    p = Path(path).resolve()
    key = cache_key(p)                 # path, size and mtime: a rewritten file is read again
    if key not in _GGUF_OPEN:
        _GGUF_OPEN[key] = GGUFCheckpoint(p)
    return _GGUF_OPEN[key]


_GGUF_OPEN: dict[str, Any] = {}


def tokenizer_path(path: str | Path, key: str = "model.tokenizer") -> Path:
    """Where to load a tokenizer from: the directory, or a GGUF file's converted tokenizer."""
    p = locate_checkpoint(path, key)
    if p.is_file():
        from corellm.gguf import gguf_tokenizer_dir
        return gguf_tokenizer_dir(p)
    return p


def checkpoint_name(path: str | Path | None) -> str:
    """A short display name: a directory's name, or a GGUF file's without the quantization
    suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``). ``None`` is the
    default model (``corellm.demo.default_model``)."""
    if path is None:
        from corellm.demo import DEMO_NAME, default_model
        real_path, real = default_model()
        return checkpoint_name(real_path) if real else DEMO_NAME
    from corellm.gguf import display_name, is_gguf
    p = Path(path)
    return display_name(p) if is_gguf(p) else p.name


def load_arch_config(path: str | Path) -> ModelArchConfig:
    p = locate_checkpoint(path)
    if p.is_file():
        return ModelArchConfig.from_dict(open_gguf(p).config, source=f"{p} (GGUF metadata)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"model.path: {str(p)!r} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: malformed JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    return ModelArchConfig.from_dict(cfg, source=str(cfg_file))


def load_generation_eos_ids(path: str | Path) -> list[int]:
    """Extra end-of-sequence ids from ``generation_config.json`` (e.g. chat models' end-of-turn),
    or a GGUF file's end-of-sequence and end-of-turn ids."""
    p = locate_checkpoint(path)
    if p.is_file():
        return open_gguf(p).generation_eos_ids()
    f = p / "generation_config.json"
    if not f.is_file():
        return []
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def checkpoint_files(path: str | Path) -> list[Path]:
    p = checkpoint_dir(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from exc
        files = [p / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model.path: {str(p)!r} has no *.safetensors weights "
                              "(PyTorch .bin checkpoints are not supported; re-save with "
                              "safe_serialization=True)")
    return files


def iter_weights(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, tensor) for every tensor of the checkpoint, one shard (or one
    GGUF tensor, dequantized to float32) at a time."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    p = locate_checkpoint(path)
    if p.is_file():
        yield from open_gguf(p).iter_weights()
        return

    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
