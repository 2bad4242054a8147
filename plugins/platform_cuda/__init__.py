"""The CUDA platform: NVIDIA GPUs through torch's CUDA runtime, one device per rank, NCCL between
ranks.

Everything CUDA-specific lives here: the device of each rank and its free memory; the KV cache
sized from a profiling forward at the largest step (``gpu_memory_utilization``, vLLM's name and
meaning); and a step runner (``CudaStepper``) whose inputs go through one persistent pinned
buffer, copied to the device once per step without a host synchronisation, whose sampled ids come
back in one device-to-host copy, and which replays CUDA graphs captured for decode-only batches
(padded to the nearest captured size) where the attention backend's metadata builder allows it.

The code that needs a GPU is ``platform.py``; the host-side logic around it (capture sizes,
padding, staging buffers, the memory arithmetic) is in ``graphs.py``, ``staging.py`` and
``memory.py`` and is tested on any machine; ``probe.py`` answers whether a GPU is there.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field, field_validator

from corellm import hookimpl
from corellm.components import PlatformOptions, PlatformSpec


class CudaOptions(PlatformOptions):
    name: str = "cuda"
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description=(
            "Fraction of each GPU's total memory this engine may use (vLLM's option): the "
            "weights, the activations of the largest step and the KV cache, which gets what "
            "the other two leave of it, measured by a profiling forward at start-up (used when "
            "kv_cache sets neither num_blocks nor memory_gib). Memory other processes held "
            "before the engine started does not count against it, but must leave room."))
    cuda_graphs: bool = Field(
        True, description=(
            "Capture the model's forward of decode-only steps as CUDA graphs at start-up, one "
            "per batch size of cuda_graph_batch_sizes, and replay them (a batch padded to the "
            "nearest captured size): one launch per step instead of one per kernel. Only with "
            "an attention backend whose metadata builder declares cuda_graphs (triton); "
            "steps with prefills, and larger batches, run eagerly."))
    triton_ops: bool = Field(
        False, description=(
            "Run RMSNorm, SiLU-and-multiply and RoPE as one Triton kernel each "
            "(corellm_plugins.platform_cuda.ops) instead of the reference's several torch "
            "kernels per call. Checked against the reference under Triton's interpreter; off "
            "until measured on a GPU."))
    cuda_graph_batch_sizes: list[int] | None = Field(
        None, description=(
            "Decode batch sizes to capture, increasing. Left out: 1, 2, 4, 8, then multiples of "
            "8 up to scheduler.max_num_seqs (and max_num_seqs itself). Sizes above "
            "max_num_seqs are never used and are skipped."))

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _batch_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is None:
            return None
        if not sizes:
            raise ValueError("must list at least one batch size (cuda_graphs: false captures "
                             "none)")
        if any(s < 1 for s in sizes):
            raise ValueError("batch sizes must be positive")
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError("batch sizes must be strictly increasing")
        return sizes


def availability() -> str | None:
    """Why no CUDA device can be used here (torch without CUDA, no device visible), or None.
    It may import torch (a CPU build is recognized from its files), so it is asked lazily
    (``platform: auto``, ``corellm plugins``), never at discovery."""
    from corellm_plugins.platform_cuda.probe import cuda_problem
    return cuda_problem()


def _make(options: CudaOptions):
    from corellm_plugins.platform_cuda.platform import CudaPlatform
    return CudaPlatform(options)


@hookimpl
def corellm_platforms() -> Iterator[PlatformSpec]:
    yield PlatformSpec(name="cuda", factory=_make, options=CudaOptions,
                       availability=availability, auto_priority=20, default_block_size=16,
                       visible_devices_env="CUDA_VISIBLE_DEVICES",
                       summary="NVIDIA GPUs: one device per rank, NCCL, the KV cache sized by "
                               "gpu_memory_utilization, pinned step inputs, CUDA graphs for "
                               "decode steps.")
