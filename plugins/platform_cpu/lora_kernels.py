"""The CPU platform's multi-LoRA products (lora.c): each token's shrink and expand with its own
adapter's weights, on the platform's thread pool. Built on first use; without a C compiler the
torch reference runs (``DeviceOps.lora_linear``)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("lora.c")


class LoRAKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._f32 = lib.corellm_lora_f32
        self._f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr,
                              ptr, i64]
        self._f32.restype = None

    @staticmethod
    def _layer_args(lora: Any) -> tuple:
        """The layer's constant arguments (B's addresses, the parts' columns), made once and
        kept on the ``LoRALayer`` (its ``kernel``)."""
        args = lora.kernel
        if args is None:
            parts = len(lora.b)
            b = (ctypes.c_void_p * parts)(*(t.data_ptr() for t in lora.b))
            off = (ctypes.c_int64 * parts)(*(o for o, _ in lora.spans))
            n = (ctypes.c_int64 * parts)(*(w for _, w in lora.spans))
            args = lora.kernel = (b, off, n)
        return args

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora: Any, order: torch.Tensor,
              slots: torch.Tensor) -> bool:
        """``y`` += the products of the tokens ``order`` (grouped by slot, each with a slot) in
        place; False (nothing done) for inputs the kernel does not take."""
        a = lora.a
        if not (x.dtype == y.dtype == a.dtype == torch.float32 and x.dim() == y.dim() == 2
                and x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous()
                and all(t.is_contiguous() for t in lora.b)):
            return False
        slots_n, parts, rank, k = a.shape
        b, off, n = self._layer_args(lora)
        self._f32(x.data_ptr(), x.stride(0), k, order.data_ptr(), order.shape[0],
                  slots.data_ptr(), a.data_ptr(), parts, slots_n, rank, b, off, n, y.data_ptr(),
                  y.stride(0))
        return True


_kernels: list[LoRAKernels | None] = []


def lora_kernels() -> LoRAKernels | None:
    """The kernels, built on first use; None (logged once) without a C compiler."""
    if not _kernels:
        from corellm_plugins.platform_cpu.native import NativeBuildError, load_library
        try:
            _kernels.append(LoRAKernels(load_library("corellm_lora", _SOURCE)))
        except NativeBuildError as exc:
            logger.info("multi-LoRA CPU kernels unavailable, using torch: %s", exc)
            _kernels.append(None)
    return _kernels[0]
