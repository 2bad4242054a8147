"""A checkpoint's architecture as the engine reads it: ``ModelArchConfig`` (the facts the engine
needs, plus whatever a model needs), the Llama family's ``LlamaArchConfig``, its rotary scaling
(``RopeConfig``), and ``ConfigReader``, the typed reads a model plugin's config parser makes.

Data only: reading a checkpoint from disk and choosing the model plugin that parses it is
``corellm.checkpoint.reader``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from corellm.errors import CheckpointError

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
