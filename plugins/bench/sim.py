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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


from corellm.block_pool import num_blocks_for_budget
from corellm.clock import VirtualClock
from corellm.components import BuildContext
from corellm.errors import ConfigError
from corellm.interfaces import Executor, ModelInfo
from corellm.model_config import checkpoint_name, resolve_dtype_name
from corellm.outputs import DecodeRunOutput, ModelRunnerOutput, SchedulerOutput
from corellm.setup import resolve_setup

from .costmodel import StepShape
from .model_shape import model_fingerprint
from .options import SimOptions
from .profile import Profile

EMPTY = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


def _special_ids(raw: dict) -> set[int]:
    ids: set[int] = set()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = raw.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return ids


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
        self.cost_model = profile.cost_model
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
        self.simulated_s = 0.0      # the sum of every step's predicted time
        # On virtual time the engine may run several decode steps per call (the steps are
        # priced, not slept, and every sample is this token); paced on the real clock, one.
        self.fixed_token_id = self.token_id if self.clock is not None else None

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY
        seconds = self.cost_model.predict(StepShape.from_plan(scheduler_output))
        self.num_steps += 1
        self.simulated_s += seconds
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)
        req_ids = scheduler_output.sampling_req_ids
        return ModelRunnerOutput(req_ids=list(req_ids),
                                 sampled_token_ids=[self.token_id] * len(req_ids),
                                 timings={"forward": seconds})

    def execute_decode_run(self, plan: SchedulerOutput, max_steps: int,
                           keep_going: Callable[[], bool]) -> DecodeRunOutput:
        # The shape of step j: every request one token further than at step j - 1, priced and
        # clocked one step at a time exactly as execute_model does (the same float sums).
        assert self.clock is not None
        scheduled = plan.num_scheduled_tokens
        r = len(scheduled)
        decode_kv = sum(map(plan.num_computed_tokens.__getitem__, scheduled)) + r
        predict, clock = self.cost_model.predict_decode, self.clock
        seconds: list[float] = []
        ends: list[float] = []
        for j in range(max_steps):
            s = predict(r, decode_kv + j * r)
            self.num_steps += 1
            self.simulated_s += s
            clock.advance(s)
            seconds.append(s)
            ends.append(clock.monotonic())
            if not keep_going():
                break
        return DecodeRunOutput(seconds, ends)
