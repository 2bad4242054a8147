"""Reading checkpoints: a Hugging Face directory (its config in both transformers 4 and 5
spellings, safetensors weights in one file or sharded with an index), or a GGUF file
(``corellm.gguf``), which is turned into the same config dict and Hugging Face tensor names.

The model plugin chosen by the config's ``architectures`` parses the config (its
``ModelSpec.config_class``, by default the Llama-family ``LlamaArchConfig``) into a
``ModelArchConfig``: the facts the engine needs plus whatever the model needs. Model plugins see
only that and ``(name, tensor)`` pairs, whichever format the checkpoint is in."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from corellm.errors import CheckpointError, PluginError

if TYPE_CHECKING:
    from corellm.config import EngineConfig
    from corellm.plugins import Registry, RegisteredComponent


_MISSING: Any = object()


class ConfigReader:
    """Typed reads of a checkpoint's config dict, for a model plugin's config parser.

    Every read names the file and key when it fails: a missing required key, or a value of the
    wrong type. A key may have aliases (GPT-2 spells ``hidden_size`` as ``n_embd``): the first
    one present wins. ``None`` (JSON ``null``) counts as absent, as transformers writes unset
    keys that way.
    """

    def __init__(self, cfg: dict[str, Any], source: str = "config.json") -> None:
        self.cfg = cfg
        self.source = source

    def has(self, *keys: str) -> bool:
        return any(self.cfg.get(k) is not None for k in keys)

    def raw(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.cfg[key]
        if default is _MISSING:
            also = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
            raise CheckpointError(f"{self.source}: missing required key {keys[0]!r}{also}")
        return default

    def _key(self, keys: tuple[str, ...]) -> str:
        return next((k for k in keys if self.cfg.get(k) is not None), keys[0])

    def int(self, *keys: str, default: Any = _MISSING) -> Any:
        value = self.raw(*keys, default=default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.source}: {self._key(keys)!r} must be an integer, "
                                  f"got {value!r}")
        return value

    def float(self, *keys: str, default: Any = _MISSING) -> Any:
        value = self.raw(*keys, default=default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.source}: {self._key(keys)!r} must be a number, "
                                  f"got {value!r}")
        return float(value)

    def bool(self, *keys: str, default: Any = _MISSING) -> Any:
        value = self.raw(*keys, default=default)
        if type(value) is int and value in (0, 1):        # some hand-written configs say 1/0
            return bool(value)
        if not isinstance(value, bool) and not (value is default and default is not _MISSING):
            raise CheckpointError(f"{self.source}: {self._key(keys)!r} must be true or false, "
                                  f"got {value!r}")
        return value

    def str(self, *keys: str, default: Any = _MISSING) -> Any:
        value = self.raw(*keys, default=default)
        if not isinstance(value, str) and not (value is default and default is not _MISSING):
            raise CheckpointError(f"{self.source}: {self._key(keys)!r} must be a string, "
                                  f"got {value!r}")
        return value


# The rope_type values corellm.layers.get_rope implements.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary-embedding parameters, read from either transformers spelling."""

    theta: float
    scaling: dict[str, Any] | None     # rope_type and its parameters; None for plain RoPE
    partial_rotary_factor: float       # the fraction of each head's dimensions rotated

    @classmethod
    def read(cls, r: ConfigReader, default_theta: float = 10000.0) -> RopeConfig:
        """transformers >= 5 nests theta, scaling and the partial factor in ``rope_parameters``;
        4.x spells them ``rope_theta``, ``rope_scaling`` (whose type key was once ``type``) and
        ``partial_rotary_factor``."""
        params = r.cfg.get("rope_parameters")
        if params is not None and not isinstance(params, dict):
            raise CheckpointError(f"{r.source}: 'rope_parameters' must be a mapping, got "
                                  f"{params!r}")
        if isinstance(params, dict) and "full_attention" in params:
            params = params["full_attention"]             # the per-layer-type form
        if isinstance(params, dict):
            rope = dict(params)
            theta = rope.pop("rope_theta", None)
        else:
            scaling = r.cfg.get("rope_scaling")
            if scaling is not None and not isinstance(scaling, dict):
                raise CheckpointError(f"{r.source}: 'rope_scaling' must be a mapping, got "
                                      f"{scaling!r}")
            rope, theta = dict(scaling or {}), None
        if theta is None:
            theta = r.float("rope_theta", default=default_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise CheckpointError(f"{r.source}: rope_theta must be a positive number, got "
                                  f"{theta!r}")
        rope_type = rope.pop("rope_type", rope.pop("type", "default")) or "default"
        partial = rope.pop("partial_rotary_factor", None)
        if partial is None:
            partial = r.float("partial_rotary_factor", default=1.0)
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or \
                not 0 < partial <= 1:
            raise CheckpointError(f"{r.source}: partial_rotary_factor must be in (0, 1], got "
                                  f"{partial!r}")
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"{r.source}: rope_type {rope_type!r} is not supported "
                                  f"(supported: {', '.join(ROPE_TYPES)})")
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        return cls(float(theta), scaling, float(partial))

    @staticmethod
    def max_len_limit(max_position_embeddings: int,
                      scaling: dict[str, Any] | None) -> int | None:
        """The longest sequence a RoPE model supports: ``max_position_embeddings``, except under
        linear scaling (position interpolation: configs keep the original length and the
        factor stretches it; None, no limit). Llama 3 scaling configs already give the extended
        length."""
        if scaling is not None and scaling.get("rope_type") == "linear":
            return None
        return max_position_embeddings


@dataclass(frozen=True, kw_only=True)
class ModelArchConfig:
    """What the engine needs to know of any checkpoint's architecture.

    A model plugin's ``ModelSpec.config_class`` parses ``config.json`` into this class or a
    subclass that adds the fields its model needs; the core reads only these fields. ``raw`` is
    the config dict as read (a GGUF file's metadata in ``config.json`` form), for anything no
    field holds.
    """

    architectures: tuple[str, ...]
    model_type: str = ""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None = None   # tokens each query of a sliding layer sees
    # Hugging Face's per-layer kinds ("full_attention", "sliding_attention"); None: every layer
    # slides when sliding_window is set.
    layer_types: tuple[str, ...] | None = None
    eos_token_id: int | list[int] | None = None
    checkpoint_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> Self:
        """Parse a ``config.json``-shaped dict. Subclasses extend ``parse_fields``."""
        return cls(**cls.parse_fields(ConfigReader(cfg, source)), raw=cfg)

    @classmethod
    def parse_fields(cls, r: ConfigReader) -> dict[str, Any]:
        """The field values, read with Hugging Face's common key names. A subclass returns
        ``{**super().parse_fields(r), "its_field": r.float("its_key")}``, or reads every field
        itself when its architecture names them differently."""
        hidden = r.int("hidden_size")
        heads = r.int("num_attention_heads")
        if heads < 1:
            raise CheckpointError(f"{r.source}: num_attention_heads must be a positive integer, "
                                  f"got {heads}")
        if hidden % heads and not r.has("head_dim"):
            raise CheckpointError(f"{r.source}: hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads} and there is no head_dim")
        architectures = r.raw("architectures", default=())
        if not isinstance(architectures, (list, tuple)):
            architectures = (architectures,)
        return dict(
            architectures=tuple(str(a) for a in architectures),
            model_type=r.str("model_type", default=""),
            vocab_size=r.int("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=r.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=r.int("num_key_value_heads", default=heads),
            head_dim=r.int("head_dim", default=hidden // heads),
            max_position_embeddings=r.int("max_position_embeddings", default=2048),
            eos_token_id=r.raw("eos_token_id", default=None),
            checkpoint_dtype=r.raw("dtype", "torch_dtype", default=None),
        )

    def max_len_limit(self) -> int | None:
        """The longest sequence the checkpoint supports, which ``model.max_model_len`` may not
        exceed; None when the architecture sets no limit. Default: max_position_embeddings."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (for its ``AttentionLayerSpec``), or None
        when the layer attends to the whole sequence."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and layer_idx < len(self.layer_types):
            return (self.sliding_window if self.layer_types[layer_idx] == "sliding_attention"
                    else None)
        return self.sliding_window


@dataclass(frozen=True, kw_only=True)
class LlamaArchConfig(ModelArchConfig):
    """The Llama-family decoder config (Llama, Mistral, Qwen2, Qwen3): the default parser of a
    ``ModelSpec`` that names no ``config_class``, and the form GGUF metadata is read into."""

    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # rope_type and its parameters, None for plain
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def parse_fields(cls, r: ConfigReader) -> dict[str, Any]:
        fields = super().parse_fields(r)
        rope = RopeConfig.read(r)
        if rope.partial_rotary_factor != 1.0:
            raise CheckpointError(
                f"{r.source}: partial_rotary_factor={rope.partial_rotary_factor:g}: the default "
                "parser (LlamaArchConfig) is for decoders that rotate every dimension; a "
                "model plugin for this architecture parses its config with its own "
                "ModelSpec.config_class, a ModelArchConfig subclass that keeps the factor "
                "(docs/plugins.md, 'The config class'), and rotates part of each head with "
                "corellm.layers.get_rope(..., rotary_dim=...)")
        model_type = fields["model_type"]
        sliding = r.int("sliding_window", default=None)
        layer_types = r.raw("layer_types", default=None)
        if layer_types is not None:
            if not isinstance(layer_types, list) or not all(isinstance(t, str)
                                                            for t in layer_types):
                raise CheckpointError(f"{r.source}: 'layer_types' must be a list of strings, "
                                      f"got {layer_types!r}")
            if len(layer_types) != fields["num_hidden_layers"]:
                raise CheckpointError(f"{r.source}: 'layer_types' has {len(layer_types)} "
                                      f"entries for num_hidden_layers="
                                      f"{fields['num_hidden_layers']}")
            if "sliding_attention" not in layer_types:
                sliding = None
        elif model_type in ("qwen2", "qwen3"):
            if not r.bool("use_sliding_window", default=False):
                sliding = None
            elif sliding:     # as Hugging Face's Qwen2Config: layers from max_window_layers on
                first = r.int("max_window_layers", default=28)
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(fields["num_hidden_layers"])]
        return dict(
            fields,
            intermediate_size=r.int("intermediate_size"),
            rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
            attention_bias=r.bool("attention_bias", default=False),
            mlp_bias=r.bool("mlp_bias", default=False),
            hidden_act=r.str("hidden_act", default="silu"),
            sliding_window=int(sliding) if sliding else None,
            layer_types=tuple(layer_types) if sliding and layer_types is not None else None,
        )

    def max_len_limit(self) -> int | None:
        return RopeConfig.max_len_limit(self.max_position_embeddings, self.rope_scaling)


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
                          f"{type(arch).__name__}, not a corellm.model_config.ModelArchConfig")
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
        from corellm.plugins import load_registry
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


def iter_weights(path: str | Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (Hugging Face name, tensor) for every tensor of the checkpoint, one shard (or one
    GGUF tensor, dequantized to float32) at a time. ``lazy``: safetensors tensors come as lazy
    slices (read with ``corellm.layers.loading.narrow_weight`` / ``as_tensor``, valid until the
    next item), so a tensor-parallel rank reads only its shard."""
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
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
