"""CPU-specific tuning for workers: the allocator, and packed GEMM weights.

glibc serves large allocations with mmap and returns freed memory to the OS (the mmap and trim
thresholds), so the big temporaries of every forward pass (activations, logits, gathered KV) are
page-faulted in afresh each step: zeroing the pages cost more than the matmuls that use them
(a [2048, 4096] fp32 linear ran at 210 GFLOP/s before and 328 after, see docs/benchmarks.md).
Raising both thresholds keeps freed memory in the heap for reuse, as the tcmalloc/jemalloc
preloads that CPU inference servers recommend do. Resident memory then stays at its peak.

The setting is process-wide, so a library must not impose it on the program that embeds it:
``CORELLM_MALLOC_TUNING=1`` turns it on, and the ``corellm`` command sets that default for the
processes it owns (``CORELLM_MALLOC_TUNING=0`` keeps it off there too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_applied = False


def tune_malloc() -> bool:
    """Keep freed large blocks in the glibc heap, if ``CORELLM_MALLOC_TUNING=1``. Returns whether
    the tuning was requested and is in effect."""
    global _applied
    if not sys.platform.startswith("linux") or os.environ.get("CORELLM_MALLOC_TUNING") != "1":
        return False
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):      # not glibc (e.g. musl): nothing to tune
        return False
    ok = (mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
          and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
          and mallopt(_M_TOP_PAD, 1 << 28) == 1)
    if not ok:
        logger.debug("mallopt rejected the CPU allocator tuning")
    _applied = ok
    return ok


# Row counts up to this use the packed weight; larger (prefill-sized) batches run as fast or
# faster through the plain GEMM (measured: packed 316 vs 231 GFLOP/s at 64 rows, 281 vs 317 at
# 2048 rows, for a 4096x768 fp32 weight on this project's 2-core CPU).
_PACKED_MAX_ROWS = 512
_PACK_HINT_ROWS = 64


def _mkl_packing_available() -> bool:
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every fp32 linear layer on the CPU (``nn.Linear``, and the layers of
    ``corellm.layers.linear``, whose ``linear`` method is their one matmul) a copy of its weight
    in MKL's packed GEMM layout, used for small batches (decode steps), where it is 1.3-2x
    faster. Costs about twice the weights' memory again. Returns how many layers were packed (0
    when MKL is unavailable)."""
    if not _mkl_packing_available():
        return 0
    from corellm.layers.linear import LinearBase, ParallelLMHead
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.dim() == 2):
            continue
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_packed_forward, module)
        elif isinstance(module, (LinearBase, ParallelLMHead)):
            module.linear = types.MethodType(_packed_linear, module)
        else:
            continue
        module.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(),
                                                                        _PACK_HINT_ROWS)
        packed += 1
    return packed


def _packed_linear(self: torch.nn.Module, x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > _PACKED_MAX_ROWS or x.dim() != 2:
        return F.linear(x, self.weight, bias)
    return torch.ops.mkl._mkl_linear(x, self.packed_weight, self.weight, bias, rows)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _packed_linear(self, x, self.bias)
