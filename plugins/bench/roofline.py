"""The roofline cost model: a step's time from a model's shape and a device's peak figures.

For hardware what-ifs (``corellm bench calibrate --roofline DEVICE``): it needs no measurement,
only a ``ModelShape`` and a ``DeviceSpec``; and it is fittable to measured steps, to validate its
form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .costmodel import CostModel, StepShape, check_samples, fit_diagnostics, json_number
from .devices import DeviceSpec
from .model_shape import ModelShape, dtype_bytes, dtype_name

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

    Overlapped steps (``scheduler.async_scheduling``) cost ``max(overhead_s +
    per_req_s*num_reqs, roof)``: the additive terms are the host's (``predict_host``), the
    roof the device's.

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
        return self.predict_parts(shape)[0]

    def predict_parts(self, shape: StepShape) -> tuple[float, float]:
        # compute_time and memory_time inlined, term for term (the same floats): once per
        # simulated step.
        n = shape.num_sampled
        compute = (self._f_tok * shape.num_tokens + self._f_head * n
                   + self._f_attn * (shape.prefill_attn + shape.decode_kv)
                   ) / (self.peak_flops * self.compute_eff)
        memory = (self._b_body + (self._b_head if n else 0.0)
                  + self._b_kv * (shape.prefill_kv + shape.decode_kv + shape.num_tokens)
                  ) / (self.device.mem_bw * self.bw_eff)
        host = self.overhead_s + self.per_req_s * shape.num_reqs
        return host + (compute if compute >= memory else memory), host

    def predict_host(self, shape: StepShape) -> float:
        """The additive terms, ``overhead_s + per_req_s*num_reqs``: the step's fixed and
        per-request host work (planning, input preparation, bookkeeping), which overlapped
        steps hide under the previous step's device time; the device's part is the roof.
        Assumed constants, as the defaults say, unless ``fit`` measured them."""
        return self.overhead_s + self.per_req_s * shape.num_reqs

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], model: ModelShape,
            device: DeviceSpec, dtype: str = "bfloat16") -> RooflineCostModel:
        """Fit compute_eff, bw_eff (in (0, 1]), overhead_s and per_req_s (>= 0) to measured
        steps by bounded least squares on relative error (see ``FittedCostModel.fit`` for why
        relative), from a few starting points (the ``max`` makes the problem non-smooth). An
        efficiency that no measured step is bound by is not determined: compare
        ``diagnostics["compute_bound"]`` / ``["memory_bound"]`` (sample counts)."""
        from scipy.optimize import least_squares

        t = check_samples(shapes, seconds, 4)
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
        diag = fit_diagnostics(pred(x), t, 4)
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
        return cls(model, device, d["dtype"], compute_eff=json_number(d, "compute_eff"),
                   bw_eff=json_number(d, "bw_eff"), overhead_s=json_number(d, "overhead_s"),
                   per_req_s=json_number(d, "per_req_s"), diagnostics=diag)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.device.name}, {self.dtype}, compute_eff="
                f"{self.compute_eff:.3g}, bw_eff={self.bw_eff:.3g}, overhead_s="
                f"{self.overhead_s:.3g}, per_req_s={self.per_req_s:.3g})")
