"""The GEMM path of each weight shape on the CPU, measured at start-up, and corellm's own GEMM.

``pack_linear_weights`` gives every core linear layer of a model (``layer.kernel``) the plan of
its weight's shape and dtype and a copy of the weight in each packed path's layout;
``CpuDeviceOps.linear`` (ops.py) runs the plan's path for the call's row count.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from corellm_plugins.platform_cpu.memory import zeroed_cpu_tensor
from corellm_plugins.platform_cpu.native import machine_key

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- GEMM paths
# Which library runs a small fp32 matmul fastest depends on the CPU (its vector units, matrix
# extensions and caches), not on its vendor string: MKL's packed GEMM beats the plain one on
# some CPUs, oneDNN's prepacked linear beats both on others, and the ranking can change with the
# row count (per-machine figures: docs/benchmarks.md and docs/platform-cpu.md, "GEMM plans").
# So each weight shape gets a plan, measured at start-up: one preferred path, and for a row
# bucket where another is clearly faster, that one.
#   dense   F.linear on the weight as loaded
#   mkl     torch.ops.mkl._mkl_linear on a copy in MKL's packed layout (fp32)
#   onednn  torch.ops.mkldnn._linear_pointwise on a copy in oneDNN's blocked layout (fp32, and
#           bf16 where the CPU has oneDNN's bf16 kernels: AVX-512 or AVX-NE-CONVERT)
#   native  corellm's own register-blocked kernel (cpu_gemm.c, built on first use) on a copy
#           packed in panels of two vector widths, fp32 or bf16 (widened to fp32 as it is read):
#           one candidate among the others: it can win where the libraries are not tuned for the
#           CPU, and lose where their kernels use units it does not (AMX)
#   upcast  bf16 weights only: input and weight converted to fp32 for each call, fp32 GEMM,
#           output rounded to bf16 (no copy kept). Without native bf16 dot products (AVX2),
#           torch's bf16 GEMM is slow at every batch size, and widening pays for its conversions
#           once a batch is large enough to be bound by arithmetic; at one row, reading half
#           the weight bytes can still win. So it is measured, per bucket.
# A plan is cached per process and on disk (keyed by CPU, torch, threads, shape and the
# measuring method's version), so only the first start on a machine pays the measurement.
# A shared machine has slow phases (every path at half speed for a while), and a plan measured
# in one can rank paths wrongly: each cached plan records the machine's speed when it was
# measured (a small calibration matmul), and is measured again when the machine is now clearly
# faster than it was then.
_PLAN_VERSION = 6
_CALIBRATION = (512, 512, 512)          # m, k, n of the calibration matmul (small: run per process)
_STALE_SPEEDUP = 1.3                    # re-measure a plan made when the machine was this slower
_PROBE_ROWS = (1, 4, 16, 64, 256)      # a bucket is (previous probe, probe]; larger -> last
_PROBE_MAX_FLOP = 2e9                  # larger probes of big shapes are skipped (start-up time)
_PROBE_COLD_BYTES = 32 << 20           # weight copies per probe: more than a CPU's cache holds
_PROBE_MAX_COPIES = 16
_PROBE_RUN_FLOP = 1e8                  # a timed run is this much work (long next to a wake-up) ...
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
                gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, f32]
                gemm.restype = i32
            pack = self._pack[dtype] = getattr(lib, f"corellm_gemm_pack_{suffix}")
            pack.argtypes = [ptr, i64, i64, i64, ptr]
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
        self._pack[weight.dtype](weight.data_ptr(), weight.stride(0), n, k, out.data_ptr())
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
                            m, n, k, None if norm_w is None else norm_w.data_ptr(), eps):
                raise MemoryError(f"native GEMM: no scratch for a {dtype} weight of {n}x{k}")
        return out


_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
_GEMM_FLAGS = ("-ffp-contract=fast",)
_native_gemm: list[NativeGemm | None] = []


def native_gemm() -> NativeGemm | None:
    """corellm's own fp32 GEMM, built on first use; None (logged once) when no C compiler can
    build it (then plans choose among the libraries' paths)."""
    if not _native_gemm:
        from corellm_plugins.platform_cpu.native import NativeBuildError, load_library
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


def _cache_key(shape: tuple[int, int], paths: tuple[str, ...], dtype: torch.dtype) -> str:
    from corellm_plugins.platform_cpu.native import thread_pool
    # torch's threads run the libraries' paths, the pool's corellm's kernel
    threads = f"{torch.get_num_threads()}+{thread_pool().threads}" if "native" in paths else \
        str(torch.get_num_threads())
    return (f"{machine_key()}|threads={threads}|{shape[0]}x{shape[1]}|"
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


@dataclass(frozen=True)
class PackedLinear:
    """What ``pack_linear_weights`` prepared for one layer (its ``kernel``): the plan of its
    weight's shape and a packed copy of the weight for each path the plan uses."""

    plan: GemmPlan
    packed: dict[str, torch.Tensor | None]


def pack_linear_weights(model: torch.nn.Module) -> dict[tuple[int, int], GemmPlan]:
    """Give every fp32 or bf16 core linear layer on the CPU (``corellm.layers.linear``'s
    ``LinearBase`` layers and ``ParallelLMHead``, whose ``linear`` method is their one matmul)
    the measured plan of its weight's shape and dtype, and a copy of the weight in the layout
    of each packed path its plan uses (memory: up to the weights' size again per packed path),
    as its ``kernel`` (a ``PackedLinear``). Returns the plans by shape (empty when there is
    nothing to plan)."""
    from corellm.layers.linear import LinearBase, ParallelLMHead
    plans: dict[tuple[tuple[int, int], torch.dtype], GemmPlan] = {}
    t0 = time.perf_counter()
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)):
            continue
        weight = module.weight
        if not (weight.device.type == "cpu" and weight.dim() == 2):
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
        module.kernel = PackedLinear(plan, {p: _pack(p, w) for p in set(plan.paths)})
    if plans:
        logger.info("CPU GEMM paths, measured or cached (%.2f s): %s", time.perf_counter() - t0,
                    "; ".join(p.describe() for p in plans.values()))
    return {shape: plan for (shape, _), plan in plans.items()}
