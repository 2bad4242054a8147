"""Reading checkpoints: a Hugging Face directory (its config in both transformers 4 and 5
spellings, safetensors weights in one file or sharded with an index), or a GGUF file
(``corellm.checkpoint.gguf``), which is turned into the same config dict and Hugging Face
tensor names.

The model plugin chosen by the config's ``architectures`` parses the config (its
``ModelSpec.config_class``, by default the Llama-family ``LlamaArchConfig``) into a
``ModelArchConfig``: the facts the engine needs plus whatever the model needs. Model plugins see
only that and ``(name, tensor)`` pairs, whichever format the checkpoint is in."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The architecture data is public here too (ModelSpec.config_class subclasses ModelArchConfig).
from corellm.arch import (ROPE_TYPES, ConfigReader, LlamaArchConfig,  # noqa: F401
                          ModelArchConfig, RopeConfig)
from corellm.errors import CheckpointError, ConfigError, PluginError

if TYPE_CHECKING:
    from corellm.config.schema import EngineConfig
    from corellm.plugins.discovery import Registry, RegisteredComponent


def read_checkpoint_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """A checkpoint's config as a ``config.json``-shaped dict, and where it came from (the file,
    or the GGUF file's metadata)."""
    p = locate_checkpoint(path)
    if p.is_file():
        return open_gguf(p).config, f"{p} (GGUF metadata)"
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"model.path: {str(p)!r} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: malformed JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    return cfg, str(cfg_file)


def parse_arch_config(cfg: dict[str, Any], source: str, registry: Registry,
                      implementation: str | None = None,
                      ) -> tuple[ModelArchConfig, RegisteredComponent]:
    """Pick the model plugin by ``architectures`` and let it parse the config; then check the
    facts the engine itself relies on. Returns the parsed config and the chosen plugin."""
    architectures = cfg.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise CheckpointError(f"{source}: 'architectures' must be a list of strings, got "
                              f"{architectures!r}")
    if not architectures:
        raise CheckpointError(f"{source}: no 'architectures' key: corellm chooses the model "
                              "plugin by it (e.g. \"architectures\": [\"LlamaForCausalLM\"])")
    entry = registry.model_for(architectures, implementation)
    config_class = entry.spec.config_class or LlamaArchConfig   # type: ignore[attr-defined]
    owner = f"{entry.plugin.describe()}, model {entry.spec.name!r}"
    try:
        arch = config_class.from_dict(cfg, source)
    except CheckpointError:
        raise
    except Exception as exc:
        raise PluginError(f"{owner}: {config_class.__name__}.from_dict failed on {source}: "
                          f"{exc!r}") from exc
    if not isinstance(arch, ModelArchConfig):
        raise PluginError(f"{owner}: {config_class.__name__}.from_dict returned "
                          f"{type(arch).__name__}, not a corellm.arch.ModelArchConfig")
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
    for name in positive:
        value = getattr(arch, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{source}: {name} must be a positive integer, got {value!r} "
                                  f"(as parsed by {config_class.__name__} of {owner})")
    sliding = arch.sliding_window
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int)
                                or sliding < 1):
        raise CheckpointError(f"{source}: sliding_window must be None or a positive integer, "
                              f"got {sliding!r} (as parsed by {config_class.__name__} of {owner})")
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads={arch.num_attention_heads} is not "
                              f"a multiple of num_key_value_heads={arch.num_key_value_heads}")
    if not arch.architectures:
        arch = dataclasses.replace(arch, architectures=tuple(architectures))
    return arch, entry


def load_arch_config(path: str | Path, registry: Registry | None = None,
                     implementation: str | None = None) -> ModelArchConfig:
    """The checkpoint's config as parsed by the model plugin its ``architectures`` selects
    (with ``registry``, or the installed plugins)."""
    if registry is None:
        from corellm.plugins.discovery import load_registry
        registry = load_registry()
    cfg, source = read_checkpoint_config(path)
    return parse_arch_config(cfg, source, registry, implementation)[0]


def resolve_max_model_len(arch: ModelArchConfig, requested: int | None) -> int:
    """``model.max_model_len`` (default: the checkpoint's max_position_embeddings), checked
    against what the checkpoint supports (a sliding window is the attention backend's to
    support: the model runner asks it at start-up)."""
    max_len = requested or arch.max_position_embeddings
    limit = arch.max_len_limit()
    if limit is not None and max_len > limit:
        what = (f"max_position_embeddings={limit}" if limit == arch.max_position_embeddings
                else f"limit of {limit} tokens")
        raise CheckpointError(f"model.max_model_len={max_len} exceeds the checkpoint's {what}")
    return max_len


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_dtype_name(requested: str, arch: ModelArchConfig) -> str:
    """``model.dtype``, or for ``auto`` the checkpoint's (float32 when it names none or
    another). The platform has the last word (``Platform.resolve_dtype``: the CPU runs a
    float16 checkpoint in float32, where fp16 matmuls are slow or missing)."""
    if requested != "auto":
        return requested
    name = str(arch.checkpoint_dtype).replace("torch.", "")
    return name if name in DTYPE_NAMES else "float32"


def model_path(config: EngineConfig) -> str:
    """The checkpoint the config names, or the default model
    (``corellm.checkpoint.demo.default_model``)."""
    if config.model.path is not None:
        return config.model.path
    from corellm.checkpoint.demo import default_model
    return str(default_model()[0])


def locate_checkpoint(path: str | Path, key: str = "model.path") -> Path:
    """The checkpoint ``path`` names: a Hugging Face directory, or a ``.gguf`` file (named, or
    the only one in a directory without ``config.json``)."""
    from corellm.checkpoint.gguf import find_gguf, is_gguf

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
    from corellm.checkpoint.gguf import GGUFCheckpoint, cache_key

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
        from corellm.checkpoint.gguf import gguf_tokenizer_dir
        return gguf_tokenizer_dir(p)
    return p


def checkpoint_name(path: str | Path | None) -> str:
    """A short display name: a directory's name, or a GGUF file's without the quantization
    suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``). ``None`` is the
    default model (``corellm.checkpoint.demo.default_model``)."""
    if path is None:
        from corellm.checkpoint.demo import DEMO_NAME, default_model
        real_path, real = default_model()
        return checkpoint_name(real_path) if real else DEMO_NAME
    from corellm.checkpoint.gguf import display_name, is_gguf
    p = Path(path)
    return display_name(p) if is_gguf(p) else p.name


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


def resolve_quantization(requested: str | None, path: str | Path) -> str:
    """``model.quantization`` for this checkpoint: absent means ``gguf`` for a GGUF file and
    ``none`` otherwise; ``gguf`` for anything but a GGUF file is a ConfigError."""
    is_file = locate_checkpoint(path).is_file()
    if requested is None:
        return "gguf" if is_file else "none"
    if requested == "gguf" and not is_file:
        raise ConfigError([("model.quantization",
                            f"'gguf' keeps a GGUF file's quantized blocks, but {str(path)!r} "
                            "is a safetensors checkpoint (int8 quantizes it at load)")])
    return requested


def iter_weights(path: str | Path, lazy: bool = False,
                 quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, tensor) for every tensor of the checkpoint, one shard (or one
    GGUF tensor) at a time. ``lazy``: safetensors tensors come as lazy slices (read with
    ``corellm.layers.loading.narrow_weight`` / ``as_tensor``, valid until the next item), so a
    tensor-parallel rank reads only its shard. ``quantized``: a GGUF file's quantized weights
    come as ``corellm.quant.QuantizedTensor`` where corellm keeps their format (else
    everything is dequantized to float32)."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    p = locate_checkpoint(path)
    if p.is_file():
        yield from open_gguf(p).iter_weights(quantized=quantized)
        return

    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def load_tokenizer(path: str, key: str = "model.tokenizer") -> Any:
    local = tokenizer_path(path, key=key)   # a local directory: nothing is fetched from a hub
    try:
        cls = _plain_fast_tokenizer_class(local)
        if cls is not None:
            return cls.from_pretrained(str(local))
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(local))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{key}: cannot load a tokenizer from {path!r}: {exc}") from exc


_PLAIN_TOKENIZER_FAMILIES = {"llama", "qwen2", "qwen3"}


def plain_fast_tokenizer_name(directory: Path) -> str | None:
    """The transformers class name of a tokenizer directory holding a plain ``tokenizer.json``
    tokenizer that ``load_tokenizer`` loads directly (the generic fast class, no remote code,
    a model family whose tokenizer ``AutoTokenizer`` would not replace); else None."""
    import json

    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    if name not in ("TokenizersBackend", "PreTrainedTokenizerFast") or "auto_map" in cfg \
            or not (directory / "tokenizer.json").is_file():
        return None
    # AutoTokenizer also consults config.json's model_type (Mistral's own tokenizer backend,
    # families whose hub class it overrides): only families where it takes the class above.
    model_cfg = directory / "config.json"
    if model_cfg.is_file():
        try:
            model_type = json.loads(model_cfg.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
        if model_type not in _PLAIN_TOKENIZER_FAMILIES:
            return None
    return name


def _plain_fast_tokenizer_class(directory: Path) -> Any:
    """The transformers class of a plain ``tokenizer.json`` tokenizer, loaded directly.

    ``AutoTokenizer`` resolves the class through the model registry, importing torch and the
    model families' modules (most of a small model's start-up); a tokenizer whose
    ``tokenizer_config.json`` names the generic fast class needs none of that. Anything else
    (model-specific classes, remote code) goes through ``AutoTokenizer``.
    """
    name = plain_fast_tokenizer_name(directory)
    if name is None:
        return None
    import transformers
    return getattr(transformers, name, None)
