"""The tensor-parallel executor: one worker per rank, on torch.distributed.

Two ways to get the ranks:

* **spawn** (``parallel.init_method: tcp://...``, the default; ``spawn.py``): the executor starts
  ``parallel.tensor_parallel_size`` worker processes on this machine, one per rank, each with
  its device, its shard of the weights and of the KV cache. The engine process holds no model:
  it writes each step's plan into a shared-memory ring (``shm.py``) every worker reads, and
  rank 0 writes its sampled tokens back through a second ring. Each worker also has a pipe for
  replies to ``collective_rpc`` and for reporting its own failure.
* **launcher** (``parallel.init_method: env://``; ``launcher.py``): ``torchrun`` (or any launcher
  that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started every rank, on one machine or
  many. The process of rank 0 runs the engine and its worker in-process; the others run
  ``launcher_worker``. The plan reaches them by a broadcast on a gloo group, since they may be
  on other machines.

Faults: the engine waits for rank 0's output on the ring, each worker's pipe and each worker
process's sentinel together, so a worker that raises or dies is noticed at once (a hang after
``parallel.timeout_s``, when a collective times out); the executor then names the rank and the
cause in an ``ExecutorError``, stops every worker (SIGTERM, then SIGKILL) and the engine ends
every unfinished request with an error. Workers die with the engine (``PR_SET_PDEATHSIG``, and a
check of the parent while idle), ignore SIGINT (the engine decides when they stop), and the
shared memory is unlinked as soon as all have mapped it: nothing outlives the engine.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from typing import Any

from corellm.components import BuildContext
from corellm.config import EngineConfig
from corellm.platforms.distributed import check_tensor_parallel
from corellm.interfaces import Executor, ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, build_platform
from corellm.plugins import Registry
from corellm.config.setup import EngineSetup, resolve_setup
from corellm_plugins.executor_multiproc.backend import _Backend
from corellm_plugins.executor_multiproc.launcher import _LauncherBackend
from corellm_plugins.executor_multiproc.spawn import _SpawnBackend

logger = logging.getLogger(__name__)


def _check_config(config: EngineConfig, registry: Registry, setup: EngineSetup) -> Platform:
    """Refuse in the engine process, before anything starts, a size the model or the machine
    cannot take. Returns the platform."""
    platform = build_platform(config.platform, registry)
    check_tensor_parallel(setup.arch, config.parallel.tensor_parallel_size, platform,
                          setup.source)
    return platform


class MultiprocExecutor(Executor):
    def __init__(self, options: Any, ctx: BuildContext) -> None:
        config = ctx.config
        self.config = config
        self.options = options
        self.tp_size = config.parallel.tensor_parallel_size
        self._closed = False
        self._failed: ExecutorError | None = None
        self._prev: ModelRunnerOutput | None = None
        self._last: _StepFuture | None = None         # the step the workers run last
        self.procs: list[Any] = []
        setup = ctx.setup or resolve_setup(config, ctx.registry)
        platform = _check_config(config, ctx.registry, setup)
        wanted = config.scheduler.async_scheduling
        self._overlap = platform.async_scheduling if wanted is None else wanted
        if config.parallel.external_launcher:
            self._impl: _Backend = _LauncherBackend(config, ctx.registry, setup, platform)
        else:
            self._impl = _SpawnBackend(config, options, setup, platform)
        self._finalizer = weakref.finalize(self, self._impl.stop)
        try:
            self._model_info = self._impl.start()
        except BaseException:
            self.shutdown()
            raise

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise ExecutorError("the multiproc executor is shut down")

    def _fail(self, exc: ExecutorError) -> ExecutorError:
        """Record the first failure, stop every worker, and return the error to raise."""
        if self._failed is None:
            self._failed = exc
            logger.error("%s", exc)
            self._impl.stop()
        return self._failed

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        last, self._last = self._last, None
        if last is not None:            # between steps: the one running is received first
            last.resolve()
        self._check()
        try:
            return self._impl.rpc(method, args, kwargs or {}, timeout)
        except ExecutorError as exc:
            raise self._fail(exc) from None

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self._overlap else 1

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        # Overlapped steps: the plan of step N+1 comes before step N's output is taken. Ranks
        # > 0 need step N's tokens with it, so rank 0's output is received first (and kept
        # in its future for the engine); the engine has planned step N+1 meanwhile, and
        # updates step N while the workers run step N+1.
        last, self._last = self._last, None
        if last is not None and not last.done():
            last.resolve()
        self._check()
        prev, self._prev = self._prev, None
        try:
            self._impl.send_step(scheduler_output, prev)
        except ExecutorError as exc:
            raise self._fail(exc) from None
        self._last = _StepFuture(self)
        return self._last

    def _wait_output(self) -> ModelRunnerOutput:
        try:
            out = self._impl.recv_output()
        except ExecutorError as exc:
            raise self._fail(exc) from None
        # Ranks > 0 add rank 0's tokens to their copies of the requests with the next plan.
        if out.req_ids:
            self._prev = ModelRunnerOutput(out.req_ids, out.sampled_token_ids)
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()


class _StepFuture(Future):
    """The step's output; ``result()`` waits for rank 0 in the caller's thread, watching every
    worker meanwhile."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def resolve(self) -> None:
        """Receive rank 0's output (or the failure) into this future."""
        if not self.done():
            try:
                self.set_result(self._executor._wait_output())
            except BaseException as exc:
                self.set_exception(exc)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.resolve()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.resolve()
        return super().exception(timeout)
