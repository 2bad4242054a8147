"""Work that a deadline must be able to stop: calls run in child processes, one per worker
thread of a ``FairExecutor``, and a call past its deadline has its process killed.

A thread cannot be stopped from outside, and a C++ library in the middle of a computation does
not look at a flag: xgrammar turning a JSON schema into a grammar, or compiling that grammar
against a vocabulary, runs to its end, which for a schema written to be expensive is minutes.
Run in a thread, such a call holds the thread (and the GIL's share it takes) for all that time,
whatever its caller has stopped waiting for. Run here, it holds a process that is killed at the
deadline; the worker thread starts a new one for its next call.

- **Processes** come from a fork server (``multiprocessing``'s ``forkserver`` context), which
  imports ``preload`` once: a new child is a fork of it, quick to start and sharing the
  preloaded modules' pages. Each child runs ``initializer(*initargs)`` once, then calls sent
  over a pipe (pickled: a module-level function and its arguments).
- **Deadline**: a call not answered within its timeout, or whose caller gave up (the
  ``cancel`` event: a client that disconnected), kills its child: ``DeadlineExceeded`` or
  ``CallCancelled``. A child that dies on its own (a crash in C++) is ``ChildDied``; one that
  cannot start, ``StartFailed``; arguments that do not pickle, ``CallRejected``. A child dies with the fork server, which exits with the
  process that started it, even in the middle of a call.
- **Memory**: a child whose resident memory has grown by more than ``max_growth_bytes`` since
  it started is replaced after the call that grew it, so whatever a library keeps between calls
  (caches, fragmentation) is bounded per child.
- **Fairness**: the jobs are queued by ``FairExecutor``'s rules (cheapest first, aging, one
  worker kept for small jobs), so a client sending expensive work holds at most the one worker
  that takes large jobs while small ones keep moving.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from corellm.errors import CorellmError
from corellm.serving.fair import FairExecutor

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How long a new child may take to start (fork, then its initializer) before it counts as
# failed: the fork server's own start imports ``preload`` (torch, for xgrammar: seconds).
START_TIMEOUT_S = 120.0
# How often a waiting call looks at its cancel event.
POLL_S = 0.05
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class SandboxError(CorellmError):
    """A call could not run in its child process (it died, or could not start)."""


class DeadlineExceeded(SandboxError):
    """A call took longer than its deadline; its process was killed."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"took longer than {timeout_s:g} s")
        self.timeout_s = timeout_s


class CallCancelled(SandboxError):
    """The caller stopped waiting for a call (its ``cancel`` event); its process was killed."""


class ChildDied(SandboxError):
    """A child process died during a call (a crash in a library, or killed for its memory):
    the call's input is the likely cause."""


class CallRejected(SandboxError):
    """A call's arguments could not be sent to a child process (they do not pickle: nested
    past the recursion limit, say)."""


class StartFailed(SandboxError):
    """A child process could not start (its fork server, or its initializer, failed)."""


# multiprocessing's guard against children of a daemonic process is lifted while a child
# starts (see _Child.start): one thread at a time.
_START_LOCK = threading.Lock()


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent (the fork server, which exits with the
    process that started it) dies, even in the middle of a call (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)                   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child_main(conn: Connection, initializer: Callable[..., Any] | None,
                initargs: tuple[Any, ...]) -> None:
    """A child's loop: answer each call sent by the parent, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C is the parent's to handle
    # SIGTERM ends a child even where its parent ignores it (the engine core does, to drain):
    # an ignored signal is inherited, and multiprocessing ends children at exit with SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException as exc:                       # noqa: BLE001 - reported to the parent
        conn.send(("error", StartFailed(f"the initializer raised {exc!r}")))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            work = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = ("ok", work())
        except BaseException as exc:                   # noqa: BLE001 - reported to the parent
            answer = ("error", exc)
        try:
            conn.send(answer)
        except Exception as exc:                       # noqa: BLE001 - an unpicklable answer
            conn.send(("error", SandboxError(f"its answer could not be sent: {exc!r}")))


class _Child:
    """One child process and the pipe to it, started at its first call."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.proc: Any = None
        self.conn: Connection | None = None
        self.base_rss = 0
        self.exitcode: int | None = None      # of the last child stopped

    def start(self) -> None:
        sb = self.sandbox
        ctx = sb.context()
        parent, child = ctx.Pipe()
        initargs = sb.initargs() if callable(sb.initargs) else sb.initargs
        proc = ctx.Process(target=_child_main, args=(child, sb.initializer, initargs),
                           name=sb.name, daemon=True)
        # multiprocessing refuses children to a daemonic process (the engine core is one), for
        # fear of orphans its abrupt end would leave. These cannot outlive it: a child returns
        # when its pipe closes, and the fork server exits when its parent does.
        with _START_LOCK:
            config = multiprocessing.current_process()._config    # noqa: SLF001
            daemonic = config.pop("daemon", None)
            try:
                proc.start()
            finally:
                if daemonic is not None:
                    config["daemon"] = daemonic
        child.close()
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise StartFailed(f"{sb.name}: a child process did not start within "
                                  f"{START_TIMEOUT_S:g} s")
            kind, value = parent.recv()
        except (EOFError, OSError) as exc:
            proc.kill()
            proc.join()
            raise StartFailed(f"{sb.name}: a child process died while starting "
                              f"(exit status {proc.exitcode})") from exc
        except BaseException:
            proc.kill()
            proc.join()
            raise
        if kind != "ready":
            proc.join()
            raise value
        self.proc, self.conn = proc, parent
        self.base_rss = _rss_bytes(proc.pid)
        sb.started += 1

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.join()
        self.exitcode = self.proc.exitcode
        assert self.conn is not None
        self.conn.close()
        self.proc = self.conn = None

    def call(self, work: Callable[[], T], timeout_s: float,
             cancel: threading.Event | None) -> T:
        if self.proc is None:
            self.start()
        assert self.conn is not None
        try:
            self.conn.send(work)
        except (OSError, EOFError) as exc:      # died between calls
            self.stop()
            raise ChildDied(f"{self.sandbox.name}: its child process died") from exc
        except Exception as exc:                # nothing was sent: the child is still good
            raise CallRejected(f"its arguments cannot be sent to a child process: "
                               f"{exc!r}"[:300]) from None
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if cancel is not None and cancel.is_set():
                self.stop()
                self.sandbox.killed += 1
                raise CallCancelled("the caller stopped waiting")
            if time.monotonic() >= deadline:
                self.stop()
                self.sandbox.killed += 1
                raise DeadlineExceeded(timeout_s)
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.stop()
            raise ChildDied(f"{self.sandbox.name}: its child process died during a call "
                            f"(exit status {self.exitcode})") from exc
        except Exception as exc:            # an answer that does not unpickle here
            raise SandboxError(f"{self.sandbox.name}: its answer could not be read: "
                               f"{exc!r}") from exc
        grown = _rss_bytes(self.proc.pid) - self.base_rss
        if grown > self.sandbox.max_growth_bytes:
            logger.info("%s: a child process grew by %d MiB; replacing it", self.sandbox.name,
                        grown >> 20)
            self.stop()
            self.sandbox.recycled += 1
        if kind == "error":
            raise value
        return value


class Sandbox(FairExecutor):
    """A ``FairExecutor`` whose jobs may run calls in child processes (``call``), each bounded
    by a deadline. ``run_isolated`` queues one such call as a job.

    ``preload``: modules the fork server imports once (what every call needs: the first child's
    start pays for it). ``initializer(*initargs)`` runs once in each child (it must be a
    module-level function, and its arguments picklable; ``initargs`` may be a function that
    makes them, called as each child starts). Children start at their worker's first call."""

    def __init__(self, name: str, *, timeout_s: float, preload: Sequence[str] = (),
                 initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] | Callable[[], tuple[Any, ...]] = (),
                 max_growth_bytes: int = 64 << 20, small_cost: float | None = None) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.preload = list(preload)
        self.initializer, self.initargs = initializer, initargs
        self.max_growth_bytes = max_growth_bytes
        self.started = self.killed = self.recycled = 0     # children, over the sandbox's life
        self._children: dict[bool, _Child] = {}
        self._ctx: Any = None
        self._ctx_lock = threading.Lock()
        self._local = threading.local()          # which worker thread a job runs on
        super().__init__(name, small_cost=small_cost)

    def context(self) -> Any:
        """The fork server's context; its preload is set by the first sandbox of the process to
        start one (the fork server is one per process)."""
        with self._ctx_lock:
            if self._ctx is None:
                ctx = multiprocessing.get_context("forkserver")
                if self.preload:
                    # __main__ too (multiprocessing's default): the fork server imports the main
                    # module once, and a child does not run it again.
                    ctx.set_forkserver_preload(["__main__", *self.preload])
                self._ctx = ctx
            return self._ctx

    def _execute(self, work: Callable[[], Any], small_only: bool) -> Any:
        self._local.small_only = small_only
        return work()

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None,
             cancel: threading.Event | None = None) -> T:
        """``fn(*args)`` in the calling worker thread's child process, within ``timeout_s``
        (default: the sandbox's). Only from a job running on this executor."""
        small_only = self._local.small_only
        child = self._children.get(small_only)
        if child is None:
            child = self._children[small_only] = _Child(self)
        return child.call(partial(fn, *args), self.timeout_s if timeout_s is None
                          else timeout_s, cancel)

    async def run_isolated(self, fn: Callable[..., T], *args: Any, cost: float,
                           timeout_s: float | None = None) -> T:
        """``fn(*args)`` in a child process, queued by its ``cost``; a caller that is cancelled
        (a client gone) stops the call, killing its process if it had started."""
        cancel = threading.Event()
        try:
            return await self.run(partial(self.call, fn, *args, timeout_s=timeout_s,
                                          cancel=cancel), cost)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def shutdown(self) -> None:
        """Stop taking jobs and kill the children (a call in progress fails with
        ``SandboxError``)."""
        super().shutdown()
        for child in list(self._children.values()):
            proc = child.proc
            if proc is not None:
                proc.kill()
                proc.join(5)
