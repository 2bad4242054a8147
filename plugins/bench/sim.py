"""The simulated executor: no model, a calibrated step time, virtual time.

``executor: {name: sim, profile: PATH}`` replaces the forward pass with the step time a cost
model predicts from the step plan (``costmodel``, ``roofline``): the profile is measured on real
hardware by ``corellm bench calibrate`` or derived from a device's published peaks (a roofline).
Everything else is the real engine: the configured scheduler and policy, the KV-cache manager
and its prefix cache, preemption, the output path and ``corellm bench``. Each step the engine's
clock (a ``VirtualClock`` this executor owns) advances by the predicted time, so hours of
traffic take seconds and every metric comes out as if measured on the profiled hardware.

The executor keeps no per-request state: the plan says how many tokens each request computes,
how many it has computed and which requests sample (``SchedulerOutput.num_computed_tokens`` and
``sampling_req_ids``). It reads only the checkpoint's ``config.json`` (never its weights) to
check the profile is the model's and to size the KV pool as the real engine would. Sampled
tokens are synthetic (one fixed, non-special id), so requests end by ``max_tokens`` (as with
``ignore_eos``), never by an EOS the model would have produced.

**Overlapped steps.** With ``scheduler.async_scheduling`` on, ``max_concurrent_batches`` is 2
and the engine plans step N+1 while the executor runs step N; off, 1, and a step costs the whole
step as calibrated (``host + device``). Left out (None), overlap follows the profiled device:
on for a GPU (or any accelerator), where the host plans while the device computes, off for a
CPU, where the engine loop and the model share the cores (``default_overlap``, as the
platforms' defaults). Overlapped, ``execute_model`` returns a future whose output is decided at
once but whose time passes on the clock when the engine waits for it (``result()``), as a
device's would, so step N's tokens are stamped at step N's end though step N+1 was launched
before them. That step costs ``max(host, device)`` of its calibrated parts
(``costmodel.OverlappedCostModel``) when the engine launched another step before waiting for
it (the next step's host work ran under its device work), else ``host + device``: the last step
of a busy stretch, and every step the engine runs one at a time though the executor could
overlap (a scheduler that cannot plan ahead, a request a logits processor constrains).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any


from corellm.kv.block_pool import num_blocks_for_budget
from corellm.clock import VirtualClock
from corellm.components import BuildContext
from corellm.errors import ConfigError
from corellm.interfaces import Executor, ModelInfo
from corellm.checkpoint.reader import checkpoint_name, resolve_dtype_name
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.config.setup import resolve_setup

from .costmodel import CostModel, OverlappedCostModel, StepShape
from .model_shape import model_fingerprint
from .options import SimOptions
from .profile import Profile

EMPTY = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
logger = logging.getLogger(__name__)


def default_overlap(profile: Profile) -> bool:
    """Whether simulated steps overlap when ``scheduler.async_scheduling`` is left out: as the
    profiled device would, on for a GPU or other accelerator (the host plans step N+1 while
    the device computes step N), off for a CPU (the host's work would take cores from the
    model's)."""
    return str(profile.device.get("kind", "cpu")).split(":")[0] != "cpu"


def _special_ids(raw: dict) -> set[int]:
    ids: set[int] = set()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = raw.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return ids


class _PricedStep(Future):
    """A simulated step the engine has launched but not yet waited for (overlapped steps): its
    output is decided, and its time passes on the executor's clock at the first ``result()``
    (or ``exception()``, ``add_done_callback``), in the order the engine waits for its steps:
    ``max(host, device)`` if the engine has launched a step since this one, else their sum.

    A ``Future`` for the engine's ``isinstance`` test, without one's lock and condition (a
    few microseconds a step, which a simulated run of 100,000 steps would feel): it answers
    the calls above and ``done()`` (True: nothing is left to compute), not
    ``concurrent.futures.wait`` or ``as_completed``."""

    def __init__(self, executor: SimExecutor, host: float, device: float,  # no Future.__init__
                 output: ModelRunnerOutput) -> None:
        self._executor, self._host, self._device, self._output = executor, host, device, output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        executor = self._executor
        if executor is not None:
            self._executor = None
            h, d = self._host, self._device
            if executor._last_launched is self:     # nothing planned while it ran
                seconds = h + d
            else:
                seconds = h if h > d else d
                executor.num_overlapped_steps += 1
            executor.simulated_s += seconds
            self._output.timings["forward"] = seconds
            clock = executor.clock              # executor._pass(seconds), inlined
            if clock is not None:
                clock.advance(seconds)
            else:
                time.sleep(seconds)
        return self._output

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.result()
        return None

    def add_done_callback(self, fn: Any) -> None:
        self.result()
        fn(self)

    def done(self) -> bool:
        return True

    def running(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def __repr__(self) -> str:
        state = "pending" if self._executor is not None else "passed"
        return (f"<simulated step: host {self._host:.6g} s, device {self._device:.6g} s, "
                f"{state}>")


class SimExecutor(Executor):
    def __init__(self, options: SimOptions, ctx: BuildContext) -> None:
        config = ctx.config
        setup = ctx.setup or resolve_setup(config, ctx.registry)
        path, arch = setup.model_path, setup.arch
        self.profile = profile = Profile.load(options.profile)
        # The simulated device is the profile's, whatever platform this machine has: a profile
        # measured on a GPU is simulated on a laptop. model.dtype auto follows the checkpoint,
        # and a float16 one runs in float32 on a CPU (the CPU platform's rule).
        kind = str(profile.device.get("kind", "cpu"))
        dtype = resolve_dtype_name(config.model.dtype, arch)
        if config.model.dtype == "auto" and kind == "cpu" and dtype == "float16":
            dtype = "float32"
        profile.check_compatible(checkpoint_name(path), model_fingerprint(arch), dtype, None)
        asked = getattr(config.scheduler, "async_scheduling", None)
        #: Steps overlap: each costs max(host, device) of the profile's split, and the engine
        #: may have two in this executor at once.
        self.overlap = default_overlap(profile) if asked is None else bool(asked)
        self.step_model: CostModel = profile.cost_model        # a synchronous step
        # Overlapped: each step's host and device parts (max() when another step is planned
        # while it runs, else their sum, the step model's price).
        self.overlapped: OverlappedCostModel | None = (
            profile.overlapped_cost_model() if self.overlap else None)
        self.cost_model: CostModel = self.overlapped or profile.cost_model
        if self.overlap and not profile.has_host_split:
            logger.warning(
                "%s: this measured profile has no host model (the host/device split of a "
                "step; profiles of format version 1 have none), so a step's host part is "
                "taken as 0 and overlapped steps cost what synchronous ones do; run corellm "
                "bench calibrate again to price the overlap", options.profile)
        self._model_info = ModelInfo(
            vocab_size=arch.vocab_size,
            max_model_len=setup.max_model_len,
            architecture=(arch.architectures or ("?",))[0])
        # The real engine's KV bytes per token (measured by calibration), for this block size.
        per_token = profile.kv_bytes_per_block / profile.block_size
        self._kv = config.kv_cache
        self.kv_bytes_per_block = max(1, round(per_token * config.kv_cache.block_size))
        self.clock = VirtualClock() if options.clock == "virtual" else None
        if options.token_id is not None:
            if options.token_id >= arch.vocab_size:
                raise ConfigError([("executor.token_id", f"{options.token_id} is outside the "
                                    f"vocabulary [0, {arch.vocab_size})")])
            self.token_id = options.token_id
        else:
            special = _special_ids(arch.raw)
            start = min(1000, arch.vocab_size - 1)
            self.token_id = next((t for t in range(start, arch.vocab_size) if t not in special),
                                 start)
        self.num_blocks = 0
        self.num_steps = 0
        self.simulated_s = 0.0      # the sum of every step's predicted time (passed)
        self.num_overlapped_steps = 0   # steps priced max(host, device)
        self._last_launched: _PricedStep | None = None

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.overlap else 1

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def determine_num_kv_blocks(self) -> int:
        kv = self._kv
        return num_blocks_for_budget(kv.num_blocks, kv.memory_gib, self.kv_bytes_per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        raise NotImplementedError(f"the sim executor runs no workers, so it cannot call "
                                  f"{method!r} on them")

    def _pass(self, seconds: float) -> None:
        """A step's time passes: on the virtual clock, or slept."""
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY
        shape = StepShape.from_plan(scheduler_output)
        self.num_steps += 1
        req_ids = scheduler_output.sampling_req_ids
        if self.overlap:
            host, device = self.overlapped.split(shape)
            step = self._last_launched = _PricedStep(self, host, device, ModelRunnerOutput(
                list(req_ids), [self.token_id] * len(req_ids), None, {}))
            return step
        seconds = self.cost_model.predict(shape)
        self.simulated_s += seconds
        self._pass(seconds)
        return ModelRunnerOutput(list(req_ids), [self.token_id] * len(req_ids), None,
                                 {"forward": seconds})
