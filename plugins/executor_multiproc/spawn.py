"""The spawn way (``parallel.init_method: tcp://...``): the worker processes this machine starts,
one per rank, and the engine's side of them (``_SpawnBackend``). Plans go out through a
shared-memory ring (``corellm.platforms.shm_ring``), rank 0's outputs come back through another,
and each worker's pipe carries its replies to ``collective_rpc`` and its failure."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as mp_wait
from typing import Any

from corellm.config import EngineConfig
from corellm.platforms.distributed import destroy_parallel, free_port
from corellm.errors import CorellmError
from corellm.interfaces import ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform
from corellm.config.setup import EngineSetup
from corellm.worker.ranks import (RankBackend, build_rank_worker, cpu_threads, describe,
                                  serve_rank)
from corellm.platforms.shm_ring import (RingClosed, RingReader, RingWriter, create_ring,
                                        doorbell_pair, unlink_ring)

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 5.0


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that spawned it exits."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


# --------------------------------------------------------------------------- worker side
def _worker_main(rank: int, config: EngineConfig, setup: EngineSetup, init_method: str,
                 plan_spec: Any, plan_bell: Any, out_spec: Any, out_bells: list[Any], conn: Any,
                 threads: int) -> None:
    """One rank's process: join the group, load the shard, then serve the ring until told to
    stop (or the engine is gone)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from corellm.engine.logs import configure_logging
    configure_logging()        # as the corellm command set it: CORELLM_LOG_FORMAT / _LEVEL
    parent = os.getppid()
    os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
    reader = writer = None
    parallel = None
    try:
        worker, parallel = build_rank_worker(config, setup, rank, init_method, threads,
                                             rank, config.parallel.tensor_parallel_size)
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
        serve_rank(rank, worker, lambda: reader.read(idle=parent_alive),
                   writer.write if writer is not None else None,
                   lambda result: conn.send(("ok", result)))
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
        conn.send(("error", describe(exc), tb, own))
    except Exception:
        try:
            conn.send(("error", describe(exc), tb, None))
        except Exception:
            pass


# --------------------------------------------------------------------------- engine side
class _SpawnBackend(RankBackend):
    def __init__(self, config: EngineConfig, options: Any, setup: EngineSetup,
                 platform: Platform) -> None:
        super().__init__(config, options, setup, platform)
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
        threads = cpu_threads(self.tp) if self.platform.shares_devices else 1
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
            # A rank's collective fails when a peer dies: the death, if one follows at once,
            # is the cause to report.
            dead = mp_wait([p.sentinel for r, p in enumerate(self.procs) if r != rank],
                           timeout=0.5)
            if dead:
                died = next(r for r, p in enumerate(self.procs) if p.sentinel == dead[0])
                raise self._death(died)
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
        # The first chunk is there; a message of several slots follows as rank 0 writes it.
        return reader.read(idle=self._alive)

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
