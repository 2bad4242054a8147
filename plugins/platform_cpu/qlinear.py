"""The CPU platform's quantized linear layers (quant_gemm.c): a layer's ``qweight`` multiplied in
its blocks, one C call per part (which quantizes the activations for the GGUF formats).

The k-quants are read as the file lays them out; the 32-value formats (Q8_0, Q4_0, Q4_1) are
regrouped once, when a layer is planned, so that each run of 8 blocks has its scales together
(``corellm.quant``'s ``grouped`` layout: the same bytes, in place of the file's order).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from corellm.quant import GGUF_FORMATS, GROUPABLE, QuantizedWeight

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_gemm.c")
FORMAT_IDS = {name: i for i, name in enumerate(GGUF_FORMATS)}    # the C enum's order
_ACT_BLOCK = 32


class QuantKernels:
    """ctypes bindings of quant_gemm.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._q = lib.corellm_qlinear
        self._q.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr]
        self._q.restype = i32
        self._i8 = lib.corellm_i8gemm
        self._i8.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr]
        self._i8.restype = None

    def plan(self, q: QuantizedWeight) -> QuantLinear | None:
        """The per-layer calls for ``q`` (None if a part is in a format or place the kernels do
        not take). The 32-value formats' parts are put in the grouped layout the kernels read
        (``corellm.quant``; in place: the same bytes reordered, once)."""
        if any(not (t.data.device.type == "cpu" and t.data.is_contiguous()) for _, t in q.parts):
            return None
        q.parts = [(start, t.grouped() if t.qtype in GROUPABLE else t) for start, t in q.parts]
        calls = []
        for start, t in q.parts:
            if t.qtype == "int8":
                calls.append((self._i8, None, t.data.data_ptr(), t.scale.data_ptr(),
                               t.shape[0], start))
            elif t.qtype in FORMAT_IDS:
                calls.append((self._q, FORMAT_IDS[t.qtype], t.data.data_ptr(), None,
                              t.shape[0], start))
            else:
                return None
        return QuantLinear(q, calls)

    def linear(self, q: QuantizedWeight, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in float32 for x float32 [M, K]."""
        plan = self.plan(q)
        if plan is None:
            raise ValueError(f"the CPU kernels do not take {q}")
        return plan(x, bias)


class QuantLinear:
    """One layer's quantized matmul: a C call per part of its weight (the ``kernel`` the CPU
    platform's ``prepare`` gives a quantized layer; it holds the weight, whose memory the
    calls read)."""

    def __init__(self, q: QuantizedWeight, calls: list) -> None:
        self.qweight, self.calls, self.rows, self.cols = q, calls, q.rows, q.cols
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != self.cols:
            raise ValueError(f"input of {k} features for a weight of {self.cols}")
        y = torch.empty(m, self.rows, dtype=torch.float32)
        if m == 0:
            return y if bias is None else y + bias
        bias_ptr = 0
        if bias is not None:
            if self._bias is None or self._bias[0] is not bias:
                self._bias = (bias, bias.detach().to(torch.float32).contiguous())
            bias_ptr = self._bias[1].data_ptr()
        out, xp, ldx = y.data_ptr(), x.data_ptr(), x.stride(0)
        for fn, fmt, w, scale, n, start in self.calls:
            b = bias_ptr + 4 * start if bias_ptr else None
            if fmt is None:
                fn(w, scale, n, k, xp, ldx, m, out + 4 * start, self.rows, b)
            elif fn(fmt, w, n, k, xp, ldx, m, out + 4 * start, self.rows, b) != 0:
                raise ValueError(f"rows of {k} values are not whole blocks of this format")
        return y


# The build of a CPU without AVX2, F16C or VNNI (plain C), made here on purpose to test that path.
PORTABLE_FLAGS = ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f", "-mno-avxvnni")
_kernels: dict[bool, QuantKernels | None] = {}


def quant_kernels(portable: bool = False) -> QuantKernels | None:
    """The quantized GEMMs, built on first use for this CPU (``portable``: its plain-C path, as
    a CPU without AVX2 builds it); None (logged once) without a C compiler."""
    if portable not in _kernels:
        from corellm_plugins.platform_cpu.native import NativeBuildError, load_library
        name, flags = (("corellm_quant_gemm_portable", PORTABLE_FLAGS) if portable
                       else ("corellm_quant_gemm", ()))
        try:
            _kernels[portable] = QuantKernels(load_library(name, _SOURCE, flags))
        except NativeBuildError as exc:
            logger.info("quantized CPU kernels unavailable, dequantizing per call: %s", exc)
            _kernels[portable] = None
    return _kernels[portable]
