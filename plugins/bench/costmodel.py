"""Step-time cost models for the simulated executor (issue 13).

A simulated executor runs no model: for each engine step it predicts how long the step would
take from the step plan alone, and advances a virtual clock by that. This module holds

* ``StepShape``: the handful of integers of one step plan that its cost depends on;
* ``CostModel``: ``predict(shape) -> seconds``, serialisable to JSON;
* ``FittedCostModel``: an empirical model calibrated from measured steps (one NNLS fit);
* ``RooflineCostModel``: ``max(compute time, memory time)`` from a ``ModelShape`` and a
  ``DeviceSpec``, for hardware what-ifs (and fittable to measured steps, to validate its form);
* ``DEVICES``: published peak figures of common accelerators;
* ``Profile``: the JSON file ``corellm bench calibrate`` writes and the ``sim`` executor reads.

Pure Python + numpy; scipy is imported only when fitting, torch never (the simulator must start
fast), and nothing under ``plugins/`` is imported.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from corellm import __version__
from corellm.errors import ConfigError

if TYPE_CHECKING:
    from corellm.model_config import ModelArchConfig

PROFILE_FORMAT = "corellm-step-profile"
PROFILE_VERSION = 1
_PROFILE_KEY = "executor.profile"     # the config key ConfigErrors about a profile are filed under


# --------------------------------------------------------------------------- step features
@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step's cost depends on, read from its plan. A request with ``n`` tokens
    scheduled this step and ``c`` tokens already in the KV cache is a *decode* when ``n == 1``
    and a *prefill* (a whole prompt or a chunk of one, or a recomputation) when ``n > 1``."""

    num_reqs: int            # requests in the step
    num_tokens: int          # tokens computed this step: sum of n (the rows of every GEMM)
    num_decodes: int         # requests with n == 1
    num_prefill_tokens: int  # sum of n over prefills
    prefill_attn: int        # query-key pairs prefills score: sum of n*c + n*(n+1)/2 (causal)
    prefill_kv: int          # KV positions prefills attend to: sum of c + n
    decode_kv: int           # KV positions decodes read: sum of c + 1
    num_sampled: int         # rows sampled (through the LM head): requests at their last token

    @classmethod
    def from_lists(cls, scheduled: Sequence[int], computed: Sequence[int],
                   num_sampled: int) -> StepShape:
        """From per-request scheduled and already-computed token counts (same order)."""
        if len(scheduled) != len(computed):
            raise ValueError(f"scheduled has {len(scheduled)} entries, computed "
                             f"{len(computed)}")
        tokens = decodes = ptok = pattn = pkv = dkv = 0
        for n, c in zip(scheduled, computed):
            tokens += n
            if n == 1:
                decodes += 1
                dkv += c + 1
            else:
                ptok += n
                pattn += n * c + n * (n + 1) // 2
                pkv += c + n
        return cls(len(scheduled), tokens, decodes, ptok, pattn, pkv, dkv, num_sampled)

    @classmethod
    def from_plan(cls, plan: Any) -> StepShape:
        """From a ``SchedulerOutput``: ``num_scheduled_tokens``, ``num_computed_tokens`` (the
        context of every scheduled request) and ``sampling_req_ids``. One pass, no numpy."""
        scheduled = plan.num_scheduled_tokens
        computed = plan.num_computed_tokens
        return cls.from_lists(list(scheduled.values()), [computed[rid] for rid in scheduled],
                              len(plan.sampling_req_ids))

    def to_row(self) -> tuple[int, ...]:
        """The fields in ``STEP_FIELDS`` order (a profile's sample row, before the seconds)."""
        return (self.num_reqs, self.num_tokens, self.num_decodes, self.num_prefill_tokens,
                self.prefill_attn, self.prefill_kv, self.decode_kv, self.num_sampled)

    @classmethod
    def from_row(cls, row: Sequence[int]) -> StepShape:
        return cls(*(int(v) for v in row))


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepShape))


def feature_matrix(shapes: Sequence[StepShape]) -> np.ndarray:
    """``len(shapes) x len(STEP_FIELDS)`` float64 array of the shapes' rows."""
    return np.array([s.to_row() for s in shapes], dtype=np.float64).reshape(-1, len(STEP_FIELDS))


def _fit_diagnostics(pred: np.ndarray, t: np.ndarray, n_params: int) -> dict[str, Any]:
    rel = np.abs(pred - t) / t
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((pred - t) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return {"n_samples": int(t.size), "n_params": n_params,
            "mean_abs_pct_err": 100.0 * float(rel.mean()),
            "max_abs_pct_err": 100.0 * float(rel.max()), "r2": r2}


def _check_samples(shapes: Sequence[StepShape], seconds: Sequence[float],
                   n_params: int) -> np.ndarray:
    t = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if t.size != len(shapes):
        raise ValueError(f"{len(shapes)} shapes but {t.size} times")
    if t.size < n_params:
        raise ValueError(f"{t.size} samples cannot determine {n_params} parameters: measure "
                         f"at least {n_params} steps (a few hundred of varied shapes is better)")
    bad = np.flatnonzero(~np.isfinite(t) | (t <= 0))
    if bad.size:
        raise ValueError(f"step times must be positive and finite; sample {int(bad[0])} is "
                         f"{t[bad[0]]!r} ({bad.size} bad in all)")
    return t


# --------------------------------------------------------------------------- cost models
class CostModel(ABC):
    """Predicts the wall time of one engine step from its ``StepShape``."""

    type: ClassVar[str]
    diagnostics: dict[str, Any]

    @abstractmethod
    def predict(self, shape: StepShape) -> float:
        """Seconds the step takes; never negative."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with ``"type"``; ``cost_model_from_json`` reads it back."""


def _num(d: Mapping[str, Any], key: str, *, nonneg: bool = True) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key}: must be a finite number, got {v!r}")
    if nonneg and v < 0:
        raise ValueError(f"{key}: must be >= 0, got {v!r}")
    return float(v)


def cost_model_from_json(d: Mapping[str, Any]) -> CostModel:
    """Rebuild a cost model from its ``to_json()`` dict, dispatching on ``d["type"]``. Raises
    ``ValueError("<key>: <problem>")`` naming the offending key."""
    if not isinstance(d, Mapping):
        raise ValueError(f"must be an object, got {type(d).__name__}")
    kind = d.get("type")
    if kind == FittedCostModel.type:
        return FittedCostModel.from_json(d)
    if kind == RooflineCostModel.type:
        return RooflineCostModel.from_json(d)
    raise ValueError(f"type: unknown cost model {kind!r} (known: 'fitted', 'roofline')")


class FittedCostModel(CostModel):
    """An empirical step-time model, calibrated from measured steps::

        t = base + per_req*num_reqs + g(num_tokens)
            + a_prefill*prefill_attn + a_prefill_kv*prefill_kv + a_decode*decode_kv
            + per_sample*num_sampled

    * ``g`` is piecewise linear in ``num_tokens`` with ``g(0) = 0``, through ``knot_values`` at
      ``knots``, extrapolated with its last segment's slope. It is the GEMM (linear layer) cost.
      A GEMM's cost per token is not constant: a small batch is bound by reading the weights
      (cost nearly flat in tokens), a big one by arithmetic (cost linear in tokens), and
      between the two the per-token cost falls as the batch grows. A piecewise-linear ``g`` with
      knots at powers of two follows that concave curve (and kernel-selection steps) without
      assuming its form. ``g`` never decreases: a bigger batch never costs less.
    * the attention terms are linear in what attention touches: causal query-key pairs and KV
      positions for prefills, KV positions read for decodes.
    * ``base`` is the fixed cost of a step (launches, Python), ``per_req`` the per-request
      bookkeeping, ``per_sample`` the LM head and sampler per sampled row.

    Every coefficient is non-negative, which keeps predictions non-negative and physically
    meaningful; ``fit`` solves for all of them jointly with one non-negative least squares.
    """

    type = "fitted"
    COEFS: ClassVar[tuple[str, ...]] = ("base", "per_req", "a_prefill", "a_prefill_kv",
                                        "a_decode", "per_sample")

    def __init__(self, *, base: float, per_req: float, knots: Sequence[int],
                 knot_values: Sequence[float], a_prefill: float, a_prefill_kv: float,
                 a_decode: float, per_sample: float,
                 diagnostics: dict[str, Any] | None = None) -> None:
        self.base, self.per_req = float(base), float(per_req)
        self.a_prefill, self.a_prefill_kv = float(a_prefill), float(a_prefill_kv)
        self.a_decode, self.per_sample = float(a_decode), float(per_sample)
        self.knots = tuple(int(k) for k in knots)
        self.knot_values = tuple(float(v) for v in knot_values)
        self.diagnostics = dict(diagnostics or {})
        for name in self.COEFS:
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        if not self.knots or len(self.knots) != len(self.knot_values):
            raise ValueError(f"knots: {len(self.knots)} knots but {len(self.knot_values)} "
                             "knot_values (need the same number, at least one)")
        if self.knots[0] < 1 or any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError(f"knots: must be positive and strictly increasing, got "
                             f"{list(self.knots)}")
        vals = (0.0, *self.knot_values)
        if any(not math.isfinite(b) or b < a for a, b in zip(vals, vals[1:])):
            raise ValueError("knot_values: must be finite, >= 0 and non-decreasing, got "
                             f"{list(self.knot_values)}")
        self._ks = (0, *self.knots)
        self._vs = vals
        self._slopes = tuple((vals[i + 1] - vals[i]) / (self._ks[i + 1] - self._ks[i])
                             for i in range(len(self.knots)))

    def g(self, num_tokens: float) -> float:
        """The token (GEMM) term at ``num_tokens``."""
        ks = self._ks
        i = min(bisect_right(ks, num_tokens), len(ks) - 1)   # ks[i-1] <= T < ks[i], or last
        return self._vs[i - 1] + self._slopes[i - 1] * (num_tokens - ks[i - 1])

    def predict(self, shape: StepShape) -> float:
        t = (self.base + self.per_req * shape.num_reqs + self.g(shape.num_tokens)
             + self.a_prefill * shape.prefill_attn + self.a_prefill_kv * shape.prefill_kv
             + self.a_decode * shape.decode_kv + self.per_sample * shape.num_sampled)
        return t if t > 0.0 else 0.0

    # ---- fitting
    @staticmethod
    def default_knots(num_tokens: Sequence[int], min_per_segment: int = 3) -> tuple[int, ...]:
        """Knots at powers of two from just above the smallest ``num_tokens`` seen, ending at
        the largest; a segment holding fewer than ``min_per_segment`` samples is merged into
        the next (its slope could not be told apart from its neighbour's)."""
        ts = sorted(int(t) for t in num_tokens)
        if not ts:
            raise ValueError("no samples")
        lo, hi = ts[0], max(ts[-1], 1)
        cands = [1 << i for i in range(1, hi.bit_length() + 1) if lo < (1 << i) < hi]
        knots: list[int] = []
        prev = 0
        for k in cands:
            if bisect_right(ts, k) - bisect_right(ts, prev) >= min_per_segment:
                knots.append(k)
                prev = k
        if knots and len(ts) - bisect_right(ts, prev) < min_per_segment:
            knots.pop()
        knots.append(hi)
        return tuple(knots)

    @staticmethod
    def design_matrix(shapes: Sequence[StepShape], knots: Sequence[int]) -> np.ndarray:
        """Columns: 1, num_reqs, one ramp per knot, prefill_attn, prefill_kv, decode_kv,
        num_sampled. Ramp ``j`` is ``clip(T - k[j-1], 0, k[j] - k[j-1]) / (k[j] - k[j-1])``
        (the last one unclipped), so ``g = sum(increment_j * ramp_j)`` and the knot values are
        the cumulative sums of the increments: non-negative increments make ``g``
        non-decreasing, and a single NNLS fits ``g`` with everything else."""
        f = feature_matrix(shapes)
        T = f[:, 1]
        ks = np.array([0, *knots], dtype=np.float64)
        ramps = []
        for j in range(1, len(ks)):
            w = ks[j] - ks[j - 1]
            r = np.maximum(T - ks[j - 1], 0.0) / w
            ramps.append(r if j == len(ks) - 1 else np.minimum(r, 1.0))
        cols = [np.ones_like(T), f[:, 0], *ramps, f[:, 4], f[:, 5], f[:, 6], f[:, 7]]
        return np.column_stack(cols)

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float],
            knots: Sequence[int] | None = None) -> FittedCostModel:
        """Fit every coefficient to measured step times with one NNLS.

        The residuals are *relative*: each row is weighted by ``1 / t_measured``, so the fit
        minimises the sum of squared relative errors. With plain least squares the few big
        prefill steps (hundreds of ms) would dominate and a 2 ms decode step could be off by
        50% at no cost, yet decode steps are most of a serving run's steps. Columns are scaled
        to unit norm before solving (features span ten orders of magnitude) and unscaled
        after. A column that is zero in every sample (e.g. no prefills measured) gets
        coefficient 0 and is listed in ``diagnostics["unfitted"]``; ``diagnostics["rank"]``
        below ``n_params`` means some coefficients are not separately determined by the data
        (e.g. no partial prefill chunks, so ``per_sample`` cannot be told from ``per_req``):
        the predictions for shapes like the measured ones remain good.
        """
        from scipy.optimize import nnls

        knots = tuple(int(k) for k in knots) if knots is not None else (
            cls.default_knots([s.num_tokens for s in shapes]) if shapes else (1,))
        n_params = len(knots) + len(cls.COEFS)
        t = _check_samples(shapes, seconds, n_params)
        X = cls.design_matrix(shapes, knots)
        A = X / t[:, None]
        norms = np.sqrt(np.sum(A * A, axis=0))
        active = norms > 0
        As = A[:, active] / norms[active]
        x, _ = nnls(As, np.ones_like(t), maxiter=50 * As.shape[1])
        coef = np.zeros(X.shape[1])
        coef[active] = x / norms[active]
        m = len(knots)
        names = ["base", "per_req", *(f"g[{k}]" for k in knots), "a_prefill", "a_prefill_kv",
                 "a_decode", "per_sample"]
        diag = _fit_diagnostics(X @ coef, t, n_params)
        diag["rank"] = int(np.linalg.matrix_rank(As)) if As.size else 0
        diag["unfitted"] = [n for n, a in zip(names, active) if not a]
        return cls(base=coef[0], per_req=coef[1], knots=knots,
                   knot_values=np.cumsum(coef[2:2 + m]).tolist(),
                   a_prefill=coef[2 + m], a_prefill_kv=coef[3 + m], a_decode=coef[4 + m],
                   per_sample=coef[5 + m], diagnostics=diag)

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, **{n: getattr(self, n) for n in self.COEFS},
                "knots": list(self.knots), "knot_values": list(self.knot_values),
                "diagnostics": self.diagnostics}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FittedCostModel:
        knots, vals = d.get("knots"), d.get("knot_values")
        if not isinstance(knots, list) or not all(
                isinstance(k, int) and not isinstance(k, bool) for k in knots):
            raise ValueError(f"knots: must be a list of integers, got {knots!r}")
        if not isinstance(vals, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            raise ValueError(f"knot_values: must be a list of numbers, got {vals!r}")
        diag = d.get("diagnostics", {})
        if not isinstance(diag, dict):
            raise ValueError(f"diagnostics: must be an object, got {diag!r}")
        return cls(**{n: _num(d, n) for n in cls.COEFS}, knots=knots, knot_values=vals,
                   diagnostics=diag)

    def __repr__(self) -> str:
        coefs = ", ".join(f"{n}={getattr(self, n):.3g}" for n in self.COEFS)
        return f"FittedCostModel({coefs}, knots={list(self.knots)})"


# --------------------------------------------------------------------------- roofline
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def dtype_name(dtype: str) -> str:
    """Canonical torch-style dtype name (``"bf16"`` and ``"torch.bfloat16"`` -> ``"bfloat16"``)."""
    d = str(dtype).removeprefix("torch.")
    d = _DTYPE_ALIASES.get(d, d)
    if d not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BYTES)})")
    return d


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype_name(dtype)]


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-family decoder (gated MLP, RMSNorm, grouped-query attention,
    no biases): what its step cost depends on. Other layouts are approximated by it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in fields(self)[:-1]:
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: must be a positive integer, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError("tie_word_embeddings: must be true or false, got "
                             f"{self.tie_word_embeddings!r}")

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, gate/up/down MLP, two norms."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params_non_embedding(self) -> int:
        """Every layer plus the final norm: the weights every token multiplies."""
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def num_params(self) -> int:
        """Embedding + layers + final norm + LM head (a separate matrix only when untied)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_params_non_embedding + head

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through the layers (2 per weight), excluding attention
        scores and the LM head (which only sampled rows go through)."""
        return 2 * self.num_params_non_embedding

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes the weights occupy."""
        return self.num_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def fingerprint(self) -> dict[str, Any]:
        """The shape fields: what identifies "the same model" when checking a profile."""
        return asdict(self)

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama key names). Missing
        ``intermediate_size`` falls back to ``4 * hidden_size``."""
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]),
                   num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
                   vocab_size=int(cfg["vocab_size"]),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_arch(cls, arch: ModelArchConfig) -> ModelShape:
        """From a parsed ``ModelArchConfig``. ``intermediate_size`` is the arch field
        (``LlamaArchConfig``), else ``arch.raw["intermediate_size"]``, else ``4 * hidden_size``
        (the classic MLP width: an assumption); ``tie_word_embeddings`` likewise, else False."""
        raw = arch.raw or {}
        inter = getattr(arch, "intermediate_size", None) or raw.get("intermediate_size") \
            or 4 * arch.hidden_size
        tied = getattr(arch, "tie_word_embeddings", None)
        if tied is None:
            tied = bool(raw.get("tie_word_embeddings", False))
        return cls(hidden_size=arch.hidden_size, num_layers=arch.num_hidden_layers,
                   num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                   head_dim=arch.head_dim, intermediate_size=int(inter),
                   vocab_size=arch.vocab_size, tie_word_embeddings=bool(tied))


@dataclass(frozen=True)
class DeviceSpec:
    """Published peak figures of a device. ``peak_flops`` maps a dtype name to dense FLOP/s
    (no structured sparsity: the datasheets' "with sparsity" figures are halved); ``mem_bw``
    is bytes/s; ``source`` names the document the figures come from."""

    key: str
    name: str
    kind: str                          # "cuda", "cpu", ...
    peak_flops: Mapping[str, float]
    mem_bw: float
    memory_gib: float
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak_flops": dict(self.peak_flops)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeviceSpec:
        for k in ("key", "name", "kind"):
            if not isinstance(d.get(k), str):
                raise ValueError(f"{k}: must be a string, got {d.get(k)!r}")
        pf = d.get("peak_flops")
        if not isinstance(pf, dict) or not pf or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for v in pf.values()):
            raise ValueError(f"peak_flops: must map dtype names to positive FLOP/s, got {pf!r}")
        bw = _num(d, "mem_bw")
        if bw <= 0:
            raise ValueError(f"mem_bw: must be > 0, got {bw!r}")
        return cls(key=d["key"], name=d["name"], kind=d["kind"],
                   peak_flops={str(k): float(v) for k, v in pf.items()}, mem_bw=bw,
                   memory_gib=_num(d, "memory_gib"), source=str(d.get("source", "")))


def _dev(key: str, name: str, bf16_tf: float, fp32_tf: float, tb_s: float, gib: float,
         source: str, fp16_tf: float | None = None) -> DeviceSpec:
    t = 1e12
    return DeviceSpec(key, name, "cuda", {"bfloat16": bf16_tf * t,
                                          "float16": (fp16_tf or bf16_tf) * t,
                                          "float32": fp32_tf * t}, tb_s * t, gib, source)


# Dense tensor-core BF16/FP16 and non-tensor FP32 (not TF32) peaks, memory bandwidth and capacity
# as printed on NVIDIA's datasheets (capacity in the datasheet's GB, used as GiB).
DEVICES: dict[str, DeviceSpec] = {d.key: d for d in (
    _dev("h100-sxm", "NVIDIA H100 SXM", 989, 67, 3.35, 80,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM; 1,979 TFLOPS BF16 with sparsity)"),
    _dev("h100-pcie", "NVIDIA H100 PCIe", 756, 51, 2.0, 80,
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe; 1,513 TFLOPS BF16 with sparsity)"),
    _dev("h200", "NVIDIA H200 SXM", 989, 67, 4.8, 141,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM; 1,979 TFLOPS BF16 with sparsity)"),
    _dev("a100-sxm-80gb", "NVIDIA A100 SXM 80GB", 312, 19.5, 2.039, 80,
         "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM; 624 TFLOPS BF16 with sparsity)"),
    _dev("l4", "NVIDIA L4", 121, 30.3, 0.3, 24,
         "NVIDIA L4 Tensor Core GPU datasheet (242 TFLOPS BF16 with sparsity)"),
    _dev("rtx-4070-laptop", "NVIDIA GeForce RTX 4070 Laptop GPU", 31.2, 15.6, 0.256, 8,
         "approximate: 4608 CUDA cores at a 1695 MHz boost clock (TGP-dependent; TechPowerUp "
         "GPU database), FP16/BF16 tensor with FP32 accumulate at 2x FP32 (Ada GeForce); "
         "128-bit GDDR6 at 16 Gbps"),
)}


DEFAULT_COMPUTE_EFF = 0.5      # fraction of peak FLOP/s a real GEMM mix reaches
DEFAULT_BW_EFF = 0.7           # fraction of peak bandwidth a weight/KV stream reaches
DEFAULT_OVERHEAD_S = 300e-6    # fixed cost of a GPU step: kernel launches, Python, sync
DEFAULT_PER_REQ_S = 10e-6      # per-request input preparation and bookkeeping


class RooflineCostModel(CostModel):
    """``t = overhead_s + per_req_s*num_reqs + max(flops / (peak*compute_eff),
    bytes / (mem_bw*bw_eff))`` for hardware what-ifs.

    * flops = ``2*num_params_non_embedding*num_tokens`` (linear layers) ``+ 2*V*H*num_sampled``
      (LM head) ``+ 4*layers*heads*head_dim*(prefill_attn + decode_kv)`` (QK^T and PV).
    * bytes = the layer weights (read once per step, whatever the batch) + the LM head when
      any row is sampled + ``kv_bytes_per_token*(prefill_kv + decode_kv)`` (KV read by
      attention) + ``kv_bytes_per_token*num_tokens`` (KV written). Activations, the embedding
      gather and the logits are ignored (small next to weights and KV at serving batch sizes).

    The defaults (``DEFAULT_COMPUTE_EFF`` 0.5, ``DEFAULT_BW_EFF`` 0.7, ``DEFAULT_OVERHEAD_S``
    300 µs, ``DEFAULT_PER_REQ_S`` 10 µs) are assumptions typical of a GPU serving engine, not
    measurements; ``fit`` replaces them with values fitted to measured steps.
    """

    type = "roofline"

    def __init__(self, model: ModelShape, device: DeviceSpec, dtype: str = "bfloat16", *,
                 compute_eff: float = DEFAULT_COMPUTE_EFF, bw_eff: float = DEFAULT_BW_EFF,
                 overhead_s: float = DEFAULT_OVERHEAD_S, per_req_s: float = DEFAULT_PER_REQ_S,
                 diagnostics: dict[str, Any] | None = None) -> None:
        try:
            self.model, self.device, self.dtype = model, device, dtype_name(dtype)
        except ValueError as e:
            raise ValueError(f"dtype: {e}") from None
        if self.dtype not in device.peak_flops:
            raise ValueError(f"dtype: {device.name} has no peak for {self.dtype} (it has "
                             f"{', '.join(device.peak_flops)})")
        for name, v in (("compute_eff", compute_eff), ("bw_eff", bw_eff)):
            if not (0 < v <= 1):
                raise ValueError(f"{name}: must be in (0, 1], got {v!r}")
        for name, v in (("overhead_s", overhead_s), ("per_req_s", per_req_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        self.compute_eff, self.bw_eff = float(compute_eff), float(bw_eff)
        self.overhead_s, self.per_req_s = float(overhead_s), float(per_req_s)
        self.diagnostics = dict(diagnostics or {})
        db = dtype_bytes(self.dtype)
        self.peak_flops = float(device.peak_flops[self.dtype])
        self._f_tok = 2.0 * model.num_params_non_embedding
        self._f_head = 2.0 * model.vocab_size * model.hidden_size
        self._f_attn = 4.0 * model.num_layers * model.num_heads * model.head_dim
        self._b_body = float(model.num_params_non_embedding * db)
        self._b_head = float(model.vocab_size * model.hidden_size * db)
        self._b_kv = float(model.kv_bytes_per_token(db))

    def step_flops(self, s: StepShape) -> float:
        return (self._f_tok * s.num_tokens + self._f_head * s.num_sampled
                + self._f_attn * (s.prefill_attn + s.decode_kv))

    def step_bytes(self, s: StepShape) -> float:
        return (self._b_body + (self._b_head if s.num_sampled else 0.0)
                + self._b_kv * (s.prefill_kv + s.decode_kv + s.num_tokens))

    def compute_time(self, s: StepShape) -> float:
        return self.step_flops(s) / (self.peak_flops * self.compute_eff)

    def memory_time(self, s: StepShape) -> float:
        return self.step_bytes(s) / (self.device.mem_bw * self.bw_eff)

    def bound(self, s: StepShape) -> str:
        """``"compute"`` or ``"memory"``: which roof the step is under."""
        return "compute" if self.compute_time(s) >= self.memory_time(s) else "memory"

    def predict(self, shape: StepShape) -> float:
        return (self.overhead_s + self.per_req_s * shape.num_reqs
                + max(self.compute_time(shape), self.memory_time(shape)))

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], model: ModelShape,
            device: DeviceSpec, dtype: str = "bfloat16") -> RooflineCostModel:
        """Fit compute_eff, bw_eff (in (0, 1]), overhead_s and per_req_s (>= 0) to measured
        steps by bounded least squares on relative error (see ``FittedCostModel.fit`` for why
        relative), from a few starting points (the ``max`` makes the problem non-smooth). An
        efficiency that no measured step is bound by is not determined: compare
        ``diagnostics["compute_bound"]`` / ``["memory_bound"]`` (sample counts)."""
        from scipy.optimize import least_squares

        t = _check_samples(shapes, seconds, 4)
        base = cls(model, device, dtype)
        F = np.array([base.step_flops(s) for s in shapes]) / base.peak_flops
        B = np.array([base.step_bytes(s) for s in shapes]) / device.mem_bw
        R = np.array([s.num_reqs for s in shapes], dtype=np.float64)
        ts = float(np.median(t))          # time unit for the two additive terms

        def pred(x: np.ndarray) -> np.ndarray:
            return x[2] * ts + x[3] * ts * R + np.maximum(F / x[0], B / x[1])

        def resid(x: np.ndarray) -> np.ndarray:
            return pred(x) / t - 1.0

        best = None
        for ce in (0.05, 0.3, 0.9):
            for be in (0.05, 0.3, 0.9):
                r = least_squares(resid, [ce, be, 0.01, 0.0], bounds=(
                    [1e-4, 1e-4, 0.0, 0.0], [1.0, 1.0, np.inf, np.inf]), x_scale="jac",
                    xtol=1e-12, ftol=1e-12, gtol=1e-12)
                if best is None or r.cost < best.cost:
                    best = r
        x = best.x
        diag = _fit_diagnostics(pred(x), t, 4)
        cbound = int(np.sum(F / x[0] >= B / x[1]))
        diag.update(compute_bound=cbound, memory_bound=int(t.size) - cbound)
        return cls(model, device, dtype, compute_eff=float(x[0]), bw_eff=float(x[1]),
                   overhead_s=float(x[2] * ts), per_req_s=float(x[3] * ts), diagnostics=diag)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "model": self.model.fingerprint(),
                "device": self.device.to_json(), "dtype": self.dtype,
                "compute_eff": self.compute_eff, "bw_eff": self.bw_eff,
                "overhead_s": self.overhead_s, "per_req_s": self.per_req_s,
                "diagnostics": self.diagnostics}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RooflineCostModel:
        m = d.get("model")
        if not isinstance(m, dict):
            raise ValueError(f"model: must be an object of ModelShape fields, got {m!r}")
        try:
            model = ModelShape(**m)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
        except TypeError as e:
            raise ValueError(f"model: {e}") from None
        dev = d.get("device")
        if not isinstance(dev, dict):
            raise ValueError(f"device: must be an object, got {dev!r}")
        try:
            device = DeviceSpec.from_json(dev)
        except ValueError as e:
            raise ValueError(f"device.{e}") from None
        if not isinstance(d.get("dtype"), str):
            raise ValueError(f"dtype: must be a string, got {d.get('dtype')!r}")
        diag = d.get("diagnostics", {})
        if not isinstance(diag, dict):
            raise ValueError(f"diagnostics: must be an object, got {diag!r}")
        return cls(model, device, d["dtype"], compute_eff=_num(d, "compute_eff"),
                   bw_eff=_num(d, "bw_eff"), overhead_s=_num(d, "overhead_s"),
                   per_req_s=_num(d, "per_req_s"), diagnostics=diag)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.device.name}, {self.dtype}, compute_eff="
                f"{self.compute_eff:.3g}, bw_eff={self.bw_eff:.3g}, overhead_s="
                f"{self.overhead_s:.3g}, per_req_s={self.per_req_s:.3g})")


def model_fingerprint(arch: ModelArchConfig) -> dict[str, Any]:
    """What identifies "the same model" for a profile: the architecture and the shape."""
    return {"architecture": (arch.architectures or ("?",))[0],
            **ModelShape.from_arch(arch).fingerprint()}


# --------------------------------------------------------------------------- profile file
def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Profile:
    """A step-time profile: the cost model of one model on one device and dtype, and the
    context it was measured in. ``corellm bench calibrate`` writes it (``kind="measured"``, a
    ``FittedCostModel`` and the samples it was fitted to), or it is made from a ``DeviceSpec``
    (``kind="roofline"``); the ``sim`` executor reads it."""

    kind: str                          # "measured" | "roofline"
    model: dict[str, Any]              # name, architecture, fingerprint (ModelShape.fingerprint)
    dtype: str                         # e.g. "float32"
    device: dict[str, Any]             # kind ("cpu", "cuda"), name ("AMD EPYC (2 cores, avx2)")
    block_size: int
    kv_bytes_per_block: int            # the real engine's: the simulated pool gets as many blocks
    cost_model: CostModel
    engine: dict[str, Any] = field(default_factory=dict)   # max_num_batched_tokens, backend...
    samples: list[list[float]] | None = None   # rows: STEP_FIELDS..., seconds
    notes: list[str] = field(default_factory=list)
    corellm_version: str = __version__
    created: str = field(default_factory=_now)
    format: str = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    source: str | None = field(default=None, compare=False)   # the file it was loaded from

    KINDS: ClassVar[tuple[str, ...]] = ("measured", "roofline")

    # ---- samples
    @staticmethod
    def make_samples(shapes: Sequence[StepShape], seconds: Sequence[float]) -> list[list[float]]:
        return [[*s.to_row(), float(t)] for s, t in zip(shapes, seconds, strict=True)]

    def sample_data(self) -> tuple[list[StepShape], list[float]]:
        """The stored samples as shapes and seconds, e.g. to re-fit with other knots."""
        rows = self.samples or []
        return [StepShape.from_row(r[:-1]) for r in rows], [float(r[-1]) for r in rows]

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version, "kind": self.kind,
                "model": self.model, "dtype": self.dtype, "device": self.device,
                "corellm_version": self.corellm_version, "created": self.created,
                "block_size": self.block_size, "kv_bytes_per_block": self.kv_bytes_per_block,
                "engine": self.engine, "cost_model": self.cost_model.to_json(),
                "notes": list(self.notes), "samples": self.samples}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as indented JSON, one sample per line."""
        d = self.to_json()
        samples = d.pop("samples")
        text = json.dumps(d, indent=2)
        if samples is not None:
            rows = ",\n    ".join(json.dumps(r) for r in samples)
            body = f"[\n    {rows}\n  ]" if samples else "[]"
            text = text[:-2] + f',\n  "samples": {body}\n}}'
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")

    @classmethod
    def from_json(cls, d: Any, source: str = "<profile>") -> Profile:
        """Validate and build; every problem raises ``ConfigError`` under ``executor.profile``
        with a message naming ``source`` and the bad key."""
        def fail(msg: str) -> ConfigError:
            return ConfigError([(_PROFILE_KEY, f"{source}: {msg}")])

        if not isinstance(d, dict):
            raise fail(f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") != PROFILE_FORMAT:
            raise fail(f"key 'format' is {d.get('format')!r}, expected {PROFILE_FORMAT!r} "
                       "(not a corellm step profile)")
        if d.get("version") != PROFILE_VERSION:
            raise fail(f"key 'version' is {d.get('version')!r}; this corellm reads version "
                       f"{PROFILE_VERSION}")
        problems: list[str] = []

        def need(key: str, types: type | tuple[type, ...], what: str,
                 optional: bool = False) -> Any:
            if key not in d:
                if not optional:
                    problems.append(f"missing key {key!r}")
                return None
            v = d[key]
            if (optional and v is None) or (isinstance(v, types) and not isinstance(v, bool)):
                return v
            problems.append(f"key {key!r} must be {what}, got {v!r}")
            return None

        kind = need("kind", str, "a string")
        if kind is not None and kind not in cls.KINDS:
            problems.append(f"key 'kind' must be one of {', '.join(cls.KINDS)}, got {kind!r}")
        model = need("model", dict, "an object")
        if model is not None:
            if not isinstance(model.get("name"), str):
                problems.append(f"key 'model.name' must be a string, got {model.get('name')!r}")
            if not isinstance(model.get("fingerprint"), dict):
                problems.append("key 'model.fingerprint' must be an object, got "
                                f"{model.get('fingerprint')!r}")
        dtype = need("dtype", str, "a string")
        device = need("device", dict, "an object")
        if device is not None and not isinstance(device.get("kind"), str):
            problems.append(f"key 'device.kind' must be a string, got {device.get('kind')!r}")
        block_size = need("block_size", int, "a positive integer")
        kvb = need("kv_bytes_per_block", int, "a positive integer")
        for key, v in (("block_size", block_size), ("kv_bytes_per_block", kvb)):
            if v is not None and v <= 0:
                problems.append(f"key {key!r} must be a positive integer, got {v!r}")
        engine = need("engine", dict, "an object", optional=True)
        notes = need("notes", list, "a list of strings", optional=True)
        if notes is not None and not all(isinstance(n, str) for n in notes):
            problems.append(f"key 'notes' must be a list of strings, got {notes!r}")
        version_s = need("corellm_version", str, "a string", optional=True)
        created = need("created", str, "a string", optional=True)
        samples = need("samples", list, "a list of rows", optional=True)
        if samples is not None:
            width = len(STEP_FIELDS) + 1
            for i, r in enumerate(samples):
                if not (isinstance(r, list) and len(r) == width and all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)):
                    problems.append(f"key 'samples[{i}]' must be {width} numbers "
                                    f"({', '.join(STEP_FIELDS)}, seconds), got {r!r}")
                    break
        cm = need("cost_model", dict, "an object")
        cost_model = None
        if cm is not None:
            try:
                cost_model = cost_model_from_json(cm)
            except ValueError as e:
                key, sep, rest = str(e).partition(": ")
                problems.append(f"key 'cost_model.{key}': {rest}" if sep and " " not in key
                                else f"key 'cost_model': {e}")
        if problems:
            raise ConfigError([(_PROFILE_KEY, f"{source}: {p}") for p in problems])
        return cls(kind=kind, model=model, dtype=dtype, device=device, block_size=block_size,
                   kv_bytes_per_block=kvb, cost_model=cost_model, engine=engine or {},
                   samples=samples, notes=notes or [],
                   corellm_version=version_s or "unknown", created=created or "unknown",
                   source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read and validate a profile file; a missing or malformed file raises ``ConfigError``
        under ``executor.profile`` naming the file (and the bad key)."""
        p = os.fspath(path)
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError([(_PROFILE_KEY, f"{p}: no such file")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([(_PROFILE_KEY, f"{p}: cannot read: {e}")]) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError([(_PROFILE_KEY, f"{p}: not valid JSON: {e.msg} at line "
                                f"{e.lineno} column {e.colno}")]) from None
        return cls.from_json(d, source=p)

    # ---- compatibility
    def check_compatible(self, model_name: str, fingerprint: Mapping[str, Any] | None,
                         dtype: str | None, device_kind: str | None) -> None:
        """Refuse (``ConfigError`` under ``executor.profile``, one problem per mismatch) a
        profile made for another model (its fingerprint differs: names both models and the
        first differing field), another dtype, or another device kind. ``None`` skips a check;
        ``device_kind`` "auto" accepts any device, and "cuda:1" is compared as "cuda"."""
        where = f"{self.source}: " if self.source else ""
        theirs = self.model.get("name", "?")
        problems: list[str] = []
        if fingerprint is not None:
            fp = self.model.get("fingerprint", {})
            for k in [*fp, *(k for k in fingerprint if k not in fp)]:
                a, b = fp.get(k, "<absent>"), fingerprint.get(k, "<absent>")
                if a != b:
                    problems.append(f"{where}profile is for model {theirs} but the engine runs "
                                    f"{model_name}: {k} is {a} in the profile, {b} in the model")
                    break
        if dtype is not None and dtype_key(self.dtype) != dtype_key(dtype):
            problems.append(f"{where}profile is for dtype {self.dtype} but model.dtype is "
                            f"{dtype}")
        if device_kind not in (None, "auto"):
            want = str(device_kind).split(":")[0]
            have = str(self.device.get("kind", "?"))
            if have != want:
                problems.append(f"{where}profile is for {have} ({self.device.get('name', '?')}"
                                f", {self.kind}) but the engine runs on {device_kind}")
        if problems:
            raise ConfigError([(_PROFILE_KEY, p) for p in problems])


def dtype_key(dtype: str) -> str:
    """A dtype name for comparison: canonical when known (``bf16`` == ``bfloat16``), else as
    given."""
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype)
