"""The CUDA platform: NVIDIA GPUs through torch's CUDA runtime, NCCL between ranks.

Everything CUDA-specific lives here: the device of each rank, its free memory, the KV cache sized
from a profiling forward (``gpu_memory_utilization``, vLLM's name and meaning), and a step runner
whose inputs stay in persistent pinned buffers, copied to the device once per step without a host
synchronisation, with one device-to-host copy of the sampled ids.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field

from corellm import hookimpl
from corellm.components import PlatformOptions, PlatformSpec


class CudaOptions(PlatformOptions):
    name: str = "cuda"
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description=(
            "Fraction of each GPU's total memory this engine may use: weights, activations and "
            "the KV cache, which gets what the weights and a profiling forward at the largest "
            "step leave of it (used when kv_cache sets neither num_blocks nor memory_gib)."))


def availability() -> str | None:
    """Why no CUDA device can be used here (torch without CUDA, no device visible), or None:
    asked lazily (``platform: auto``, ``corellm plugins``), so discovery imports no torch."""
    from corellm_plugins.platform_cuda.probe import cuda_problem
    return cuda_problem()


def _make(options: CudaOptions):
    from corellm_plugins.platform_cuda.platform import CudaPlatform
    return CudaPlatform(options)


@hookimpl
def corellm_platforms() -> Iterator[PlatformSpec]:
    yield PlatformSpec(name="cuda", factory=_make, options=CudaOptions,
                       availability=availability, auto_priority=20,
                       summary="NVIDIA GPUs: one device per rank, NCCL, the KV cache sized by "
                               "gpu_memory_utilization, pinned step inputs.")
