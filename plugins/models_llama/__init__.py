"""Llama-family decoders: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (QK norm)."""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import ModelSpec


def _factory(variant: str):
    def build(arch, ctx):
        from corellm_plugins.models_llama.model import build_model  # torch-heavy: import lazily
        return build_model(arch, ctx, variant)
    return build


@hookimpl
def corellm_models() -> Iterator[ModelSpec]:
    yield ModelSpec(name="llama", architectures=("LlamaForCausalLM",), factory=_factory("llama"),
                    summary="Llama 2/3 decoder (grouped-query attention, RoPE incl. llama3 scaling)")
    yield ModelSpec(name="mistral", architectures=("MistralForCausalLM",),
                    factory=_factory("llama"), summary="Mistral decoder (full attention)")
    yield ModelSpec(name="qwen2", architectures=("Qwen2ForCausalLM",), factory=_factory("qwen2"),
                    summary="Qwen2 / Qwen2.5 decoder (QKV bias)")
    yield ModelSpec(name="qwen3", architectures=("Qwen3ForCausalLM",), factory=_factory("qwen3"),
                    summary="Qwen3 dense decoder (per-head QK RMSNorm)")
