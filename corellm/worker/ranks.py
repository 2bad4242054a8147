"""An executor that drives tensor-parallel ranks living elsewhere (other processes, Ray actors):
what the ``multiproc`` and ``ray`` executors share.

``RanksExecutor`` owns the step protocol; a ``RankBackend`` owns the ranks and the channel to
them. The engine process holds no model: ``send_step`` hands the plan to every rank, and rank 0's
output comes back through ``recv_output``. With overlapped steps (``max_concurrent_batches`` 2)
the plan of step N+1 goes out before step N's output is taken, so ranks > 0, which sample nothing,
get rank 0's tokens of step N with the plan of step N+1 (``prev``). The first failure a backend
reports (an ``ExecutorError`` naming the rank and the cause) stops every rank and is raised again
by every later call: the engine then ends each unfinished request with it.
"""

from __future__ import annotations

import logging
import os
import weakref
from concurrent.futures import Future
from typing import Any

from corellm.interfaces import Executor, ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class RankBackend:
    """The ranks as ``RanksExecutor`` drives them: start them (returns the model's info), call a
    method on every rank, send a step and receive rank 0's output, stop them. Failures are
    ``ExecutorError``s naming the rank; ``stop`` is idempotent and never raises. The base
    keeps what every backend is made from: the config, the executor's options, the resolved
    setup, the platform and the number of ranks (``tp``)."""

    def __init__(self, config: Any, options: Any, setup: Any, platform: Any) -> None:
        self.config = config
        self.options = options
        self.setup = setup
        self.platform = platform
        self.tp = config.parallel.tensor_parallel_size

    def start(self) -> ModelInfo: ...
    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list: ...
    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None: ...
    def recv_output(self) -> ModelRunnerOutput: ...
    def stop(self) -> None: ...


def cpu_threads(ranks_here: int) -> int:
    """Torch threads for each of ``ranks_here`` ranks sharing this machine's cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks_here))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class RanksExecutor(Executor):
    """The engine's side of ranks run by ``backend``, which it starts here. ``name``: the
    executor's, for its messages."""

    name = "ranks"

    def __init__(self, backend: RankBackend, overlap: bool) -> None:
        self._impl = backend
        self._overlap = overlap
        self._closed = False
        self._failed: ExecutorError | None = None
        self._prev: ModelRunnerOutput | None = None
        self._last: _StepFuture | None = None         # the step the ranks run last
        self._finalizer = weakref.finalize(self, backend.stop)
        try:
            self._model_info = backend.start()
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
            raise ExecutorError(f"the {self.name} executor is shut down")

    def _fail(self, exc: ExecutorError) -> ExecutorError:
        """Record the first failure, stop every rank, and return the error to raise."""
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
        # updates step N while the ranks run step N+1.
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
    rank meanwhile."""

    def __init__(self, executor: RanksExecutor) -> None:
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


# --------------------------------------------------------------------------- the rank's side
def build_rank_worker(config: Any, setup: Any, rank: int, init_method: str, threads: int,
                      local_rank: int, local_world: int) -> tuple[Any, Any]:
    """What a rank's process does first: ``threads`` torch threads, its plugins (imported per
    process), its platform and device, the ``torch.distributed`` group, then its ``Worker``
    (loading its shard). Returns (worker, parallel context)."""
    import torch

    from corellm.platforms import build_platform
    from corellm.platforms.distributed import init_parallel
    from corellm.plugins import load_registry
    from corellm.worker.worker import Worker
    torch.set_num_threads(threads)
    # The config arrives validated and the setup resolved (pickled): the registry is all a rank
    # builds again, since its plugins are imported per process.
    registry = load_registry(disable=config.plugins.disable)
    platform = build_platform(config.platform, registry)
    device = platform.device(local_rank)
    parallel = init_parallel(config.parallel, rank, init_method, device, platform)
    worker = Worker(config, registry, parallel, local_rank=local_rank,
                    local_world_size=local_world, setup=setup, platform=platform)
    return worker, parallel


def serve_rank(rank: int, worker: Any, receive: Any, send_output: Any, reply: Any) -> None:
    """A rank's loop until the engine says stop: ``receive()`` the next message (a step, an
    rpc, or stop), run it, ``send_output(out)`` for rank 0's step output and ``reply(result)``
    for an rpc addressed to this rank."""
    while True:
        msg = receive()
        kind = msg[0]
        if kind == "step":
            _, plan, prev = msg
            if prev is not None and rank > 0:
                worker.add_sampled_tokens(prev)
            out = worker.execute_model(plan)
            if rank == 0:
                send_output(out)
        elif kind == "rpc":
            _, method, args, kwargs, ranks = msg
            if ranks is None or rank in ranks:
                reply(getattr(worker, method)(*args, **kwargs))
        elif kind == "stop":
            return
