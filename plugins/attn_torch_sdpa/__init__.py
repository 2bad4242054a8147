"""Paged attention on ``torch.nn.functional.scaled_dot_product_attention``: runs anywhere torch
runs (CPU included). Decodes are batched into one SDPA call per layer over K/V gathered from the
block table; each prefill (whole, chunked, or resumed after preemption) is one SDPA call."""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import AttentionBackendSpec, AttentionOptions, BuildContext


def _make(options: AttentionOptions, ctx: BuildContext):
    from corellm_plugins.attn_torch_sdpa.backend import TorchSDPABackend
    return TorchSDPABackend()


@hookimpl
def corellm_attention_backends() -> Iterator[AttentionBackendSpec]:
    yield AttentionBackendSpec(name="torch_sdpa", factory=_make, auto_priority=10,
                               summary="Paged KV cache + torch SDPA (any device; sliding "
                                       "windows as masks).")
