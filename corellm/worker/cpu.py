"""CPU-specific tuning for workers: the allocator, and the GEMM path of each weight shape.

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

import bisect
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import platform
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

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


_HUGE_PAGE = 2 << 20


def zeroed_cpu_tensor(shape: tuple[int, ...] | int, dtype: torch.dtype,
                      huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on its own anonymous memory mapping, for big long-lived buffers
    (the KV pool, packed weights). The kernel zero-fills pages on first touch, so a large pool
    costs nothing at start-up (torch.zeros writes every page: 0.6 s per GiB on a 2-core CPU) and
    only the pages ever used take memory.

    ``huge_pages`` (Linux): the mapping is 2 MiB-aligned and asks for transparent huge pages
    (``MADV_HUGEPAGE``, honoured where THP is ``always`` or ``madvise``), for data streamed
    from memory in full at every step: packed weights. Their TLB misses drop 512-fold, and on
    an AMD EPYC (AVX-512) the native GEMM over cold 4096x768 / 768x2048 / 32000x768 fp32
    weights ran 2-4% faster at 40-64 rows, 5-11% at 16-24 and 4-29% at 1-8
    (docs/benchmarks.md). The KV pool does not ask: measured end to end, no gain there."""
    import mmap

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    huge = huge_pages and nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    buf = mmap.mmap(-1, nbytes + (_HUGE_PAGE if huge else 0),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if huge:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        offset = -address % _HUGE_PAGE
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % _HUGE_PAGE)
        except OSError:                 # THP off in this kernel: 4 KiB pages, still zeroed
            pass
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)


# --------------------------------------------------------------------------- GEMM paths
# Which library runs a small fp32 matmul fastest depends on the CPU, not on its vendor string:
# on an Intel Xeon with AMX, MKL's packed GEMM was 1.3-2x the plain one for decode batches; on an
# AMD EPYC (AVX2) oneDNN's prepacked linear is 1.3-2x MKL's packed path from 16 to 256 rows
# (docs/benchmarks.md). So each weight shape gets a plan, measured at start-up: one preferred
# path, and for a row bucket where another is clearly faster, that one.
#   dense   F.linear on the weight as loaded
#   mkl     torch.ops.mkl._mkl_linear on a copy in MKL's packed layout (fp32)
#   onednn  torch.ops.mkldnn._linear_pointwise on a copy in oneDNN's blocked layout (fp32, and
#           bf16 where the CPU has oneDNN's bf16 kernels: AVX-512 or AVX-NE-CONVERT)
#   native  corellm's own register-blocked kernel (cpu_gemm.c, built on first use) on a copy
#           packed in panels of two vector widths, fp32 or bf16 (widened to fp32 as it is read);
#           on an AMD EPYC (AVX2) fp32 was 1.2-1.9x oneDNN from 1 to 64 rows and 1.1-1.2x at
#           256-2048, and bf16 2-7x upcast (docs/benchmarks.md)
#   upcast  bf16 weights only: input and weight converted to fp32 for each call, fp32 GEMM,
#           output rounded to bf16 (no copy kept). Without native bf16 dot products (AVX2),
#           torch's bf16 GEMM ran at 18-20 GFLOP/s at every batch size, and this at 57-94 at 64
#           rows; half the weight bytes still win at one row. So it is measured, per bucket.
# A plan is cached per process and on disk (keyed by CPU, torch, threads, shape and the
# measuring method's version), so only the first start on a machine pays the measurement.
# A shared machine has slow phases (every path at half speed for a while), and a plan measured
# in one can rank paths wrongly: each cached plan records the machine's speed when it was
# measured (a small calibration matmul), and is measured again when the machine is now clearly
# faster than it was then.
_PLAN_VERSION = 5
_CALIBRATION = (512, 512, 512)          # m, k, n of the calibration matmul (~2-5 ms)
_STALE_SPEEDUP = 1.3                    # re-measure a plan made when the machine was this slower
_PROBE_ROWS = (1, 4, 16, 64, 256)      # a bucket is (previous probe, probe]; larger -> last
_PROBE_MAX_FLOP = 2e9                  # larger probes of big shapes are skipped (start-up time)
_PROBE_COLD_BYTES = 32 << 20           # weight copies per probe: more than a CPU's cache holds
_PROBE_MAX_COPIES = 16
_PROBE_RUN_FLOP = 1e8                  # a timed run is this much work (~1 ms) ...
_PROBE_RUN_BYTES = 16 << 20            # ... or reads this much weight, whichever comes first,
_PROBE_MAX_CALLS = 16                  # ... in at most this many calls
_PROBE_ROUNDS = 5
_SWITCH_MARGIN = 1.10                  # another path must be this much faster to be used
_PACK_HINT_ROWS = 64
_plans: dict[str, GemmPlan] = {}
_speed: list[float] = []


def available_gemm_paths(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The GEMM paths for weights of ``dtype`` on this machine (``("dense",)``: nothing to
    plan)."""
    if dtype == torch.bfloat16:
        paths = ["dense", "onednn", "upcast"] if _onednn_takes_bf16() else ["dense", "upcast"]
        if native_gemm() is not None:
            paths.append("native")
        return tuple(paths)
    if dtype != torch.float32:
        return ("dense",)
    paths = ["dense"]
    try:
        if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
            paths.append("mkl")
    except (AttributeError, RuntimeError):
        pass
    try:
        if (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            paths.append("onednn")
    except (AttributeError, RuntimeError):
        pass
    if native_gemm() is not None:
        paths.append("native")
    return tuple(paths)


_bf16_onednn: list[bool] = []


def _onednn_takes_bf16() -> bool:
    """Whether oneDNN packs bf16 weights here (it refuses on CPUs without its bf16 kernels)."""
    if not _bf16_onednn:
        try:
            w = torch.zeros(8, 8, dtype=torch.bfloat16)
            torch.ops.mkldnn._linear_pointwise(
                torch.zeros(1, 8, dtype=torch.bfloat16),
                torch.ops.mkldnn._reorder_linear_weight(w, 1), None, "none", [], "")
            _bf16_onednn.append(True)
        except (AttributeError, RuntimeError):
            _bf16_onednn.append(False)
    return _bf16_onednn[0]


def _pack(path: str, weight: torch.Tensor) -> torch.Tensor | None:
    if path == "native":
        return native_gemm().pack(weight)
    if path == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_HINT_ROWS)
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
    return None


def _run(path: str, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
         bias: torch.Tensor | None) -> torch.Tensor:
    if path == "mkl":
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    if path == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if path == "native":
        out = native_gemm().linear(x, packed, weight.shape[0], bias, k=weight.shape[1])
        return out if out is not None else F.linear(x, weight, bias)
    if path == "upcast":
        return F.linear(x.float(), weight.float(),
                        None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


class NativeGemm:
    """ctypes bindings of cpu_gemm.c: ``x @ W^T + bias`` in fp32 on W packed in panels, for fp32
    or bf16 weights. A bf16 layer's output is rounded to bf16; its input meets the weights in
    bf16 dot products where the CPU has them (``bf16_dot``: AVX512-BF16), else it is widened
    to fp32 (exactly, as the weights are)."""

    _DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._gemm, self._pack, self._silu_mul = {}, {}, {}
        for dtype, suffix in zip(self._DTYPES, ("f32", "bf16")):
            for table, name in ((self._gemm, "gemm"), (self._silu_mul, "gemm_silu_mul")):
                gemm = table[dtype] = getattr(lib, f"corellm_{name}_{suffix}")
                gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, f32, i32]
                gemm.restype = i32
            pack = self._pack[dtype] = getattr(lib, f"corellm_gemm_pack_{suffix}")
            pack.argtypes = [ptr, i64, i64, i64, ptr, i32]
            pack.restype = None
        self._sizes = {torch.float32: lib.corellm_gemm_packed_size,
                       torch.bfloat16: lib.corellm_gemm_packed_size_bf16}
        for size in self._sizes.values():
            size.argtypes = [i64, i64]
            size.restype = i64
        self._size_cache: dict[tuple[torch.dtype, int, int], int] = {}
        self.panel = int(lib.corellm_gemm_nr())
        # rows per tile for calls of up to 64 rows: 8 with AVX-512, 6 with AVX2 (6 above 64)
        self.tile_rows = int(lib.corellm_gemm_mr())
        self.bf16_dot = bool(lib.corellm_gemm_bf16_dot())

    def _packed_size(self, dtype: torch.dtype, n: int, k: int) -> int:
        """Elements of the packed copy of an [n, k] weight (a ctypes call the first time per
        shape; each GEMM call checks its weight against it)."""
        key = (dtype, n, k)
        size = self._size_cache.get(key)
        if size is None:
            size = self._size_cache[key] = int(self._sizes[dtype](n, k))
        return size

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of an fp32 or bf16 [out, in] weight (rows may be strided)."""
        if (weight.dtype not in self._DTYPES or weight.dim() != 2 or weight.stride(1) != 1
                or weight.device.type != "cpu"):
            raise ValueError(f"native GEMM packs fp32 or bf16 [out, in] CPU weights with "
                             f"contiguous rows, not {weight.dtype} {tuple(weight.shape)} "
                             f"strides {weight.stride()} on {weight.device}")
        n, k = weight.shape
        out = zeroed_cpu_tensor(self._packed_size(weight.dtype, n, k), weight.dtype,
                                huge_pages=True)
        self._pack[weight.dtype](weight.data_ptr(), weight.stride(0), n, k, out.data_ptr(),
                                 torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None, k: int | None = None,
               norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """``x [m, k] @ W^T + bias`` for W [n, k] packed by :meth:`pack`, in the weight's dtype;
        None for inputs it does not take (autograd, a dtype or device other than the weight's,
        a bias that is not n contiguous values of that dtype). The packed copy has no autograd
        history: callers whose weight requires grad must take ``F.linear`` instead. ``k``: the
        weight's in-features, checked against x's; without it only the packed size checks x
        (which cannot tell k from k + 1 for bf16 weights packed in pairs of k).
        ``norm``: (weight, eps) of an RMSNorm layer between x and this one (``corellm.layers.
        RMSNorm``'s arithmetic, the weight k values of the weights' dtype): the threads
        normalize the rows (split between them) into a scratch of this call, then multiply it
        (None for a norm weight it does not take)."""
        return self._call(self._gemm, x, packed, n, n, bias, k, norm)

    def linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                        bias: torch.Tensor | None, k: int | None = None,
                        norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """``silu(g) * u`` for ``[g | u] = x @ W^T + bias`` (W = [gate; up], [n, k]), [m, n / 2],
        without writing the [m, n] product: each pair of gate and up tiles is multiplied in
        cache (the same values as :meth:`linear` followed by the fused SiLU-and-multiply, the
        exp aside: its polynomial is within about 2 ulp of glibc's; like that kernel, exp's
        argument is clamped to [-87.3, 88], so a gate below -88 gives a tiny negative value
        where torch gives -0, and a gate of -inf gives -inf times u). None for what
        :meth:`linear` does not take, and unless n / 2 is a multiple of :attr:`panel`."""
        if n % (2 * self.panel):
            return None
        return self._call(self._silu_mul, x, packed, n, n // 2, bias, k, norm)

    def _call(self, fns: dict, x: torch.Tensor, packed: torch.Tensor, n: int, width: int,
              bias: torch.Tensor | None, k: int | None,
              norm: tuple[torch.Tensor, float] | None) -> torch.Tensor | None:
        dtype = packed.dtype
        if (x.dim() != 2 or x.dtype != dtype or x.device.type != "cpu"
                or dtype not in self._DTYPES or (k is not None and x.shape[1] != k)
                or (torch.is_grad_enabled() and (x.requires_grad
                                                 or (bias is not None and bias.requires_grad)))
                or packed.numel() != self._packed_size(dtype, n, x.shape[1])):
            return None
        if bias is not None and (bias.dtype != dtype or bias.shape != (n,)
                                 or not bias.is_contiguous()):
            return None
        norm_w, eps = norm if norm is not None else (None, 0.0)
        if norm_w is not None and (norm_w.dtype != dtype or norm_w.shape != (x.shape[1],)
                                   or not norm_w.is_contiguous() or norm_w.device.type != "cpu"
                                   or (torch.is_grad_enabled() and norm_w.requires_grad)):
            return None
        if dtype != torch.float32:            # fp32 bias; fp32 rows unless bf16 dot products
            x = x if self.bf16_dot else x.float()       # (.float() keeps x's strides)
            bias = None if bias is None else bias.float()
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        m, k = x.shape
        out = torch.empty((m, width), dtype=dtype)      # bf16: rounded once by the kernel
        if m and n:
            if k == 0:
                y = (torch.zeros((m, n), dtype=dtype) if bias is None
                     else bias.to(dtype).expand(m, n).clone())
                out.copy_(y if width == n else F.silu(y[:, :width]) * y[:, width:])
            elif fns[dtype](x.data_ptr(), x.stride(0), packed.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(), width,
                            m, n, k, None if norm_w is None else norm_w.data_ptr(), eps,
                            torch.get_num_threads()):
                raise MemoryError(f"native GEMM: no scratch for a {dtype} weight of {n}x{k}")
        return out


_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
_GEMM_FLAGS = ("-ffp-contract=fast",)
_native_gemm: list[NativeGemm | None] = []


def native_gemm() -> NativeGemm | None:
    """corellm's own fp32 GEMM, built on first use; None (logged once) when no C compiler can
    build it (then plans choose among the libraries' paths)."""
    if not _native_gemm:
        from corellm.native import NativeBuildError, load_library
        try:
            _native_gemm.append(NativeGemm(load_library("corellm_gemm", _GEMM_SOURCE,
                                                        _GEMM_FLAGS)))
        except NativeBuildError as exc:
            logger.info("corellm's native GEMM unavailable, planning the libraries' paths: %s",
                        exc)
            _native_gemm.append(None)
    return _native_gemm[0]


@dataclass(frozen=True)
class GemmPlan:
    """The path for each row bucket of one weight shape: rows <= ``bounds[i]`` (and above the
    previous bound) take ``paths[i]``; more rows than the last bound take the last path.
    ``gflops``: what was measured, per probe and path (for the log and the benchmark)."""

    shape: tuple[int, int]
    bounds: tuple[int, ...]
    paths: tuple[str, ...]
    gflops: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)
    machine_gflops: float = field(default=0.0, compare=False)   # calibration when measured
    dtype: str = "float32"                                        # of the weights

    def path_for(self, rows: int) -> str:
        return self.paths[min(bisect.bisect_left(self.bounds, rows), len(self.paths) - 1)]

    def describe(self) -> str:
        parts, low = [], 1
        for bound, path in zip(self.bounds, self.paths):
            parts.append(f"{low}-{bound}: {path}" if low < bound else f"{bound}: {path}")
            low = bound + 1
        dtype = "" if self.dtype == "float32" else f" {self.dtype}"
        return (f"{self.shape[0]}x{self.shape[1]}{dtype} rows " + ", ".join(parts)
                + " (and beyond)")


def machine_key() -> str:
    """The CPU (model name and feature flags) and torch build a measurement holds for."""
    model, flags = platform.processor() or "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == (platform.processor() or "?"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{model}|flags={digest}|torch={torch.__version__}"


def _cache_key(shape: tuple[int, int], paths: tuple[str, ...], dtype: torch.dtype) -> str:
    return (f"{machine_key()}|threads={torch.get_num_threads()}|{shape[0]}x{shape[1]}|"
            f"{str(dtype).removeprefix('torch.')}|{','.join(paths)}|v{_PLAN_VERSION}")


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "corellm" / "cpu-gemm-plans.json"


def machine_gflops() -> float:
    """This process's fp32 GFLOP/s on the calibration matmul, best of 5 (measured once)."""
    if not _speed:
        m, k, n = _CALIBRATION
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        _speed.append(2.0 * m * k * n / max(best, 1e-9) / 1e9)
    return _speed[0]


def _read_cached(key: str) -> GemmPlan | None:
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError):
        return None
    if not entry:
        return None
    try:
        return GemmPlan(tuple(entry["shape"]), tuple(entry["bounds"]), tuple(entry["paths"]),
                        entry.get("gflops", {}), float(entry.get("machine_gflops", 0.0)),
                        str(entry.get("dtype", "float32")))
    except (KeyError, TypeError):
        return None


def _write_cached(key: str, plan: GemmPlan) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = {"shape": list(plan.shape), "bounds": list(plan.bounds),
                     "paths": list(plan.paths), "gflops": plan.gflops,
                     "machine_gflops": plan.machine_gflops, "dtype": plan.dtype}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:       # a read-only home: measure again next time
        logger.debug("cannot cache the GEMM plan in %s: %s", path, exc)


def _preferred(times: dict[int, dict[str, float]], paths: tuple[str, ...]) -> str:
    """The path that is best over all probes: the smallest sum of its time relative to each
    probe's fastest (ties: the earlier path)."""
    def score(p: str) -> float:
        return sum(t[p] / min(t.values()) for t in times.values())
    return min(paths, key=lambda p: (score(p), paths.index(p)))


def measure_gemm_plan(shape: tuple[int, int], paths: tuple[str, ...] | None = None,
                      timer=time.perf_counter, dtype: torch.dtype = torch.float32) -> GemmPlan:
    """Time every path at each probe row count on random weights of ``shape`` (out, in),
    as a model runs them: runs of back-to-back calls (``_PROBE_RUN_FLOP`` or
    ``_PROBE_RUN_BYTES`` of work) that rotate over enough distinct copies of the weight
    (``_PROBE_COLD_BYTES``) that it is not in the cache. (Timing one call on one hot weight
    chose wrongly: thread wake-up dominates a single small call, and a hot weight is not what
    a decode step reads.) Each (rows, path) keeps its best of ``_PROBE_ROUNDS`` rounds, and a
    round times every probe and path in turn, so the samples of one spread over the whole
    measurement and a passing slowdown of a shared machine hits them all alike.

    The plan prefers one path for all buckets, the best over all probes, and takes another
    only where it is at least ``_SWITCH_MARGIN`` faster: every packed path a plan uses is a
    copy of the weight, and paths within noise of each other would double the memory and
    the weights streamed per step for nothing. Probes above ``_PROBE_MAX_FLOP`` are skipped:
    their bucket joins the last one measured."""
    paths = paths or available_gemm_paths(dtype)
    gen = torch.Generator().manual_seed(0)
    wbytes = torch.finfo(dtype).bits // 8 * shape[0] * shape[1]
    copies = max(1, min(_PROBE_MAX_COPIES, -(-_PROBE_COLD_BYTES // wbytes)))
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(copies)]
    packed = {p: [_pack(p, w) for w in weights] for p in paths}
    probes: list[tuple[int, torch.Tensor, int]] = []          # (rows, input, calls per run)
    for rows in _PROBE_ROWS:
        flop = 2.0 * rows * shape[0] * shape[1]
        if probes and flop > _PROBE_MAX_FLOP:
            break
        calls = min(-(-_PROBE_RUN_FLOP // flop), -(-_PROBE_RUN_BYTES // wbytes))
        probes.append((rows, torch.randn(rows, shape[1], generator=gen).to(dtype),
                       int(max(1, min(_PROBE_MAX_CALLS, calls)))))
    turn = [0]

    def run(p: str, x: torch.Tensor, calls: int) -> None:
        for _ in range(calls):
            i = turn[0] = (turn[0] + 1) % copies
            _run(p, x, weights[i], packed[p][i], None)

    times = {rows: dict.fromkeys(paths, float("inf")) for rows, _, _ in probes}
    for rows, x, calls in probes:                               # warm-up
        for p in paths:
            run(p, x, 1)
    for _ in range(_PROBE_ROUNDS):
        for rows, x, calls in probes:
            for p in paths:
                t0 = timer()
                run(p, x, calls)
                times[rows][p] = min(times[rows][p], (timer() - t0) / calls)
    primary = _preferred(times, paths)
    chosen = []
    for rows, t in times.items():
        fastest = min(paths, key=lambda p: (t[p], paths.index(p)))
        chosen.append(fastest if t[fastest] * _SWITCH_MARGIN < t[primary] else primary)
    gflops = {str(rows): {p: round(2.0 * rows * shape[0] * shape[1] / max(v, 1e-12) / 1e9, 1)
                          for p, v in t.items()} for rows, t in times.items()}
    return GemmPlan(tuple(shape), tuple(times), tuple(chosen), gflops, machine_gflops(),
                    str(dtype).removeprefix("torch."))


def gemm_plan(shape: tuple[int, int], paths: tuple[str, ...] | None = None,
              dtype: torch.dtype = torch.float32) -> GemmPlan:
    """The plan for ``shape``: this process's, the disk cache's, or measured now (and
    cached). A cached plan measured while the machine was ``_STALE_SPEEDUP`` or more slower
    than it is now (a slow phase of a shared machine) is measured again."""
    paths = paths or available_gemm_paths(dtype)
    key = _cache_key(shape, paths, dtype)
    plan = _plans.get(key)
    if plan is None:
        plan = _read_cached(key)
        if plan is not None and machine_gflops() > _STALE_SPEEDUP * plan.machine_gflops:
            logger.info("GEMM plan of %dx%d was measured at %.0f GFLOP/s, the machine now does "
                        "%.0f: measuring again", shape[0], shape[1], plan.machine_gflops,
                        machine_gflops())
            plan = None
    if plan is None:
        plan = measure_gemm_plan(shape, paths, dtype=dtype)
        _write_cached(key, plan)
    _plans[key] = plan
    return plan


def pack_linear_weights(model: torch.nn.Module) -> dict[tuple[int, int], GemmPlan]:
    """Give every fp32 or bf16 linear layer on the CPU (``nn.Linear``, and the layers of
    ``corellm.layers.linear``, whose ``linear`` method is their one matmul) the measured plan
    of its weight's shape and dtype, and a copy of the weight in the layout of each packed path
    its plan uses (memory: up to the weights' size again per packed path). Returns the plans by
    shape (empty when there is nothing to plan)."""
    from corellm.layers.linear import LinearBase, ParallelLMHead
    plans: dict[tuple[tuple[int, int], torch.dtype], GemmPlan] = {}
    t0 = time.perf_counter()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
                and weight.dim() == 2):
            continue
        if not (type(module) is torch.nn.Linear or isinstance(module, (LinearBase,
                                                                       ParallelLMHead))):
            continue
        paths = available_gemm_paths(weight.dtype)
        if paths == ("dense",):
            continue
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        key = (shape, weight.dtype)
        plan = plans.get(key) or plans.setdefault(key, gemm_plan(shape, paths, weight.dtype))
        if set(plan.paths) == {"dense"}:
            continue
        w = weight.detach()
        module.gemm_plan = plan
        module.gemm_packed = {p: _pack(p, w) for p in set(plan.paths)}
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_planned_forward, module)
        else:
            module.linear = types.MethodType(_planned_linear, module)
    if plans:
        logger.info("CPU GEMM paths, measured or cached (%.2f s): %s", time.perf_counter() - t0,
                    "; ".join(p.describe() for p in plans.values()))
    return {shape: plan for (shape, _), plan in plans.items()}


def _planned_linear(self: torch.nn.Module, x: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2 or (torch.is_grad_enabled() and (
            self.weight.requires_grad or x.requires_grad
            or (bias is not None and bias.requires_grad))):
        return F.linear(x, self.weight, bias)     # packed copies carry no autograd history
    path = self.gemm_plan.path_for(x.shape[0])
    return _run(path, x, self.weight, self.gemm_packed[path], bias)


def _planned_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _planned_linear(self, x, self.bias)


def _native_rows(self: torch.nn.Module, x: torch.Tensor) -> bool:
    return (x.dim() == 2 and self.gemm_plan.path_for(x.shape[0]) == "native"
            and not (torch.is_grad_enabled() and self.weight.requires_grad))


def _planned_silu_mul(self: torch.nn.Module, x: torch.Tensor,
                      norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
    """SiLU-and-multiply of a merged [gate; up] layer's output in its GEMM (and the RMSNorm
    before it, ``norm``: its weight and eps), where the plan takes corellm's GEMM for these
    rows; None (the caller runs the layers one by one) elsewhere."""
    if not _native_rows(self, x):
        return None
    return native_gemm().linear_silu_mul(x, self.gemm_packed["native"], self.weight.shape[0],
                                         self.bias, k=self.weight.shape[1], norm=norm)


def _planned_normed(self: torch.nn.Module, x: torch.Tensor,
                    norm: tuple[torch.Tensor, float]) -> torch.Tensor | None:
    """The layer applied to RMSNorm(x) (``norm``: its weight and eps), normalized inside its
    GEMM, where the plan takes corellm's GEMM for these rows; else None."""
    if not _native_rows(self, x):
        return None
    return native_gemm().linear(x, self.gemm_packed["native"], self.weight.shape[0], self.bias,
                                k=self.weight.shape[1], norm=norm)


# --------------------------------------------------------------------------- fused element-wise
# RMSNorm, SiLU-and-multiply and RoPE of a float32 model on the CPU, one C pass each
# (cpu_ops.c) instead of a chain of torch ops that each read and write the whole tensor and pay
# a dispatch: per decoder layer, 13 multiplies, 2 pows, 2 means, 4 adds, 2 subtractions, 2
# rsqrts, 2 index lookups and 4 concatenations become 4 calls.
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
            rms.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, f32, i32]
            silu = self._silu[dtype] = getattr(lib, f"corellm_silu_and_mul_{suffix}")
            silu.argtypes = [ptr, ptr, i64, i64, i32]
            rope = self._rope[dtype] = getattr(lib, f"corellm_rope_{suffix}")
            rope.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64,
                             i64, i32]
            rope.restype = i32                  # -1: a position outside the tables
            for fn in (rms, silu):
                fn.restype = None
        self._argmax = lib.corellm_argmax_f32
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr, i32]
        self._argmax.restype = None

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
                               weight.data_ptr(), out.data_ptr(), rows, n, eps,
                               torch.get_num_threads())
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self._takes(x) or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
            return None
        d = x.shape[1] // 2
        out = torch.empty((x.shape[0], d), dtype=x.dtype)
        if out.numel():
            self._silu[x.dtype](x.data_ptr(), out.data_ptr(), x.shape[0], d,
                                torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The index of each row's first maximum of a float32 [rows, n] CPU tensor (NaN counts
        as the maximum), as ``x.max(dim=-1).indices``: one pass, rows split over the threads
        (torch's reduction ran at about 9 GB/s on a 2-core AMD EPYC for 64 x 32000 logits,
        single-threaded). None for other inputs."""
        if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.stride(1) != 1 or x.shape[1] == 0
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(),
                         torch.get_num_threads())
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
            sin.data_ptr(), cos.shape[0], rotary_dim, torch.get_num_threads()) == 0


_cpu_ops: list[CpuOps | None] = []


def built_cpu_ops() -> CpuOps | None:
    """The fused kernels if something in this process already built them (a model with
    ``model.cpu_fused_ops`` on), else None: nothing is built here."""
    return _cpu_ops[0] if _cpu_ops else None


def cpu_ops() -> CpuOps | None:
    """The fused kernels, built on first use; None (logged once) when no C compiler can build
    them."""
    if not _cpu_ops:
        from corellm.native import NativeBuildError, load_library
        try:
            _cpu_ops.append(CpuOps(load_library("corellm_cpu_ops", _OPS_SOURCE, _OPS_FLAGS)))
        except NativeBuildError as exc:
            logger.info("fused CPU element-wise kernels unavailable, using torch ops: %s", exc)
            _cpu_ops.append(None)
    return _cpu_ops[0]


def _fused_rms_norm(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = self.cpu_ops.rms_norm(x, self.weight, self.eps)
    return out if out is not None else type(self).forward(self, x)


def _fused_silu_and_mul(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # only for the dtypes whose kernel measured faster than torch's
    out = self.cpu_ops.silu_and_mul(x) if x.dtype in self.cpu_ops_dtypes else None
    return out if out is not None else type(self).forward(self, x)


def _fused_rope(self: torch.nn.Module, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if self.cpu_ops.rope_(positions, q, k, self.cos, self.sin, self.rotary_dim):
        return q, k
    return type(self).forward(self, positions, q, k)


_silu_faster: dict[torch.dtype, bool] = {}


def _silu_kernel_is_faster(ops: CpuOps, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the SiLU-and-multiply kernel beats torch's here for ``dtype`` (measured once
    per dtype, ~10 ms). It is the one kernel whose speed depends on the compiler: it needs a
    vectorized ``exp`` (GCC finds glibc's vector ``expf`` under -ffast-math; a scalar one made
    it 3x slower than torch)."""
    if dtype not in _silu_faster:
        from corellm.layers import SiluAndMul
        x = torch.randn(64, 2 * 2048, generator=torch.Generator().manual_seed(0)).to(dtype)
        best = {}
        for name, fn in (("kernel", ops.silu_and_mul), ("torch", SiluAndMul().forward)):
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
                        "vs %.0f us): SiluAndMul keeps the torch code",
                        str(dtype).removeprefix("torch."), 250e3 * best["kernel"],
                        250e3 * best["torch"])
    return _silu_faster[dtype]


def fuse_into_gemms(model: torch.nn.Module) -> int:
    """Give each column-parallel or replicated layer of ``model`` (its forward is its one
    matmul: no collective after it) that :func:`pack_linear_weights` planned on corellm's GEMM
    for some row counts ``linear_normed`` (the RMSNorm before it inside its GEMM:
    ``RMSNorm.into``) and, for a ``MergedColumnParallelLinear`` of two equal halves,
    ``linear_silu_mul`` (the SiLU-and-multiply after it: ``SiluAndMul.after``). Row-parallel
    layers and the LM head keep their all-reduce or gather: they get neither. Returns the
    number of layers given one."""
    from corellm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                       ReplicatedLinear)
    count = 0
    for module in model.modules():
        plan = getattr(module, "gemm_plan", None)
        if not (plan is not None and "native" in plan.paths
                and type(module).forward in (ColumnParallelLinear.forward,
                                             ReplicatedLinear.forward)):
            continue
        module.linear_normed = types.MethodType(_planned_normed, module)
        if (isinstance(module, MergedColumnParallelLinear) and len(module.output_sizes) == 2
                and module.output_sizes[0] == module.output_sizes[1]):
            module.linear_silu_mul = types.MethodType(_planned_silu_mul, module)
        count += 1
    return count


def fuse_elementwise(model: torch.nn.Module) -> int:
    """Route the core's RMSNorm, SiluAndMul and RotaryEmbedding modules of ``model`` through the
    fused float32 or bfloat16 CPU kernels (other inputs keep the torch code), and let layers
    planned on corellm's GEMM take the RMSNorm before them and the SiLU-and-multiply after them
    (:func:`fuse_into_gemms`). Returns the number of modules routed to the element-wise
    kernels: 0 when they cannot be built here."""
    from corellm.layers import RMSNorm, SiluAndMul
    from corellm.layers.rotary import RotaryEmbedding
    in_gemms = fuse_into_gemms(model)
    if in_gemms:
        logger.info("RMSNorm and SiLU-and-multiply inside the GEMM of %d linear layers", in_gemms)
    fused = {RMSNorm: _fused_rms_norm, SiluAndMul: _fused_silu_and_mul,
             RotaryEmbedding: _fused_rope}
    modules = [m for m in model.modules() if type(m) in fused]
    dtypes = {p.dtype for p in model.parameters() if p.device.type == "cpu"} & set(CpuOps.DTYPES)
    if not dtypes and next(model.parameters(), None) is not None:
        modules = []                 # an fp16 or GPU model: the kernels take fp32 or bf16 CPU
    ops = cpu_ops() if modules else None
    if ops is None:
        return 0
    # SiLU: the dtypes the model's parameters have (float32 for a model without parameters)
    has_silu = any(type(m) is SiluAndMul for m in modules)
    silu_dtypes = {d for d in (dtypes or {torch.float32})
                   if has_silu and _silu_kernel_is_faster(ops, d)}
    if not silu_dtypes:
        modules = [m for m in modules if type(m) is not SiluAndMul]
    for m in modules:
        m.cpu_ops = ops
        m.cpu_ops_dtypes = silu_dtypes
        m.forward = types.MethodType(fused[type(m)], m)
    logger.info("fused CPU kernels for %d RMSNorm/SiLU-and-multiply/RoPE modules", len(modules))
    return len(modules)
