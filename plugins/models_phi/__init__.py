"""Phi-1/1.5/2 (``PhiForCausalLM``): a decoder that is not Llama-shaped, added through the same
public interfaces a third-party model plugin has (``corellm.components``, ``corellm.layers``,
``corellm.checkpoint.reader``, ``corellm.interfaces``): LayerNorm with biases, a parallel attention
and
MLP block, a GELU MLP, partial rotary embeddings, an optional per-head QK LayerNorm, and a biased
LM head. The plugin parses its own config.json (``PhiArchConfig``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from corellm import hookimpl
from corellm.components import ModelSpec
from corellm.checkpoint.reader import ConfigReader, ModelArchConfig, RopeConfig


@dataclass(frozen=True, kw_only=True)
class PhiArchConfig(ModelArchConfig):
    """``PhiConfig`` keys the model needs, besides the facts every model has."""

    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    partial_rotary_factor: float
    qk_layernorm: bool
    tie_word_embeddings: bool

    @classmethod
    def parse_fields(cls, r: ConfigReader) -> dict[str, Any]:
        rope = RopeConfig.read(r)
        return dict(
            super().parse_fields(r),
            intermediate_size=r.int("intermediate_size"),
            layer_norm_eps=r.float("layer_norm_eps", default=1e-5),
            hidden_act=r.str("hidden_act", default="gelu_new"),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            partial_rotary_factor=rope.partial_rotary_factor,
            qk_layernorm=r.bool("qk_layernorm", default=False),
            tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def max_len_limit(self) -> int | None:
        return RopeConfig.max_len_limit(self.max_position_embeddings, self.rope_scaling)


def _build(arch, ctx):
    from corellm_plugins.models_phi.model import build_model   # torch-heavy: import lazily
    return build_model(arch, ctx)


@hookimpl
def corellm_models() -> Iterator[ModelSpec]:
    yield ModelSpec(name="phi", architectures=("PhiForCausalLM",), factory=_build,
                    config_class=PhiArchConfig,
                    summary="Phi-1/1.5/2 decoder (LayerNorm, parallel attention and MLP, partial "
                            "rotary)")
