"""Paged attention in Triton kernels: the fast path on NVIDIA GPUs (and other Triton targets)
with no CUDA C++ build, and the reference a third-party kernel plugin is measured against.

``attention: {name: auto}`` picks it on CUDA when ``triton`` is importable. ``triton`` is an
optional dependency (``pip install 'corellm[triton]'``; CUDA builds of torch bring it): without
it the backend is listed by ``corellm plugins`` as unavailable, with the reason. On the CPU it
runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests: it runs each kernel
program in Python on numpy arrays, far too slow to serve with)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from pydantic import Field, field_validator

from corellm import hookimpl
from corellm.components import AttentionBackendSpec, AttentionOptions, BuildContext


def _power_of_two(name: str, value: int, low: int, high: int) -> int:
    if value < low or value > high or value & (value - 1):
        raise ValueError(f"must be a power of two in {low}..{high}")
    return value


class TritonAttentionOptions(AttentionOptions):
    name: str = "triton"
    block_m: int = Field(64, description="Query rows per program of a prefill (query tokens x "
                                         "the query heads of one KV head); a power of two in "
                                         "16..256.")
    block_n: int = Field(32, description="Keys per tile of the inner loop; a power of two in "
                                         "16..256.")
    split_kv_min_len: int = Field(1024, ge=16, description="Decodes whose longest context "
                                  "has at least this many tokens take the split-KV "
                                  "(flash-decoding) path, when they are few (split_kv_max_batch).")
    split_kv_max_batch: int = Field(32, ge=0, description="Most decodes in a step for the "
                                    "split-KV path (0 disables it).")
    max_kv_splits: int = Field(16, ge=2, le=128, description="Most key ranges one decode is "
                               "split into.")
    num_warps: int = Field(4, description="Warps per program: 1, 2, 4, 8 or 16.")
    num_stages: int = Field(2, ge=1, le=8, description="Software-pipelining stages of the key "
                            "loop.")

    @field_validator("block_m")
    @classmethod
    def _block_m(cls, v: int) -> int:
        return _power_of_two("block_m", v, 16, 256)

    @field_validator("block_n")
    @classmethod
    def _block_n(cls, v: int) -> int:
        return _power_of_two("block_n", v, 16, 256)

    @field_validator("num_warps")
    @classmethod
    def _num_warps(cls, v: int) -> int:
        return _power_of_two("num_warps", v, 1, 16)


def _unavailable() -> str | None:
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):      # a broken or deliberately hidden package
        found = False
    if not found:
        return ("needs the optional dependency 'triton' (pip install 'corellm[triton]'; CUDA "
                "builds of torch include it)")
    return None


def _check_device(device) -> str | None:
    from corellm_plugins.attn_triton.backend import device_problem
    return device_problem(device)


def _make(options: TritonAttentionOptions, ctx: BuildContext):
    from corellm_plugins.attn_triton.backend import TritonAttentionBackend
    return TritonAttentionBackend(options)


@hookimpl
def corellm_attention_backends() -> Iterator[AttentionBackendSpec]:
    yield AttentionBackendSpec(
        name="triton", factory=_make, options=TritonAttentionOptions,
        check_device=_check_device, auto_priority=20, auto_device_types=("cuda",),
        unavailable=_unavailable(),
        summary="Paged attention in Triton kernels, reading KV blocks in place (CUDA; "
                "sliding windows, soft-capping, split-KV decode).")
