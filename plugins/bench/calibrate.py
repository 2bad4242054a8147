"""``corellm bench calibrate``: measure a config's step times and fit the ``sim`` executor's cost
model, or derive one from a device's published peaks (a roofline what-if).

Measuring runs the real engine (the config as given: model, dtype, device, attention backend,
scheduler limits) through a designed set of workloads, each through the same offline runner as
``corellm bench`` (``drive_engine``), so what is timed is what a benchmark run spends per step:

* **prefill sweep**: one prompt of each size from 16 tokens to the step's token budget (longer
  prompts are chunked by the scheduler, giving chunked prefills over a cached context);
* **decode grid**: batches of 1 to ``max_num_seqs`` requests at several context lengths, each
  decoding for a few steps;
* **mixed**: requests arriving while others decode (prefill chunks and decodes in one step).

Every step's plan (``costmodel.StepShape``: tokens, decodes, attention work) is recorded
with the time from the end of the previous step to the end of this one when the loop was busy
(so the runner's own per-step work between steps is priced too), or the step alone after an idle
wait, and with the engine's phase times (``StepStats.timings``). ``FittedCostModel.fit`` fits
the step times; ``HostCostModel.fit`` the host part of each (the time less the device phases,
``prepare_inputs``, ``forward`` and ``sample``: what overlapped steps hide). The engine is
measured with ``scheduler.async_scheduling`` off, whatever the config says: overlapped, the
host and device parts of a step could not be told apart. The profile records the model, dtype,
device and corellm version, and the sim executor refuses it for anything else.
"""

from __future__ import annotations

import datetime as _dt
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .workload import BenchRequest, Workload
from .costmodel import DEVICE_PHASES, PHASES, FittedCostModel, HostCostModel, StepShape
from .devices import DEVICES
from .model_shape import ModelShape, model_fingerprint
from .profile import Profile
from .roofline import RooflineCostModel

PROFILE_DATE_FORMAT = "%Y-%m-%dT%H:%M:%S%z"


def log(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _geometric(lo: int, hi: int, factor: float = 2.0) -> list[int]:
    out, v = [], float(lo)
    while v < hi:
        out.append(int(v))
        v *= factor
    out.append(hi)
    return sorted(set(x for x in out if lo <= x <= hi))


@dataclass(frozen=True)
class Design:
    """The designed workloads, sized from the engine's limits."""

    prefill_sizes: list[int]
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_steps: int
    repeats: int
    mixed_requests: int

    pool_tokens: int = 1 << 62

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   quick: bool = False, pool_tokens: int = 1 << 62) -> Design:
        top_prefill = min(max_num_batched_tokens * 2, max_model_len - 8, pool_tokens - 8)
        longest_ctx = min(max_model_len // 2, 2048, pool_tokens // 2)
        batches = _geometric(1, max_num_seqs)
        contexts = _geometric(16, max(16, longest_ctx), 4.0)
        if quick:
            batches = batches[::2] if len(batches) > 3 else batches
            contexts = contexts[::2] if len(contexts) > 2 else contexts
        return cls(prefill_sizes=_geometric(16, max(16, top_prefill), 2.0 if quick else 1.5),
                   decode_batches=batches, decode_contexts=contexts,
                   decode_steps=4 if quick else 8, repeats=1 if quick else 2,
                   mixed_requests=min(2 * max_num_seqs, 16 if quick else 64),
                   pool_tokens=pool_tokens)

    def workloads(self, vocab_size: int, seed: int = 0) -> list[Workload]:
        rng = random.Random(seed)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(10, vocab_size) for _ in range(n)]

        out = []
        for _ in range(self.repeats):
            # Prefill sweep: each prompt alone (all at once, but the scheduler's budget splits
            # the large ones into chunks over a cached context).
            for p in self.prefill_sizes:
                out.append(Workload([BenchRequest(0, prompt(p), 1)], f"prefill {p}"))
            for c in self.decode_contexts:
                for b in self.decode_batches:
                    if b * (c + self.decode_steps + 16) > self.pool_tokens:
                        continue            # would preempt: not the step being measured
                    # A prompt per request, never shared: decodes over shared KV blocks read
                    # the same memory (cache-friendly) and would not price a real batch.
                    reqs = [BenchRequest(i, prompt(c), self.decode_steps + 1) for i in range(b)]
                    out.append(Workload(reqs, f"decode {b}x{c}"))
        # Mixed: arrivals spread over time, so prefill chunks join running decodes.
        reqs = []
        for i in range(self.mixed_requests):
            size = rng.choice(self.prefill_sizes[:max(1, len(self.prefill_sizes) * 2 // 3)])
            reqs.append(BenchRequest(i, prompt(size), rng.randint(4, 4 * self.decode_steps),
                                     delay_s=i * 0.01))
        out.append(Workload(reqs, "mixed"))
        return out


class _PlanRecorder:
    """Stands in front of the engine's executor and records each step's shape."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shapes: list[StepShape] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute_model(self, plan: Any) -> Any:
        if plan.total_num_scheduled_tokens:
            self.shapes.append(StepShape.from_plan(plan))
        return self.inner.execute_model(plan)

    def shutdown(self) -> None:
        self.inner.shutdown()


# A step that starts within this long of the previous one's end was busy-looped into: its
# time is taken from the previous end (the runner's work between steps included).
_BUSY_GAP_S = 0.005


def measure(llm: Any, design: Design, *, progress: bool = True,
            on_workload: Callable[[str], None] | None = None,
            ) -> tuple[list[StepShape], list[float], list[str], list[dict[str, float]]]:
    """Run the design through ``llm`` (an in-process ``LLM``); returns one shape, one time,
    the workload's name and the engine's phase times (``StepStats.timings``) per step."""
    from .engine_driver import drive_engine
    from .targets import RunOptions

    engine = llm.engine
    recorder = _PlanRecorder(engine.executor)
    engine.executor = recorder
    # (end, duration, index in shapes, phase times)
    ends: list[tuple[float, float, int, dict[str, float]]] = []

    def on_stats(stats: Any) -> None:
        if stats.kind == "step":
            ends.append((time.perf_counter(), stats.duration, len(recorder.shapes) - 1,
                         dict(stats.timings)))

    engine.add_stats_listener(on_stats)
    shapes: list[StepShape] = []
    seconds: list[float] = []
    groups: list[str] = []
    phases: list[dict[str, float]] = []
    opts = RunOptions(warmup_requests=0, progress=False)
    workloads = design.workloads(llm.model_info.vocab_size)
    from tqdm.auto import tqdm
    bar = tqdm(total=len(workloads), desc="calibrating", unit="workload", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        # Warm-up: the first steps pay one-time costs (allocations, kernel selection).
        drive_engine(llm, design.workloads(llm.model_info.vocab_size, seed=1)[0], opts,
                     salt="calibrate-warmup", progress=False)
        for i, wl in enumerate(workloads):
            if on_workload:
                on_workload(wl.description)
            ends.clear()
            start_shapes = len(recorder.shapes)
            drive_engine(llm, wl, opts, salt=f"calibrate-{i}", progress=False)
            prev_end = None
            for end, duration, idx, timings in ends:
                if idx < start_shapes:
                    continue
                busy = prev_end is not None and (end - duration) - prev_end < _BUSY_GAP_S
                shapes.append(recorder.shapes[idx])
                seconds.append(end - prev_end if busy else duration)
                groups.append(wl.description.split(" ")[0])
                phases.append(timings)
                prev_end = end
            bar.update(1)
    finally:
        bar.close()
        engine.executor = recorder.inner
        engine._stats_listeners.remove(on_stats)
    return shapes, seconds, groups, phases


def device_description() -> dict[str, Any]:
    from .env import environment
    env = environment()
    if env.get("gpus"):
        return {"kind": env.get("accelerator_kind", "cuda"), "name": env["gpus"][0]}
    simd = [f for f in env.get("cpu_simd", []) if f.startswith(("avx512", "amx", "avx2"))]
    isa = "amx" if any(f.startswith("amx") for f in simd) else (
        "avx512" if any(f.startswith("avx512") for f in simd) else "avx2" if simd else "")
    cores = env.get("cpu_affinity") or env["cpu_count"]
    return {"kind": "cpu", "name": f"{env['cpu_model']} ({cores} cores{', ' + isa if isa else ''})",
            "torch_threads": env.get("torch_threads")}


def _model_facts(config: Any, registry: Any) -> tuple[str, Any, ModelShape]:
    from corellm.checkpoint.reader import (checkpoint_name, model_path, parse_arch_config,
                                      read_checkpoint_config)
    path = model_path(config)
    cfg, source = read_checkpoint_config(path)
    arch, _ = parse_arch_config(cfg, source, registry,
                                       config.model.implementation)
    return checkpoint_name(config.model.path), arch, ModelShape.from_arch(arch)


def _engine_context(config: Any, attention: str | None = None) -> dict[str, Any]:
    """The engine settings a profile was measured with (``attention``: the backend the workers
    run, which ``attention.name: auto`` leaves to them)."""
    s = config.scheduler
    return {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "enable_chunked_prefill": s.enable_chunked_prefill,
            "attention": attention or config.attention.name, "executor": config.executor.name,
            "block_size": config.kv_cache.block_size,
            "async_scheduling": getattr(s, "async_scheduling", None)}


def calibrate(config: Any, *, quick: bool = False, progress: bool = True) -> tuple[Profile, dict]:
    """Measure ``config`` (anything ``LLM`` accepts) on this machine and fit a profile. Returns
    the profile and a report: per workload group, the measured and predicted mean step time."""
    import corellm
    from corellm.engine.llm import LLM

    # Synchronous steps: the host and device parts of each are measured one after the other.
    llm = LLM(config, async_scheduling=False)
    try:
        if llm.engine is None or getattr(llm.engine.executor, "clock", None) is not None:
            raise ValueError("calibration needs a real in-process executor (the config's "
                             f"executor is {llm.config.executor.name!r})")
        cfg = llm.config
        s = cfg.scheduler
        kv = llm.engine.kv_cache_manager
        design = Design.for_limits(s.max_num_seqs, s.max_num_batched_tokens,
                                   llm.model_info.max_model_len, quick=quick,
                                   pool_tokens=kv.num_blocks * kv.block_size)
        t0 = time.perf_counter()
        shapes, seconds, groups, timings = measure(llm, design, progress=progress)
        took = time.perf_counter() - t0
        name, arch, mshape = _model_facts(cfg, llm.registry)
        device = device_description()
        dtype = llm.engine.setup.dtype
        attention = llm.engine.executor.collective_rpc("describe")[0]["attention"]
    finally:
        llm.shutdown()
    model = FittedCostModel.fit(shapes, seconds)
    phase_rows = Profile.make_phase_rows(timings, PHASES)
    host = HostCostModel.fit(shapes, Profile.host_seconds(seconds, phase_rows))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    profile = Profile(
        kind="measured",
        model={"name": name, "architecture": (arch.architectures or ("?",))[0],
               "fingerprint": model_fingerprint(arch)},
        dtype=dtype, device=device, corellm_version=corellm.__version__,
        created=_dt.datetime.now().astimezone().strftime(PROFILE_DATE_FORMAT),
        block_size=cfg.kv_cache.block_size,
        kv_bytes_per_block=mshape.kv_bytes_per_token(dtype_bytes) * cfg.kv_cache.block_size,
        engine=_engine_context(cfg, attention), cost_model=model, host_model=host,
        device_phases=list(DEVICE_PHASES), phases=list(PHASES), sample_phases=phase_rows,
        samples=Profile.make_samples(shapes, seconds),
        notes=[f"{len(shapes)} steps measured in {took:.1f} s ({'quick' if quick else 'full'} "
               "design), steps not overlapped"])
    return profile, fit_report(model, shapes, seconds, groups, host=host,
                               host_seconds=profile.host_data()[1])


def fit_report(model: Any, shapes: Sequence[StepShape], seconds: Sequence[float],
               groups: Sequence[str], *, host: Any = None,
               host_seconds: Sequence[float] | None = None) -> dict[str, Any]:
    """Per group of steps: count, measured and predicted mean step time, mean |error|; with a
    host model and the measured host times, their means too, and the mean predicted step when
    steps overlap (``max(host, device)``)."""
    from .costmodel import OverlappedCostModel

    overlapped = OverlappedCostModel(model, host) if host is not None else None
    hs = list(host_seconds) if host_seconds else [math.nan] * len(shapes)
    by: dict[str, list[tuple[float, float, float, float, float]]] = {}
    for sh, t, g, h in zip(shapes, seconds, groups, hs):
        ph, po = ((overlapped.split(sh)[0], overlapped.predict(sh)) if overlapped is not None
                  else (math.nan, math.nan))
        by.setdefault(g, []).append((t, model.predict(sh), h, ph, po))
    by["all"] = [row for rows in list(by.values()) for row in rows]
    out = {}
    for g, rows in by.items():
        n = len(rows)
        meas = sum(r[0] for r in rows) / n
        pred = sum(r[1] for r in rows) / n
        out[g] = {"steps": n, "measured_ms": meas * 1e3, "predicted_ms": pred * 1e3,
                  "total_error_pct": 100 * (pred - meas) / meas,
                  "mean_abs_error_pct": 100 * sum(abs(p - t) / t for t, p, *_ in rows) / n}
        if overlapped is not None:
            out[g]["host_predicted_ms"] = 1e3 * sum(r[3] for r in rows) / n
            out[g]["overlapped_predicted_ms"] = 1e3 * sum(r[4] for r in rows) / n
            if host_seconds:
                out[g]["host_measured_ms"] = 1e3 * sum(r[2] for r in rows) / n
    return out


def roofline_profile(config: Any, device_key: str, *, dtype: str | None = None,
                     efficiencies: Mapping[str, float] | None = None) -> Profile:
    """A what-if profile: ``config``'s model (its ``config.json``; no weights are read) on the
    device ``device_key`` of ``corellm_plugins.bench.devices.DEVICES``, priced by a roofline."""
    import corellm
    from corellm.engine.llm import build_config
    from corellm.checkpoint.reader import resolve_dtype_name

    if device_key not in DEVICES:
        raise ValueError(f"unknown device {device_key!r}; known: {', '.join(sorted(DEVICES))}")
    device = DEVICES[device_key]
    cfg, registry = build_config(config, None, ())
    name, arch, mshape = _model_facts(cfg, registry)
    dtype = dtype or resolve_dtype_name(cfg.model.dtype, arch)
    if dtype not in device.peak_flops:
        raise ValueError(f"{device.name} has no published peak for {dtype}; known: "
                         f"{', '.join(device.peak_flops)}")
    model = RooflineCostModel(mshape, device, dtype, **dict(efficiencies or {}))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return Profile(
        kind="roofline",
        model={"name": name, "architecture": (arch.architectures or ("?",))[0],
               "fingerprint": model_fingerprint(arch)},
        dtype=dtype, device={"kind": device.kind, "name": f"{device.name} (roofline)",
                             "key": device_key},
        corellm_version=corellm.__version__,
        created=_dt.datetime.now().astimezone().strftime(PROFILE_DATE_FORMAT),
        block_size=cfg.kv_cache.block_size,
        kv_bytes_per_block=mshape.kv_bytes_per_token(dtype_bytes) * cfg.kv_cache.block_size,
        engine=_engine_context(cfg), cost_model=model, samples=[],
        notes=[f"derived from {device.name}'s published peaks ({device.source}); not measured",
               "host part of a step (hidden by overlapped steps): the assumed overhead_s + "
               "per_req_s*num_reqs; the device part: the roof"])


def print_report(report: Mapping[str, Mapping[str, float]], file: Any = None) -> None:
    file = file or sys.stdout
    split = all("host_predicted_ms" in r for r in report.values()) and bool(report)
    measured_host = split and all("host_measured_ms" in r for r in report.values())
    extra = (f" {'host ms':>8} {'host pred':>9} {'overlap pred':>12}" if measured_host else
             f" {'host pred':>9} {'overlap pred':>12}" if split else "")
    print(f"{'steps of':<10} {'count':>6} {'measured ms':>12} {'predicted ms':>13} "
          f"{'total err %':>12} {'mean |err| %':>13}{extra}", file=file)
    for g, r in report.items():
        more = ""
        if split:
            more = (f" {r['host_measured_ms']:>8.3f}" if measured_host else "") + \
                f" {r['host_predicted_ms']:>9.3f} {r['overlapped_predicted_ms']:>12.3f}"
        print(f"{g:<10} {r['steps']:>6} {r['measured_ms']:>12.3f} {r['predicted_ms']:>13.3f} "
              f"{r['total_error_pct']:>+12.1f} {r['mean_abs_error_pct']:>13.1f}{more}",
              file=file)


def plot_fit(profile: Profile, path: str | Path) -> None:
    """Measured against predicted step time, one point per calibration step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meas, pred = [], []
    for shape, t in zip(*profile.sample_data()):
        meas.append(t * 1e3)
        pred.append(profile.cost_model.predict(shape) * 1e3)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(meas, pred, s=6, alpha=0.5)
    hi = max(meas + pred) if meas else 1.0
    lo = max(min(meas + pred), 1e-3) if meas else 1e-3
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(f"{profile.model['name']} on {profile.device['name']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line
CLI_EPILOG = """\
examples:
  corellm bench calibrate --config cfg.yaml -o cpu.json --plot cpu-fit.png
  corellm bench --config fcfs=sim-fcfs.yaml --config prio=sim-prio.yaml --workload w.yaml
      (sim-*.yaml: the same config with executor: {name: sim, profile: cpu.json})
  corellm bench calibrate --config qwen3.yaml --roofline h100-sxm --dtype bfloat16 -o h100.json
"""


def add_calibrate_subcommand(subparsers: Any) -> Any:
    from .cli_common import HelpFormatter, plain
    p = subparsers.add_parser(
        "calibrate", help="measure step times and fit the sim executor's cost model",
        description=plain(__doc__), epilog=CLI_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE",
                   help="the engine config to measure (the sim executor's config must name the "
                        "same model and dtype; it simulates the profile's device wherever it "
                        "runs)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json",
                   help="where to write the profile")
    p.add_argument("--quick", action="store_true",
                   help="a smaller design (fewer sizes, one repeat): a rougher fit, faster")
    p.add_argument("--roofline", metavar="DEVICE", choices=sorted(DEVICES),
                   help="derive the profile from DEVICE's published peaks instead of measuring "
                        f"(one of: {', '.join(sorted(DEVICES))}); reads only config.json")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="with --roofline: the dtype to price (default: the config's)")
    p.add_argument("--plot", metavar="PNG", help="measured vs predicted step times")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: Any) -> int:
    if args.roofline:
        profile = roofline_profile(args.config, args.roofline, dtype=args.dtype)
        profile.save(args.output)
        log(f"wrote {args.output}: {profile.model['name']} ({profile.dtype}) on "
            f"{profile.device['name']}")
        return 0
    if args.dtype:
        log("--dtype is only for --roofline; the measured dtype is the config's")
        return 2
    profile, report = calibrate(args.config, quick=args.quick, progress=args.progress)
    profile.save(args.output)
    print(f"# step-time fit: {profile.model['name']} ({profile.dtype}) on "
          f"{profile.device['name']}")
    print_report(report)
    for what, m in (("fit", profile.cost_model), ("host fit", profile.host_model)):
        diag = getattr(m, "diagnostics", {}) or {}
        if diag:
            print(f"# {what}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float)
                                            else f"{k} {v}" for k, v in diag.items()))
    if profile.host_model is not None:
        print(f"# host part of a step (overlapped steps hide it): {profile.host_model!r}; "
              f"device phases: {', '.join(profile.device_phases)}")
    if args.plot:
        plot_fit(profile, args.plot)
        log(f"wrote {args.plot}")
    log(f"wrote {args.output}")
    return 0
