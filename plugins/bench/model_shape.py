"""The shape of a model, what its step cost depends on, and the dtypes the cost models know."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corellm.checkpoint.reader import ModelArchConfig

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def dtype_name(dtype: str) -> str:
    """Canonical torch-style dtype name (``"bf16"`` and ``"torch.bfloat16"`` -> ``"bfloat16"``)."""
    d = str(dtype).removeprefix("torch.")
    d = _DTYPE_ALIASES.get(d, d)
    if d not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BYTES)})")
    return d


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype_name(dtype)]


def dtype_key(dtype: str) -> str:
    """A dtype name for comparison: canonical when known (``bf16`` == ``bfloat16``), else as
    given."""
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-family decoder (gated MLP, RMSNorm, grouped-query attention,
    no biases): what its step cost depends on. Other layouts are approximated by it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in fields(self)[:-1]:
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: must be a positive integer, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError("tie_word_embeddings: must be true or false, got "
                             f"{self.tie_word_embeddings!r}")

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, gate/up/down MLP, two norms."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params_non_embedding(self) -> int:
        """Every layer plus the final norm: the weights every token multiplies."""
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def num_params(self) -> int:
        """Embedding + layers + final norm + LM head (a separate matrix only when untied)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_params_non_embedding + head

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through the layers (2 per weight), excluding attention
        scores and the LM head (which only sampled rows go through)."""
        return 2 * self.num_params_non_embedding

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes the weights occupy."""
        return self.num_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def fingerprint(self) -> dict[str, Any]:
        """The shape fields: what identifies "the same model" when checking a profile."""
        return asdict(self)

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama key names). Missing
        ``intermediate_size`` falls back to ``4 * hidden_size``."""
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]),
                   num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
                   vocab_size=int(cfg["vocab_size"]),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_arch(cls, arch: ModelArchConfig) -> ModelShape:
        """From a parsed ``ModelArchConfig``. ``intermediate_size`` is the arch field
        (``LlamaArchConfig``), else ``arch.raw["intermediate_size"]``, else ``4 * hidden_size``
        (the classic MLP width: an assumption); ``tie_word_embeddings`` likewise, else False."""
        raw = arch.raw or {}
        inter = getattr(arch, "intermediate_size", None) or raw.get("intermediate_size") \
            or 4 * arch.hidden_size
        tied = getattr(arch, "tie_word_embeddings", None)
        if tied is None:
            tied = bool(raw.get("tie_word_embeddings", False))
        return cls(hidden_size=arch.hidden_size, num_layers=arch.num_hidden_layers,
                   num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                   head_dim=arch.head_dim, intermediate_size=int(inter),
                   vocab_size=arch.vocab_size, tie_word_embeddings=bool(tied))


def model_fingerprint(arch: ModelArchConfig) -> dict[str, Any]:
    """What identifies "the same model" for a profile: the architecture and the shape."""
    return {"architecture": (arch.architectures or ("?",))[0],
            **ModelShape.from_arch(arch).fingerprint()}
