"""The CPU platform: models on the host's cores, with corellm's C kernels for this CPU.

Everything CPU-specific lives here: the GEMM path of each weight shape, measured at start-up and
cached per machine (plain, MKL packed, oneDNN prepacked, corellm's own register-blocked kernel);
RMSNorm and SiLU-and-multiply fused into that GEMM; the element-wise C kernels (RMSNorm,
SiLU-and-multiply, RoPE, greedy argmax); the allocator tuning and huge-page weight buffers; and
the C toolchain (``Platform.native_library``) other plugins build their CPU kernels with, its
shared headers (``csrc/``) on their include path.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field

from corellm import hookimpl
from corellm.components import PlatformOptions, PlatformSpec


class CpuOptions(PlatformOptions):
    name: str = "cpu"
    weight_packing: bool = Field(
        True, description="Run each fp32 or bf16 linear layer through the GEMM path measured "
                          "fastest for its shape and batch size (plain, MKL packed, oneDNN "
                          "prepacked, corellm's own kernel; cached per machine), keeping a "
                          "weight copy per packed path used.")
    fused_ops: bool = Field(
        True, description="Run RMSNorm, SiLU-and-multiply and rotary embeddings of float32 and "
                          "bfloat16 models as one C kernel each (built on first use; without a C "
                          "compiler, the torch ops), RMSNorm and SiLU inside the GEMM of layers "
                          "planned on corellm's kernel, and greedy sampling's argmax as one "
                          "native pass.")
    weight_prefetch: bool = Field(
        False, description="While the host runs the code between a decode step's quantized "
                           "layers, one idle thread of the pool fetches the weights of the "
                           "layers that follow (up to 4 MiB ahead, in the order the layers ran) "
                           "into the caches, so the next GEMV reads fewer of them from memory. "
                           "Needs 2 or more threads. Off by default: with cpu_graphs the time "
                           "between layers is too short for it to pay.")
    cpu_graphs: bool = Field(
        True, description="Record a decode-only step of up to cpu_graph_max_rows rows once, as "
                          "the kernel calls and torch operations it made, and replay them for "
                          "later steps of that many rows without the Python around them (the "
                          "CPU analogue of CUDA graphs; a recording is used once its first "
                          "replay matched an eager step bit for bit). Needs an attention "
                          "backend whose metadata builder is replayable.")
    cpu_graph_max_rows: int = Field(
        8, ge=1, le=1024,
        description="The largest decode batch (rows) recorded by cpu_graphs; each recorded "
                    "size keeps its intermediate tensors (about 1 MB per row for a 135M-"
                    "parameter model). Larger batches run eagerly, where the kernels dominate.")


def _make(options: CpuOptions):
    from corellm_plugins.platform_cpu.platform import CpuPlatform
    return CpuPlatform(options)


@hookimpl
def corellm_platforms() -> Iterator[PlatformSpec]:
    yield PlatformSpec(name="cpu", factory=_make, options=CpuOptions, auto_priority=10,
                       default_block_size=128,
                       summary="The host's CPU cores: GEMM paths measured per shape, fused C "
                               "kernels, gloo for tensor parallelism.")
