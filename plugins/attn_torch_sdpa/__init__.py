"""Paged attention on ``torch.nn.functional.scaled_dot_product_attention``: runs anywhere torch
runs (CPU included). Each prefill (whole, chunked, or resumed after preemption) is one SDPA call,
and decodes are batched into one SDPA call per group of similar lengths over K/V gathered from
the block table. On the CPU (float32/bfloat16, with a C compiler at first use) C kernels take
over, built by the platform (``Platform.native_library``: the CPU platform compiles them with its
shared headers): decodes read the cached K/V blocks in place, and a step's prefills run in one
call on the CPU platform's GEMM micro-kernel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from corellm import hookimpl
from corellm.components import AttentionBackendSpec, AttentionOptions, BuildContext


class SDPAOptions(AttentionOptions):
    name: str = "torch_sdpa"
    decode: Literal["auto", "native", "gather"] = Field(
        "auto", description="Decode path: 'native' reads KV blocks in place with a C kernel "
        "(CPU, float32/bfloat16; needs a C compiler at first use), 'gather' copies them out "
        "for one SDPA call per group; 'auto' takes native where it can run, else gather.")
    prefill: Literal["auto", "native", "sdpa"] = Field(
        "auto", description="Prefill path: 'native' runs all of a step's prefills in one call "
        "of a C kernel on the CPU platform's GEMM micro-kernel, over their K/V in the cache (CPU, "
        "float32/bfloat16; needs a C compiler at first use), 'sdpa' one SDPA call per prefill; "
        "'auto' takes native where it can run, else sdpa.")


def _make(options: SDPAOptions, ctx: BuildContext):
    from corellm_plugins.attn_torch_sdpa.backend import TorchSDPABackend
    return TorchSDPABackend(options.decode, ctx.device, ctx.dtype, options.prefill,
                            ctx.platform)


@hookimpl
def corellm_attention_backends() -> Iterator[AttentionBackendSpec]:
    yield AttentionBackendSpec(name="torch_sdpa", factory=_make, options=SDPAOptions,
                               auto_priority=10,
                               summary="Paged KV cache + torch SDPA (any device; sliding "
                                       "windows as masks); native decode and prefill kernels "
                                       "on the CPU.")
