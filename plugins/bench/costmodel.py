"""Step-time cost models for the simulated executor.

A simulated executor runs no model: for each engine step it predicts how long the step would
take from the step plan alone, and advances a virtual clock by that. This module holds

* ``StepShape``: the handful of integers of one step plan that its cost depends on;
* ``CostModel``: ``predict(shape) -> seconds``, serialisable to JSON;
* ``FittedCostModel``: an empirical model calibrated from measured steps (one NNLS fit);
* ``HostCostModel``: the host's part of a step (the engine loop's work: planning, the update,
  the runner's work between steps), a linear NNLS fit to the same steps' host times;
* ``OverlappedCostModel``: a step's time when the engine overlaps steps
  (``scheduler.async_scheduling``): ``max(host, device)`` of a step model split by a host model.

**Host and device.** Calibration measures each step's phases (``StepStats.timings``). The
*device* part is the executor's: ``DEVICE_PHASES``, the worker's ``prepare_inputs``, ``forward``
and ``sample``, which run in order step after step (a worker prepares step N+1 only once step
N's sampled tokens are appended, so preparing is on the model's critical path, not the host's).
The *host* part is the rest of the step's measured time: ``schedule``, ``update`` and whatever
the engine and the runner do between two steps. Overlapped steps hide the host part of step N+1
under the device part of step N, so a step then costs ``max(host, device)`` instead of
``host + device``.

Beside it: ``roofline`` (``RooflineCostModel``: ``max(compute time, memory time)`` from a
``ModelShape`` of ``model_shape`` and a ``DeviceSpec`` of ``devices``, for hardware what-ifs, and
fittable to measured steps, to validate its form), ``devices`` (``DEVICES``: published peak
figures of common accelerators) and ``profile`` (``Profile``: the JSON file ``corellm bench
calibrate`` writes and the ``sim`` executor reads).

Pure Python + numpy; scipy is imported only when fitting, torch never (the simulator must start
fast), and no other plugin is imported.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np


# --------------------------------------------------------------------------- step features
class StepShape(NamedTuple):
    """What one step's cost depends on, read from its plan. A request with ``n`` tokens
    scheduled this step and ``c`` tokens already in the KV cache is a *decode* when ``n == 1``
    and a *prefill* (a whole prompt or a chunk of one, or a recomputation) when ``n > 1``.

    A named tuple, immutable: a simulated run builds one per step, and a frozen dataclass's
    field-by-field ``__init__`` costs several times a tuple's."""

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
        return cls._from_pairs(zip(scheduled, computed), len(scheduled), num_sampled)

    @classmethod
    def _from_pairs(cls, pairs: Iterable[tuple[int, int]], num_reqs: int,
                    num_sampled: int) -> StepShape:
        tokens = decodes = ptok = pattn = pkv = dkv = 0
        for n, c in pairs:
            tokens += n
            if n == 1:
                decodes += 1
                dkv += c + 1
            else:
                ptok += n
                pattn += n * c + n * (n + 1) // 2
                pkv += c + n
        # (tuple.__new__: the named tuple's own __new__ adds a call per simulated step)
        return tuple.__new__(cls, (num_reqs, tokens, decodes, ptok, pattn, pkv, dkv,
                                   num_sampled))

    @classmethod
    def from_plan(cls, plan: Any) -> StepShape:
        """From a ``SchedulerOutput``: ``num_scheduled_tokens``, ``num_computed_tokens`` (the
        context of every scheduled request) and ``sampling_req_ids``. One pass, no numpy."""
        scheduled = plan.num_scheduled_tokens
        # The pairs straight from the dicts (same keys in the same order, as the plan says).
        return cls._from_pairs(zip(scheduled.values(), plan.num_computed_tokens.values()),
                               len(scheduled), len(plan.sampling_req_ids))

    def to_row(self) -> tuple[int, ...]:
        """The fields in ``STEP_FIELDS`` order (a profile's sample row, before the seconds)."""
        return tuple(self)

    @classmethod
    def from_row(cls, row: Sequence[int]) -> StepShape:
        return cls(*(int(v) for v in row))


STEP_FIELDS: tuple[str, ...] = StepShape._fields
# The engine's step phases (StepStats.timings) calibration records per step, and those of them
# that are the device's part (the executor's, in order step after step); the host's part is the
# rest of the step's measured time (see the module docstring).
PHASES: tuple[str, ...] = ("schedule", "prepare_inputs", "forward", "sample", "update")
DEVICE_PHASES: tuple[str, ...] = ("prepare_inputs", "forward", "sample")


def feature_matrix(shapes: Sequence[StepShape]) -> np.ndarray:
    """``len(shapes) x len(STEP_FIELDS)`` float64 array of the shapes' rows."""
    return np.array([s.to_row() for s in shapes], dtype=np.float64).reshape(-1, len(STEP_FIELDS))


def fit_diagnostics(pred: np.ndarray, t: np.ndarray, n_params: int) -> dict[str, Any]:
    rel = np.abs(pred - t) / t
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((pred - t) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return {"n_samples": int(t.size), "n_params": n_params,
            "mean_abs_pct_err": 100.0 * float(rel.mean()),
            "max_abs_pct_err": 100.0 * float(rel.max()), "r2": r2}


def check_samples(shapes: Sequence[StepShape], seconds: Sequence[float],
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


def nnls_relative(X: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Non-negative coefficients ``c`` minimising the sum of squared *relative* errors
    ``(X @ c - t) / t``. Returns ``c``, which columns were fitted (a column zero in every row
    gets 0) and the rank of the scaled system. Columns are scaled to unit norm before solving
    (features span ten orders of magnitude) and unscaled after."""
    from scipy.optimize import nnls

    A = X / t[:, None]
    norms = np.sqrt(np.sum(A * A, axis=0))
    active = norms > 0
    As = A[:, active] / norms[active]
    x, _ = nnls(As, np.ones_like(t), maxiter=50 * As.shape[1])
    coef = np.zeros(X.shape[1])
    coef[active] = x / norms[active]
    return coef, active, int(np.linalg.matrix_rank(As)) if As.size else 0


# --------------------------------------------------------------------------- cost models
class CostModel(ABC):
    """Predicts the wall time of one engine step from its ``StepShape``."""

    type: ClassVar[str]
    diagnostics: dict[str, Any]

    @abstractmethod
    def predict(self, shape: StepShape) -> float:
        """Seconds the step takes; never negative."""

    def predict_host(self, shape: StepShape) -> float:
        """The host's part of ``predict(shape)`` as this model knows it by itself: what
        overlapped steps hide under the previous step's device time. The default, 0, says the
        whole step is the device's (a fitted step model alone cannot tell; a profile's
        ``host_model`` does)."""
        return 0.0

    def predict_parts(self, shape: StepShape) -> tuple[float, float]:
        """``(predict(shape), predict_host(shape))``, in one pass where a model can (the
        simulator asks once per overlapped step)."""
        return self.predict(shape), self.predict_host(shape)

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with ``"type"``; ``cost_model_from_json`` reads it back."""


def json_number(d: Mapping[str, Any], key: str, *, nonneg: bool = True) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key}: must be a finite number, got {v!r}")
    if nonneg and v < 0:
        raise ValueError(f"{key}: must be >= 0, got {v!r}")
    return float(v)


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
        prefill steps would dominate and a short decode step could be off by half at little
        cost, yet decode steps are most of a serving run's steps. Columns are scaled
        to unit norm before solving (features span ten orders of magnitude) and unscaled
        after. A column that is zero in every sample (e.g. no prefills measured) gets
        coefficient 0 and is listed in ``diagnostics["unfitted"]``; ``diagnostics["rank"]``
        below ``n_params`` means some coefficients are not separately determined by the data
        (e.g. no partial prefill chunks, so ``per_sample`` cannot be told from ``per_req``):
        the predictions for shapes like the measured ones remain good.
        """
        knots = tuple(int(k) for k in knots) if knots is not None else (
            cls.default_knots([s.num_tokens for s in shapes]) if shapes else (1,))
        n_params = len(knots) + len(cls.COEFS)
        t = check_samples(shapes, seconds, n_params)
        X = cls.design_matrix(shapes, knots)
        coef, active, rank = nnls_relative(X, t)
        m = len(knots)
        names = ["base", "per_req", *(f"g[{k}]" for k in knots), "a_prefill", "a_prefill_kv",
                 "a_decode", "per_sample"]
        diag = fit_diagnostics(X @ coef, t, n_params)
        diag["rank"] = rank
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
        return cls(**{n: json_number(d, n) for n in cls.COEFS}, knots=knots, knot_values=vals,
                   diagnostics=diag)

    def __repr__(self) -> str:
        coefs = ", ".join(f"{n}={getattr(self, n):.3g}" for n in self.COEFS)
        return f"FittedCostModel({coefs}, knots={list(self.knots)})"


class HostCostModel(CostModel):
    """The host's part of a step (the engine loop's: planning, the update, the runner's work
    between steps; see the module docstring), fitted to measured steps::

        t_host = base + per_req*num_reqs + per_token*num_tokens + per_sample*num_sampled

    Linear in what the loop handles: a fixed cost per step, each scheduled request (planning,
    the update, its output), each token (block allocation) and each sampled row (a new token
    appended, checked for stops, handed out). Non-negative coefficients, one NNLS on relative
    error as ``FittedCostModel.fit``."""

    type = "host-linear"
    COEFS: ClassVar[tuple[str, ...]] = ("base", "per_req", "per_token", "per_sample")

    def __init__(self, *, base: float, per_req: float, per_token: float, per_sample: float,
                 diagnostics: dict[str, Any] | None = None) -> None:
        self.base, self.per_req = float(base), float(per_req)
        self.per_token, self.per_sample = float(per_token), float(per_sample)
        self.diagnostics = dict(diagnostics or {})
        for name in self.COEFS:
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")

    def predict(self, shape: StepShape) -> float:
        return (self.base + self.per_req * shape.num_reqs + self.per_token * shape.num_tokens
                + self.per_sample * shape.num_sampled)

    def predict_host(self, shape: StepShape) -> float:
        return self.predict(shape)

    @staticmethod
    def design_matrix(shapes: Sequence[StepShape]) -> np.ndarray:
        """Columns: 1, num_reqs, num_tokens, num_sampled."""
        f = feature_matrix(shapes)
        return np.column_stack([np.ones(len(f)), f[:, 0], f[:, 1], f[:, 7]])

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float]) -> HostCostModel:
        """Fit to measured host times (each step's measured time less its device phases)."""
        t = check_samples(shapes, seconds, len(cls.COEFS))
        X = cls.design_matrix(shapes)
        coef, active, rank = nnls_relative(X, t)
        diag = fit_diagnostics(X @ coef, t, len(cls.COEFS))
        diag["rank"] = rank
        diag["unfitted"] = [n for n, a in zip(cls.COEFS, active) if not a]
        return cls(**dict(zip(cls.COEFS, coef.tolist())), diagnostics=diag)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, **{n: getattr(self, n) for n in self.COEFS},
                "diagnostics": self.diagnostics}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HostCostModel:
        diag = d.get("diagnostics", {})
        if not isinstance(diag, dict):
            raise ValueError(f"diagnostics: must be an object, got {diag!r}")
        return cls(**{n: json_number(d, n) for n in cls.COEFS}, diagnostics=diag)

    def __repr__(self) -> str:
        coefs = ", ".join(f"{n}={getattr(self, n):.3g}" for n in self.COEFS)
        return f"HostCostModel({coefs})"


class OverlappedCostModel(CostModel):
    """A step's time when the engine overlaps steps (``scheduler.async_scheduling``): the host
    part of step N+1 runs while the device runs step N, so in a steady stream a step costs
    ``max(host, device)`` instead of their sum.

    ``split(shape)`` cuts the step model's time ``t`` (the synchronous step, as calibrated)
    into ``host = min(h, t)`` and ``device = t - host``, ``h`` being the host model's
    prediction, or the step model's own ``predict_host`` without one (a roofline's overhead
    terms; 0 for a fitted step model alone, which then predicts no gain). So ``host + device``
    is always the synchronous step, and the overlapped one never costs more."""

    type = "overlapped"

    def __init__(self, step: CostModel, host: CostModel | None = None) -> None:
        self.step, self.host = step, host
        self.diagnostics: dict[str, Any] = {}
        self._host = (host or step).predict_host

    def split(self, shape: StepShape) -> tuple[float, float]:
        """``(host, device)`` seconds of the step; they add up to ``step.predict(shape)``."""
        if self.host is None:
            t, h = self.step.predict_parts(shape)
        else:
            t, h = self.step.predict(shape), self.host.predict_host(shape)
        h = t if h > t else h if h > 0.0 else 0.0
        return h, t - h

    def predict(self, shape: StepShape) -> float:
        t = self.step.predict(shape)
        h = self._host(shape)
        h = t if h > t else h if h > 0.0 else 0.0
        d = t - h
        return h if h > d else d

    def predict_host(self, shape: StepShape) -> float:
        return self.split(shape)[0]

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "step": self.step.to_json(),
                "host": None if self.host is None else self.host.to_json()}

    def __repr__(self) -> str:
        return f"OverlappedCostModel({self.step!r}, host={self.host!r})"
