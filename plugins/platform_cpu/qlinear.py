"""The CPU platform's quantized linear layers (quant_gemm.c): a layer's ``qweight`` multiplied in
its blocks, one C call per part (which quantizes the activations for the GGUF formats).

Each GGUF part is reordered once, when its layer is planned (the same bytes, in place of the
file's order), with its rows ``interleaved`` by 8 (``corellm.quant``; a kernel multiplies 4
values of 8 rows at once); the rows past the last whole group of 8 are read one at a time, in
the file's layout or, for the 32-value formats, the ``grouped`` one.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from pathlib import Path

import torch

from corellm.quant import GGUF_FORMATS, INTERLEAVABLE, QuantizedTensor, QuantizedWeight
from corellm_plugins.platform_cpu.native import warm_ranges

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_gemm.c")
FORMAT_IDS = {name: i for i, name in enumerate(GGUF_FORMATS)}    # the C enum's order
INTERLEAVED = 16                                   # quant_gemm.c's X8: the format's flag
_ACT_BLOCK = 32


class QuantKernels:
    """ctypes bindings of quant_gemm.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._q = lib.corellm_qlinear
        self._q.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i32]
        self._q.restype = i32
        self._i8 = lib.corellm_i8gemm
        self._i8.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i32]
        self._i8.restype = None
        self._fused = lib.corellm_qlinear_fused
        self._fused.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr,
                                ctypes.c_float, i32, ptr, i32]
        self._fused.restype = i32
        self._neighbours = lib.corellm_qlinear_neighbours
        self._neighbours.argtypes = [ptr, ptr]
        self._neighbours.restype = None

    def use_neighbours(self, rms_norm: int, silu_and_mul: int) -> None:
        """Give the kernels the addresses of the platform's float32 RMSNorm and
        SiLU-and-multiply (cpu_ops.c), which :meth:`QuantLinear.fused` runs around a layer."""
        self._neighbours(rms_norm, silu_and_mul)

    def plan(self, q: QuantizedWeight) -> QuantLinear | None:
        """The per-layer calls for ``q`` (None if a part is in a format or place the kernels do
        not take). The parts are put in the layouts the kernels read (``_layout``; in place:
        the same bytes reordered, once)."""
        if any(not (t.data.device.type == "cpu" and t.data.is_contiguous()) for _, t in q.parts):
            return None
        q.parts = [(start, _layout(t)) for start, t in q.parts]
        calls = []
        for start, t in q.parts:
            if t.qtype == "int8":
                calls.append((self._i8, None, t.data.data_ptr(), t.scale.data_ptr(),
                               t.shape[0], start))
            elif t.qtype in FORMAT_IDS:
                fmt = FORMAT_IDS[t.qtype] | (INTERLEAVED if t.layout == "interleaved" else 0)
                calls.append((self._q, fmt, t.data.data_ptr(), None, t.shape[0], start))
            else:
                return None
        return QuantLinear(q, calls, self._fused)

    def linear(self, q: QuantizedWeight, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in float32 for x float32 [M, K]."""
        plan = self.plan(q)
        if plan is None:
            raise ValueError(f"the CPU kernels do not take {q}")
        return plan(x, bias)


def _layout(t: QuantizedTensor) -> QuantizedTensor:
    """A part in the layout the kernels read: interleaved where the format has that layout
    (the rows after its last whole group of 8 grouped, or as they are), else as it is."""
    return t.interleaved() if t.qtype in INTERLEAVABLE else t


class QuantLinear:
    """One layer's quantized matmul: a C call per part of its weight (the ``kernel`` the CPU
    platform's ``prepare`` gives a quantized layer; it holds the weight, whose memory the
    calls read)."""

    # The layer called last, whose successor is then known: each layer learns, on its first
    # call, the layer that follows it (decode steps repeat one order), and ends each call by
    # handing the thread pool the weights of the layers that follow, up to WARM_BYTES, which an
    # idle worker fetches into the caches while the host runs the code between the calls
    # (``corellm_pool_warm``): a decode step's weights mostly come from memory otherwise.
    # (Weak references: a layer keeps neither its successor nor the last layer called alive.)
    _last: weakref.ref | None = None
    WARM_RANGES, WARM_BYTES = 4, 4 << 20

    def __init__(self, q: QuantizedWeight, calls: list, fused=None) -> None:
        self.qweight, self.calls, self.rows, self.cols = q, calls, q.rows, q.cols
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.head = (calls[0][2], q.parts[0][1].nbytes)      # the first part's blocks
        self._ref = weakref.ref(self)
        self._next: weakref.ref | None = None                # the layer called after this one
        self.prefetch = True                                 # platform.weight_prefetch
        self._warm: tuple[ctypes.Array, int] | None = None   # what to fetch after this call
        # one GGUF-format part: the layer may run with its neighbours in one call (`fused`)
        self._fused = fused if len(calls) == 1 and calls[0][1] is not None else None

    @property
    def fusable(self) -> bool:
        return self._fused is not None

    def _bias_ptr(self, bias: torch.Tensor | None) -> int:
        if bias is None:
            return 0
        if self._bias is None or self._bias[0] is not bias:
            self._bias = (bias, bias.detach().to(torch.float32).contiguous())
        return self._bias[1].data_ptr()

    def fused(self, x: torch.Tensor, bias: torch.Tensor | None,
              norm: tuple[torch.Tensor, float] | None = None,
              silu_mul: bool = False) -> torch.Tensor:
        """``silu_and_mul(self(rms_norm(x)))`` in one C call, the norm (``(weight, eps)``,
        float32) and SiLU-and-multiply each optional: the platform's own kernels run inside it,
        so the result equals the three calls'. For a :attr:`fusable` layer, float32 x."""
        x, m, k = self._input(x)
        y = torch.empty(m, self.rows // 2 if silu_mul else self.rows, dtype=torch.float32)
        if m == 0:
            return y
        _, fmt, w, _, n, _ = self.calls[0]
        norm_ptr, eps = (0, 0.0) if norm is None else (norm[0].data_ptr(), norm[1])
        rc = self._fused(fmt, w, n, k, x.data_ptr(), x.stride(0), m, y.data_ptr(),
                         self._bias_ptr(bias), norm_ptr or None, eps, int(silu_mul),
                         *self._follow())
        if rc != 0:
            raise ValueError(f"rows of {k} values are not whole blocks of this format" if rc == -1
                             else "the fused call needs the platform's element-wise kernels")
        return y

    def _input(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        if k != self.cols:
            raise ValueError(f"input of {k} features for a weight of {self.cols}")
        return x, m, k

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x, m, k = self._input(x)
        y = torch.empty(m, self.rows, dtype=torch.float32)
        if m == 0:
            return y if bias is None else y + bias
        bias_ptr = self._bias_ptr(bias)
        out, xp, ldx = y.data_ptr(), x.data_ptr(), x.stride(0)
        warm, last = self._follow(), self.calls[-1]
        for call in self.calls:
            fn, fmt, w, scale, n, start = call
            b = bias_ptr + 4 * start if bias_ptr else None
            after = warm if call is last else (None, 0)
            if fmt is None:
                fn(w, scale, n, k, xp, ldx, m, out + 4 * start, self.rows, b, *after)
            elif fn(fmt, w, n, k, xp, ldx, m, out + 4 * start, self.rows, b, *after) != 0:
                raise ValueError(f"rows of {k} values are not whole blocks of this format")
        return y

    @property
    def next(self) -> QuantLinear | None:
        """The layer called after this one (learned from the first calls), if still alive."""
        return self._next() if self._next is not None else None

    def _follow(self) -> tuple[ctypes.Array | None, int]:
        """This call's place in the order of calls: tells the layer called before it that this
        one follows (once), and returns the ranges to fetch after this call (the layers that
        follow, once the order is known that far)."""
        prev = QuantLinear._last() if QuantLinear._last is not None else None
        if prev is not None and prev._next is None:
            prev._next = self._ref
        QuantLinear._last = self._ref
        if not self.prefetch:
            return (None, 0)
        if self._warm is None:
            ranges, total, layer = [], 0, self.next
            while layer is not None and len(ranges) < self.WARM_RANGES and total < self.WARM_BYTES:
                address, size = layer.head
                ranges.append((address, min(size, self.WARM_BYTES - total)))
                total += ranges[-1][1]
                layer = layer.next
            if not ranges:
                return (None, 0)
            flat = warm_ranges(ranges)
            if len(ranges) < self.WARM_RANGES and total < self.WARM_BYTES:
                return (flat, len(ranges))          # the order is not known that far yet
            self._warm = (flat, len(ranges))
        return self._warm


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
