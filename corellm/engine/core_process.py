"""The engine core as its clients see it: started (and waited for until its model is loaded),
watched (its death turned into a reason every waiter gets), and stopped (asked, then killed).

``CoreLauncher`` is that interface; a ``core_launcher`` plugin supplies one (plugin API 1.13).
``_CoreProcess`` is the ``mp`` launcher's: a spawned process of this machine, reached through
two IPC sockets in a private directory that is removed whichever way the process ends.
``core_launcher(config, registry)`` makes the one the config selects.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import zmq

from corellm.config.compose import EngineConfig
from corellm.engine.ipc import EngineStartupError
from corellm.interfaces import ModelInfo

if TYPE_CHECKING:
    from corellm.plugins.discovery import Registry

logger = logging.getLogger("corellm.engine.core_client")

# A send blocks only when the core stopped reading (its queue is full or it is gone).
SEND_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = float(os.environ.get("CORELLM_ENGINE_STARTUP_TIMEOUT", "600"))
# Default time a shutdown gives the core to finish its step, run its stop hooks and exit before
# it is killed (SIGKILL).
STOP_TIMEOUT_S = 10.0
# How long to wait for a killed process to be gone.
KILL_WAIT_S = 5.0


class CoreLauncher(ABC):
    """Where an engine core runs, and its life: what a ``core_launcher`` plugin's factory
    returns. A client (``SyncMPClient``, ``AsyncMPClient``) makes one per engine core and calls,
    in order:

    * ``bind(sock, which)`` for its two sockets (``which``: "input", the requests it pushes,
      and "output", the batches it pulls): bind each where the core will connect. The client
      owns the sockets; the launcher may configure them (security options) and may bind them
      later, in ``start``, once it knows where the core will be. Sockets come from ``ctx``.
    * ``start(config, max_outputs_ahead) -> ModelInfo`` (blocking; in a thread for the asyncio
      client): place the core, run ``corellm.engine.core_proc``'s engine core there connected
      to the two addresses, and return once its model is loaded; ``EngineStartupError`` with
      the core's reason if it fails. ``pid`` and ``where`` (words naming the core: "pid 123",
      "Ray actor ... on node ...") are set by then.
    * ``watch(on_death)``: call ``on_death(reason)`` from any thread if the core ends while
      ``closing`` is False.
    * ``stop(send_shutdown, timeout)``: ask (``send_shutdown(budget)`` sends the core its
      SHUTDOWN), wait at most ``timeout`` seconds, then ``kill``. ``kill()``: at once,
      idempotent, from any thread (a cancelled start too).

    ``dead_reason``: set by the client when the core reports its own death, else by the
    launcher; the reason every waiter gets. The core must not outlive its client: a launcher
    ties the core's life to the client process (the ``mp`` core watches its parent; a Ray
    actor dies with its owner).
    """

    ctx: zmq.Context
    pid: int = 0
    dead_reason: str | None = None
    closing: bool = False

    @property
    def where(self) -> str:
        return f"pid {self.pid}"

    @abstractmethod
    def bind(self, sock: zmq.Socket, which: str) -> None: ...

    @abstractmethod
    def start(self, config: EngineConfig, max_outputs_ahead: int | None = None) -> ModelInfo: ...

    @abstractmethod
    def watch(self, on_death: Callable[[str], None]) -> None: ...

    @abstractmethod
    def stop(self, send_shutdown: Callable[[float], None] | None,
             timeout: float = STOP_TIMEOUT_S) -> None: ...

    @abstractmethod
    def kill(self) -> None: ...


def core_launcher(config: EngineConfig, registry: Registry | None = None) -> CoreLauncher:
    """The launcher ``config.core_launcher`` selects, made for one engine core."""
    from corellm.plugins.registry import call_factory
    if registry is None:
        from corellm.plugins.discovery import load_registry
        registry = load_registry(disable=config.plugins.disable)
    from corellm.errors import ConfigError, PluginError
    try:
        entry = registry.get("core_launcher", config.core_launcher.name)
    except PluginError as exc:
        raise ConfigError([("core_launcher.name", str(exc))]) from None
    return call_factory(entry, "core_launcher", config.core_launcher, config)


class _CoreProcess(CoreLauncher):
    """The ``mp`` launcher: starts the engine-core process on this machine, waits until it is
    ready, and stops it. Owns the IPC directory (``ipc_dir``) and removes it once the process is
    stopped or seen dead."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="corellm-ipc-", ignore_cleanup_errors=True)
        self.ipc_dir: str = self._dir.name
        self._dir_lock = threading.Lock()
        self._dir_removed = False
        self.input_addr = f"ipc://{self.ipc_dir}/input"
        self.output_addr = f"ipc://{self.ipc_dir}/output"
        self.ctx = zmq.Context()
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self.closing = False
        # kill() may come from another thread while start() is spawning (a cancelled start):
        # the lock orders the two, and start() gives up once killed.
        self._lock = threading.Lock()
        self._killed = False
        # Once the watch runs, every wait for the process's exit status goes through _reap,
        # under this lock: of two threads in waitpid at once, one reaps the process and the
        # other gets no status (ECHILD), and would report exit code None, until the first has
        # stored it.
        self._reap_lock = threading.Lock()

    def bind(self, sock: zmq.Socket, which: str) -> None:
        sock.bind(self.input_addr if which == "input" else self.output_addr)

    def start(self, config: EngineConfig, max_outputs_ahead: int | None = None) -> ModelInfo:
        from corellm.engine.core_proc import run_engine_core

        mp = multiprocessing.get_context("spawn")   # never fork a process that may hold CUDA
        reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core, name="corellm-engine-core", daemon=True,
            args=(config, self.input_addr, self.output_addr, writer, os.getpid(),
                  logging.getLogger("corellm").getEffectiveLevel(), self.ipc_dir,
                  max_outputs_ahead))
        with self._lock:
            if self._killed:
                raise EngineStartupError("engine core start-up was cancelled")
            self.proc.start()
        writer.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not reader.poll(0.1):
            if self._killed:
                raise EngineStartupError("engine core start-up was cancelled")
            if not self.proc.is_alive():
                raise EngineStartupError(f"engine core process exited with code "
                                         f"{self.proc.exitcode} during start-up (see its log)")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineStartupError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s "
                                         "(CORELLM_ENGINE_STARTUP_TIMEOUT)")
        try:
            status, payload = reader.recv()
        except EOFError:
            self.proc.join(5)
            raise EngineStartupError(f"engine core process exited with code "
                                     f"{self.proc.exitcode} during start-up") from None
        reader.close()
        if status != "ready":
            self.proc.join(10)
            raise EngineStartupError(f"engine core failed to start: {payload}")
        self.pid = payload.pop("pid")
        logger.info("engine core process started (pid %d)", self.pid)
        return ModelInfo(**payload)

    def watch(self, on_death: Any) -> None:
        """Call ``on_death(reason)`` from a thread if the process ends while not closing. The IPC
        directory is removed as soon as the process has ended, either way."""
        def wait_for_exit() -> None:
            assert self.proc is not None
            wait([self.proc.sentinel])          # without reaping it: that is _reap's, locked
            code = self._reap()
            self.remove_ipc_dir()
            if not self.closing:
                reason = self.dead_reason or (f"engine core process (pid {self.proc.pid}) exited "
                                              f"with code {code}")
                logger.error("%s", reason)
                on_death(reason)
        threading.Thread(target=wait_for_exit, daemon=True, name="corellm-core-watch").start()

    def running(self) -> bool:
        """Started and not yet exited (exited means its sentinel is ready, reaped or not)."""
        try:
            return self.proc is not None and not wait([self.proc.sentinel], 0)
        except ValueError:             # not started
            return False

    def _reap(self, timeout: float | None = None) -> int | None:
        """Reap the process, waiting up to ``timeout`` seconds; its exit code, or None while it
        runs. Whichever thread reaps it, the others then read the status it stored."""
        assert self.proc is not None
        with self._reap_lock:
            self.proc.join(timeout)
            return self.proc.exitcode

    def _wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit, and reap it; True once it
        has exited."""
        assert self.proc is not None
        if not wait([self.proc.sentinel], max(0.0, timeout)):
            return False
        self._reap(1)
        return True

    def stop(self, send_shutdown: Callable[[float], None] | None,
             timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine core, bounded: ``send_shutdown(budget)`` asks it to stop (it must
        return or raise within ``budget`` seconds); the core finishes its step, runs its stop
        hooks and exits. If it has not within ``timeout`` seconds of the start of the call, it
        is killed (SIGKILL: the core ignores SIGTERM while it shuts down). Then the IPC
        directory is removed. Idempotent."""
        t0 = time.monotonic()
        self.closing = True
        if self.running():
            assert self.proc is not None
            pid = self.proc.pid
            if send_shutdown is not None and self.dead_reason is None:
                try:
                    send_shutdown(max(0.0, timeout))
                except Exception as exc:
                    logger.warning("could not send the shutdown request to the engine core "
                                   "process (pid %d): %s", pid, exc)
            if self._wait_exit(timeout - (time.monotonic() - t0)):
                logger.info("engine core process (pid %d) stopped (exit code %s) in %.1f s", pid,
                            self.proc.exitcode, time.monotonic() - t0)
            else:
                logger.warning("engine core process (pid %d) did not stop within %.1f s of the "
                               "shutdown request; killing it (SIGKILL)", pid, timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the process if it is running (a cancelled or failed start, or the end of a
        stop), wait for it, and remove the IPC directory. Idempotent, any thread."""
        with self._lock:
            self._killed = True
            if self.running():
                assert self.proc is not None
                self.proc.kill()
                if self._wait_exit(KILL_WAIT_S):
                    logger.warning("engine core process (pid %d) killed", self.proc.pid)
                else:
                    logger.error("engine core process (pid %d) still running %.0f s after "
                                 "SIGKILL", self.proc.pid, KILL_WAIT_S)
        self.remove_ipc_dir()

    def remove_ipc_dir(self) -> None:
        """Remove the IPC directory (its socket files with it). Idempotent and thread-safe: the
        first call removes it, later ones return at once (after it is gone)."""
        with self._dir_lock:
            if self._dir_removed:
                return
            self._dir_removed = True
            self._dir.cleanup()
