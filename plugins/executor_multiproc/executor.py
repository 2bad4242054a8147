"""The tensor-parallel executor: one worker per rank, on torch.distributed.

Two ways to get the ranks:

* **spawn** (``parallel.init_method: tcp://...``, the default): the executor starts
  ``parallel.tensor_parallel_size`` worker processes on this machine, one per rank, each with
  its device, its shard of the weights and of the KV cache. The engine process holds no model:
  it writes each step's plan into a shared-memory ring (``shm.py``) every worker reads, and
  rank 0 writes its sampled tokens back through a second ring. Each worker also has a pipe for
  replies to ``collective_rpc`` and for reporting its own failure.
* **launcher** (``parallel.init_method: env://``): ``torchrun`` (or any launcher that sets RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started every rank, on one machine or many. The process
  of rank 0 runs the engine and its worker in-process; the others run ``launcher_worker``. The
  plan reaches them by a broadcast on a gloo group, since they may be on other machines.

Faults: the engine waits for rank 0's output on the ring, each worker's pipe and each worker
process's sentinel together, so a worker that raises or dies is noticed at once (a hang after
``parallel.timeout_s``, when a collective times out); the executor then names the rank and the
cause in an ``ExecutorError``, stops every worker (SIGTERM, then SIGKILL) and the engine ends
every unfinished request with an error. Workers die with the engine (``PR_SET_PDEATHSIG``, and a
check of the parent while idle), ignore SIGINT (the engine decides when they stop), and the
shared memory is unlinked as soon as all have mapped it: nothing outlives the engine.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait
from typing import Any

from corellm.components import BuildContext
from corellm.config import EngineConfig
from corellm.distributed import (check_tensor_parallel, destroy_parallel, free_port,
                                 init_parallel, launcher_env)
from corellm.errors import ConfigError, CorellmError
from corellm.interfaces import Executor, ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, build_platform
from corellm.plugins import Registry, load_registry
from corellm.setup import EngineSetup, resolve_setup
from corellm_plugins.executor_multiproc.shm import (RingClosed, RingReader, RingWriter,
                                                   create_ring, doorbell_pair, unlink_ring)

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 5.0


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that spawned it exits."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _cpu_threads(tp_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // tp_size)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _check_config(config: EngineConfig, registry: Registry, setup: EngineSetup) -> Platform:
    """Refuse in the engine process, before anything starts, a size the model or the machine
    cannot take. Returns the platform."""
    platform = build_platform(config.platform, registry)
    check_tensor_parallel(setup.arch, config.parallel.tensor_parallel_size, platform,
                          setup.source)
    return platform


# --------------------------------------------------------------------------- worker side
def _dispatch(worker: Any, method: str, args: tuple, kwargs: dict) -> Any:
    return getattr(worker, method)(*args, **kwargs)


def _worker_main(rank: int, config: EngineConfig, setup: EngineSetup, init_method: str,
                 plan_spec: Any, plan_bell: Any, out_spec: Any, out_bells: list[Any], conn: Any,
                 threads: int) -> None:
    """One rank's process: join the group, load the shard, then serve the ring until told to
    stop (or the engine is gone)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from corellm.logs import configure_logging
    configure_logging()        # as the corellm command set it: CORELLM_LOG_FORMAT / _LEVEL
    parent = os.getppid()
    os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
    reader = writer = None
    parallel = None
    try:
        import torch
        torch.set_num_threads(threads)
        # The config arrives validated and the setup resolved (pickled by the spawn): the
        # registry is all a rank builds again, since its plugins are imported per process.
        registry = load_registry(disable=config.plugins.disable)
        platform = build_platform(config.platform, registry)
        device = platform.device(rank)
        parallel = init_parallel(config.parallel, rank, init_method, device, platform)
        from corellm.worker.worker import Worker
        tp = config.parallel.tensor_parallel_size
        worker = Worker(config, registry, parallel, local_rank=rank, local_world_size=tp,
                        setup=setup, platform=platform)
        reader = RingReader(plan_spec, rank, plan_bell)
        if rank == 0:
            writer = RingWriter(out_spec, out_bells)
        conn.send(("ready", worker.model_info))
    except BaseException as exc:       # noqa: BLE001 - reported to the engine, then exit
        _report(conn, rank, exc)
        os._exit(1)

    def parent_alive() -> None:
        if os.getppid() != parent:
            os._exit(1)

    code = 0
    try:
        while True:
            msg = reader.read(idle=parent_alive)
            kind = msg[0]
            if kind == "step":
                _, plan, prev = msg
                if prev is not None and rank > 0:
                    worker.add_sampled_tokens(prev)
                out = worker.execute_model(plan)
                if writer is not None:
                    writer.write(out)
            elif kind == "rpc":
                _, method, args, kwargs, ranks = msg
                if ranks is None or rank in ranks:
                    conn.send(("ok", _dispatch(worker, method, args, kwargs)))
            elif kind == "stop":
                break
    except BaseException as exc:       # noqa: BLE001
        _report(conn, rank, exc)
        code = 1
    finally:
        if code == 0:
            try:
                destroy_parallel(parallel)
            except Exception:
                pass
    os._exit(code)


def _report(conn: Any, rank: int, exc: BaseException) -> None:
    """Tell the engine why this rank stops: its own errors (a bad config, a bad checkpoint)
    travel whole, anything else as text."""
    tb = "".join(traceback.format_exception(exc)[-6:])
    own = exc if isinstance(exc, CorellmError) else None
    try:
        conn.send(("error", _describe(exc), tb, own))
    except Exception:
        try:
            conn.send(("error", _describe(exc), tb, None))
        except Exception:
            pass


# --------------------------------------------------------------------------- engine side
class MultiprocExecutor(Executor):
    def __init__(self, options: Any, ctx: BuildContext) -> None:
        config = ctx.config
        self.config = config
        self.options = options
        self.tp_size = config.parallel.tensor_parallel_size
        self._closed = False
        self._failed: ExecutorError | None = None
        self._prev: ModelRunnerOutput | None = None
        self.procs: list[Any] = []
        setup = ctx.setup or resolve_setup(config, ctx.registry)
        platform = _check_config(config, ctx.registry, setup)
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
        self._check()
        try:
            return self._impl.rpc(method, args, kwargs or {}, timeout)
        except ExecutorError as exc:
            raise self._fail(exc) from None

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self._check()
        prev, self._prev = self._prev, None
        try:
            self._impl.send_step(scheduler_output, prev)
        except ExecutorError as exc:
            raise self._fail(exc) from None
        return _StepFuture(self)

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

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                self.set_result(self._executor._wait_output())
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)


class _Backend:
    def start(self) -> ModelInfo: ...
    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list: ...
    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None: ...
    def recv_output(self) -> ModelRunnerOutput: ...
    def stop(self) -> None: ...


class _SpawnBackend(_Backend):
    def __init__(self, config: EngineConfig, options: Any, setup: EngineSetup,
                 platform: Platform) -> None:
        self.config = config
        self.options = options
        self.setup = setup
        self.platform = platform
        self.tp = config.parallel.tensor_parallel_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.plan_spec = self.out_spec = None
        self.writer: RingWriter | None = None
        self.reader: RingReader | None = None
        self._stopped = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- start-up
    def start(self) -> ModelInfo:
        opts = self.options
        init = self.config.parallel.init_method
        host, _, port = init[len("tcp://"):].rpartition(":")
        if port == "0":
            init = f"tcp://{host}:{free_port(host)}"
        ctx = mp.get_context("spawn")
        self.plan_spec = create_ring(self.tp, opts.ring_slots, opts.ring_slot_bytes)
        self.out_spec = create_ring(1, opts.ring_slots, opts.ring_slot_bytes)
        plan_bells = [doorbell_pair() for _ in range(self.tp)]
        out_r, out_w = doorbell_pair()
        # Ranks sharing one device (the CPU) share its cores; a rank with a device of its own
        # needs one thread to drive it.
        threads = _cpu_threads(self.tp) if self.platform.shares_devices else 1
        # The engine-core process of `corellm serve` is a daemonic process, which
        # multiprocessing forbids to have children lest they outlive it; these cannot (they die
        # with it by PR_SET_PDEATHSIG and watch it while idle), so lift the flag while starting.
        me = mp.current_process()
        daemonic, me.daemon = me.daemon, False
        try:
            for rank in range(self.tp):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, name=f"corellm-tp-rank{rank}", daemon=True,
                    args=(rank, self.config, self.setup, init, self.plan_spec, plan_bells[rank][0],
                          self.out_spec, [out_w] if rank == 0 else [], child_conn, threads))
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
            for r, _ in plan_bells:
                r.close()
            self.writer = RingWriter(self.plan_spec, [w for _, w in plan_bells],
                                     alive=self._alive)
            self.reader = RingReader(self.out_spec, 0, out_r)
            out_w.close()
            infos = self._gather(opts.start_timeout_s, "start")
        finally:
            me.daemon = daemonic
            # Mapped by every process that will ever map them (or failed): unlink, so the
            # memory goes with the last process.
            unlink_ring(self.plan_spec)
            unlink_ring(self.out_spec)
        return infos[0]

    # ---------------------------------------------------------------- watching
    def _dead(self) -> ExecutorError | None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return self._death(rank)
        return None

    def _death(self, rank: int) -> ExecutorError:
        conn = self.conns[rank]
        try:                       # it may have said why before going
            if conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    return ExecutorError(f"tensor-parallel rank {rank} failed: {msg[1]}\n{msg[2]}")
        except (EOFError, OSError):
            pass
        # Its sentinel closes while it exits, a moment before the kernel has its status.
        self.procs[rank].join(2.0)
        code = self.procs[rank].exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None
               and code < 0 else f"exited with status {code}")
        return ExecutorError(f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) {how}")

    def _alive(self) -> None:
        err = self._dead()
        if err is not None:
            raise err

    def _pipe_message(self, rank: int) -> tuple:
        try:
            msg = self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            raise self._death(rank) from None
        if msg[0] == "error":
            if msg[3] is not None:      # a config or checkpoint problem: the user's to fix
                raise msg[3]
            raise ExecutorError(f"tensor-parallel rank {rank} failed: {msg[1]}\n{msg[2]}")
        return msg

    def _gather(self, timeout: float | None, what: str,
                ranks: list[int] | None = None) -> list[Any]:
        """One pipe reply from each rank (in rank order), watching every process."""
        ranks = list(range(self.tp)) if ranks is None else ranks
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = {self.conns[r]: r for r in range(self.tp)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(results) < len(ranks):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = [r for r in ranks if r not in results]
                raise ExecutorError(f"tensor-parallel rank(s) {missing} did not answer {what} "
                                    f"within {timeout:.0f} s")
            ready = mp_wait([*watch, *sentinels], timeout=left)
            for obj in ready:
                if obj in watch:
                    rank = watch[obj]
                    msg = self._pipe_message(rank)
                    results[rank] = msg[1]
                elif obj in sentinels:
                    rank = sentinels[obj]
                    if self.conns[rank].poll(0):
                        msg = self._pipe_message(rank)
                        results[rank] = msg[1]
                    else:
                        raise self._death(rank)
        return [results[r] for r in ranks]

    # ---------------------------------------------------------------- calls
    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list:
        with self._lock:
            self._write(("rpc", method, args, kwargs, None))
            return self._gather(timeout, f"{method}()")

    def _write(self, msg: tuple) -> None:
        if self._stopped or self.writer is None:
            raise ExecutorError("the multiproc executor's workers are stopped")
        try:
            self.writer.write(msg)
        except RingClosed as exc:
            raise self._dead() or ExecutorError(str(exc)) from None

    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None:
        self._write(("step", plan, prev))

    def recv_output(self) -> ModelRunnerOutput:
        reader = self.reader
        assert reader is not None
        watch = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        bell = reader.doorbell
        while not reader.poll():
            ready = mp_wait([bell, *watch, *sentinels], timeout=1.0)
            for obj in ready:
                if obj in watch:
                    self._pipe_message(watch[obj])        # only errors come unasked
                elif obj in sentinels and not reader.poll():
                    raise self._death(sentinels[obj])
            if bell in ready:
                reader.wait(0)                             # drains the doorbell
        return reader.read(timeout=0.0)

    # ---------------------------------------------------------------- stop
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.writer is not None and all(p.exitcode is None for p in self.procs):
            try:
                self.writer.write(("stop",))
            except Exception:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in self.procs:
            proc.join(1.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()
        for end in (self.writer, self.reader):
            if end is not None:
                end.close()
        for spec in (self.plan_spec, self.out_spec):
            if spec is not None:
                unlink_ring(spec)


class _LauncherBackend(_Backend):
    """Rank 0 of a ``torchrun``-style launch: the engine's process is also rank 0's worker; the
    other ranks (``launcher_worker``) receive the plan by a broadcast on the gloo group."""

    def __init__(self, config: EngineConfig, registry: Registry, setup: EngineSetup,
                 platform: Platform) -> None:
        self.config = config
        self.registry = registry
        self.setup = setup
        self.platform = platform
        self.tp = config.parallel.tensor_parallel_size
        self.worker: Any = None
        self.parallel: Any = None
        self._out: ModelRunnerOutput | None = None
        self._stopped = False
        self._broken = False

    def start(self) -> ModelInfo:
        env = launcher_env()
        if env is None:
            raise ConfigError([("parallel.init_method", "env:// needs a launcher such as "
                                "torchrun to set RANK and WORLD_SIZE (with MASTER_ADDR and "
                                "MASTER_PORT)")])
        rank, world = env
        if world != self.tp:
            raise ConfigError([("parallel.tensor_parallel_size",
                                f"{self.tp} != WORLD_SIZE={world} of the launcher")])
        if rank != 0:
            raise ConfigError([("parallel.init_method",
                                f"the engine runs on rank 0, but this process is RANK={rank} "
                                "(its command should run the worker: corellm serve/generate "
                                "do that by themselves)")])
        import torch.distributed as dist

        from corellm.worker.worker import Worker
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.tp)))
        device = self.platform.device(local_rank)
        self.parallel = init_parallel(self.config.parallel, 0, "env://", device, self.platform)
        # The other ranks build their workers from this setup, not from their own reading of
        # the checkpoint (launcher_worker receives it).
        dist.broadcast_object_list([self.setup], src=0, group=self.parallel.cpu_group)
        self.worker = Worker(self.config, self.registry, self.parallel, local_rank=local_rank,
                             local_world_size=local_world, setup=self.setup,
                             platform=self.platform)
        return self.worker.model_info

    def _collective(self, fn: Any, what: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            self._broken = True         # the group is unusable: stop() must not use it
            raise self._named_failure(exc, what) from None

    def _named_failure(self, exc: BaseException, what: str) -> ExecutorError:
        """A collective failed: look in the rendezvous store for a rank that reported why."""
        reports = []
        try:
            import torch.distributed as dist
            store = dist.distributed_c10d._get_default_store()
            for rank in range(1, self.tp):
                if store.check([f"corellm/error/{rank}"]):
                    reports.append(f"tensor-parallel rank {rank} failed: "
                                   f"{store.get(f'corellm/error/{rank}').decode()}")
        except Exception:
            pass
        head = "; ".join(reports) or f"a tensor-parallel peer of rank 0 failed during {what}"
        return ExecutorError(f"{head} ({_describe(exc)})")

    def _broadcast(self, msg: tuple) -> None:
        import torch.distributed as dist
        if self._stopped:
            raise ExecutorError("the multiproc executor's workers are stopped")
        self._collective(lambda: dist.broadcast_object_list([msg], src=0,
                                                            group=self.parallel.cpu_group),
                         msg[0])

    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list:
        import torch.distributed as dist
        self._broadcast(("rpc", method, args, kwargs, None))
        mine = getattr(self.worker, method)(*args, **kwargs)
        out: list[Any] = [None] * self.tp
        self._collective(lambda: dist.gather_object(mine, out, dst=0,
                                                    group=self.parallel.cpu_group), method)
        return out

    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None:
        self._broadcast(("step", plan, prev))
        self._out = self._collective(lambda: self.worker.execute_model(plan), "the step")

    def recv_output(self) -> ModelRunnerOutput:
        out, self._out = self._out, None
        assert out is not None
        return out

    def stop(self) -> None:
        if self._stopped:
            return
        try:
            if self.parallel is not None and not self._broken:
                import torch.distributed as dist
                dist.broadcast_object_list([("stop",)], src=0, group=self.parallel.cpu_group)
        except Exception:
            pass
        self._stopped = True
        if self.parallel is not None and not self._broken:
            try:
                destroy_parallel(self.parallel)
            except Exception:
                pass


def launcher_worker(config: EngineConfig, registry: Registry) -> int:
    """What a process of rank > 0 runs under ``torchrun``: join the group, load its shard,
    serve the broadcast plans until rank 0 stops. Returns the exit status."""
    import torch.distributed as dist

    from corellm.worker.worker import Worker

    env = launcher_env()
    assert env is not None
    rank, world = env
    if world != config.parallel.tensor_parallel_size:
        raise ConfigError([("parallel.tensor_parallel_size",
                            f"{config.parallel.tensor_parallel_size} != WORLD_SIZE={world} of "
                            "the launcher")])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    platform = build_platform(config.platform, registry)
    device = platform.device(local_rank)
    if platform.shares_devices:
        import torch
        torch.set_num_threads(_cpu_threads(local_world))
    parallel = None
    try:
        parallel = init_parallel(config.parallel, rank, "env://", device, platform)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)    # rank 0's setup
        worker = Worker(config, registry, parallel, local_rank=local_rank,
                        local_world_size=local_world, setup=box[0], platform=platform)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)
            msg = box[0]
            if msg[0] == "step":
                _, plan, prev = msg
                if prev is not None:
                    worker.add_sampled_tokens(prev)
                worker.execute_model(plan)
            elif msg[0] == "rpc":
                _, method, args, kwargs, _ = msg
                result = getattr(worker, method)(*args, **kwargs)
                dist.gather_object(result, None, dst=0, group=parallel.cpu_group)
            elif msg[0] == "stop":
                break
    except BaseException as exc:
        logger.error("tensor-parallel rank %d failed: %s", rank, _describe(exc))
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"corellm/error/{rank}", _describe(exc))
        except Exception:
            pass
        return 1
    destroy_parallel(parallel)
    return 0
