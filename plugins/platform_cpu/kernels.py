"""The CPU platform's element-wise kernels (cpu_ops.c): RMSNorm, SiLU-and-multiply, RoPE and the
greedy argmax of float32 and bfloat16 tensors, one C pass each instead of a chain of torch ops
that each read and write the whole tensor and pay a dispatch: per decoder layer, 13 multiplies,
2 pows, 2 means, 4 adds, 2 subtractions, 2 rsqrts, 2 index lookups and 4 concatenations become 4
calls. Built on first use with the host's C compiler; without one, the torch ops run.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_OPS_SOURCE = Path(__file__).with_name("cpu_ops.c")
_OPS_FLAGS = ("-ffast-math", "-ffp-contract=off")


class CpuOps:
    """ctypes bindings of cpu_ops.c. Each method returns None for inputs it does not take (then
    the caller runs its torch code)."""

    DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._rms, self._silu, self._rope = {}, {}, {}
        for dtype, suffix in self.DTYPES.items():
            rms = self._rms[dtype] = getattr(lib, f"corellm_rms_norm_{suffix}")
            rms.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, f32]
            silu = self._silu[dtype] = getattr(lib, f"corellm_silu_and_mul_{suffix}")
            silu.argtypes = [ptr, ptr, i64, i64]
            rope = self._rope[dtype] = getattr(lib, f"corellm_rope_{suffix}")
            rope.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64,
                             i64]
            rope.restype = i32                  # -1: a position outside the tables
            for fn in (rms, silu):
                fn.restype = None
        self._argmax = lib.corellm_argmax_f32
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr]
        self._argmax.restype = None

    def float32_addresses(self) -> tuple[int, int]:
        """The addresses of the float32 RMSNorm and SiLU-and-multiply, for a library that
        runs them around its own work (the quantized kernels' fused calls)."""
        return tuple(ctypes.cast(fn, ctypes.c_void_p).value
                     for fn in (self._rms[torch.float32], self._silu[torch.float32]))

    @classmethod
    def _takes(cls, *xs: torch.Tensor) -> bool:
        """CPU tensors of one dtype the kernels have, unit-strided in the last dimension."""
        # Not for autograd: the kernels neither record a graph nor bump version counters.
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            return False
        return xs[0].dtype in cls.DTYPES and all(
            x.dtype == xs[0].dtype and x.device.type == "cpu" and x.stride(-1) == 1 for x in xs)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
        n = x.shape[-1]
        if not self._takes(x, weight) or weight.shape != (n,) or x.dim() not in (2, 3):
            return None
        inner, inner_stride = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, n)
        out = torch.empty(x.shape, dtype=x.dtype)
        rows = out.numel() // n if n else 0
        if rows:
            self._rms[x.dtype](x.data_ptr(), x.stride(0), inner_stride, inner,
                               weight.data_ptr(), out.data_ptr(), rows, n, eps)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self._takes(x) or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
            return None
        d = x.shape[1] // 2
        out = torch.empty((x.shape[0], d), dtype=x.dtype)
        if out.numel():
            self._silu[x.dtype](x.data_ptr(), out.data_ptr(), x.shape[0], d)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The index of each row's first maximum of a float32 [rows, n] CPU tensor (NaN counts
        as the maximum), as ``x.max(dim=-1).indices``: one pass, rows split over the threads
        (with weight packing on, torch's own ops run on one thread, so its reduction would read
        a step's whole [rows, vocab] logits on one core; figures in docs/platform-cpu.md, "Fused
        element-wise kernels"). None for other inputs."""
        if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.stride(1) != 1 or x.shape[1] == 0
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> bool:
        """Rotate q [T, H, D] and k [T, Hkv, D] in place; False (nothing done) when it does not
        take them."""
        if (not self._takes(q, k) or not self._takes(cos, sin) or cos.dtype != torch.float32
                or q.dim() != 3 or k.dim() != 3
                or not (cos.is_contiguous() and sin.is_contiguous())
                or cos.shape != sin.shape or 2 * cos.shape[1] != rotary_dim
                or q.shape[2] < rotary_dim or k.shape[2] < rotary_dim
                or positions.dtype != torch.int64 or positions.device.type != "cpu"
                or not positions.is_contiguous()
                or positions.numel() != q.shape[0] or k.shape[0] != q.shape[0]):
            return False
        # Positions outside the tables (the kernel checks them all first, rotating nothing):
        # torch's indexing raises (past the end) or wraps (negative); leave both to it.
        return not q.shape[0] or self._rope[q.dtype](
            q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0),
            k.stride(1), k.shape[1], positions.data_ptr(), q.shape[0], cos.data_ptr(),
            sin.data_ptr(), cos.shape[0], rotary_dim) == 0


_cpu_ops: list[CpuOps | None] = []


def cpu_ops() -> CpuOps | None:
    """The fused kernels, built on first use; None (logged once) when no C compiler can build
    them."""
    if not _cpu_ops:
        from corellm_plugins.platform_cpu.native import NativeBuildError, load_library
        try:
            _cpu_ops.append(CpuOps(load_library("corellm_cpu_ops", _OPS_SOURCE, _OPS_FLAGS)))
        except NativeBuildError as exc:
            logger.info("fused CPU element-wise kernels unavailable, using torch ops: %s", exc)
            _cpu_ops.append(None)
    return _cpu_ops[0]


_silu_faster: dict[torch.dtype, bool] = {}


def _silu_kernel_is_faster(ops: CpuOps, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the SiLU-and-multiply kernel beats torch's here for ``dtype`` (timed once per
    dtype, on one small input). It is the one kernel whose speed depends on the compiler: it
    needs a vectorized ``exp`` (GCC finds glibc's vector ``expf`` under -ffast-math), and with a
    scalar one it loses to torch, so it is timed here rather than assumed to win."""
    if dtype not in _silu_faster:
        from corellm.ops import REFERENCE_OPS
        x = torch.randn(64, 2 * 2048, generator=torch.Generator().manual_seed(0)).to(dtype)
        best = {}
        for name, fn in (("kernel", ops.silu_and_mul), ("torch", REFERENCE_OPS.silu_and_mul)):
            fn(x)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(4):
                    fn(x)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
        _silu_faster[dtype] = best["kernel"] < best["torch"]
        if not _silu_faster[dtype]:
            logger.info("the fused %s SiLU-and-multiply kernel is slower than torch's here (%.0f "
                        "vs %.0f us): SiLU-and-multiply keeps the torch code",
                        str(dtype).removeprefix("torch."), 250e3 * best["kernel"],
                        250e3 * best["torch"])
    return _silu_faster[dtype]
