"""The server's connections: how many it holds, how long a client may take to send a request
head, and a log that a flood of connections cannot flood.

A connection costs the process an open file. Left to asyncio, the listening socket is accepted
from until the file limit is reached; then ``accept()`` fails with EMFILE, asyncio logs each
failure with its traceback (in a tight loop) and nothing new gets in, not even
``/health``, for as long as the held connections stay open. Here the listening socket is served
by a ``Listener`` that holds at most ``frontend.max_connections`` connections, which by default
is what the file limit leaves once the engine's own files are open. At the cap it makes room by
closing the connection that has waited longest for a request head (an idle keep-alive or a slow
client: nothing in progress is lost), as nginx reuses its idle connections when
``worker_connections`` runs out; only when every connection has a request in progress is a new
one refused, with a canned 503 written without parsing anything. A connection that has not sent
a complete request head within ``frontend.header_timeout_s`` is closed (a 408 when part of a
head came), so slow clients give their files back.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from corellm.errors import CorellmError

logger = logging.getLogger("corellm.server")

# Files kept free beyond those open when the server starts: files opened later (a tokenizer's,
# a log's, a pipe), the connections being closed to make room, and the one accepted only to be
# refused all need one.
FILE_RESERVE = 64
# The soft file limit is raised toward the hard one up to this, not to a container's usual hard
# limit of 1,048,576: each held connection also holds memory in the API process (its transport
# and a partly read head), so the file limit bounds that memory too, and this one keeps it to
# what a server can spare (the per-connection figure: docs/server.md).
FILE_LIMIT_TARGET = 65536
# Connections accepted per wake-up of the listening socket (asyncio takes the listen backlog,
# 2048, at once): a burst of connections then cannot run ahead of the cap's bookkeeping.
ACCEPT_BATCH = 64
# Most connections being closed to make room at once: each holds its file until the loop's next
# turn, and FILE_RESERVE covers them.
EVICTING_MAX = 16
# How long accepting pauses when the process is out of files anyway (files that are not
# connections: the cap already leaves room for those it knows of).
ACCEPT_RETRY_S = 0.1
# What a refused connection is told to wait before retrying.
RETRY_AFTER_S = 5


def _canned(status: bytes, headers: list[bytes], body: bytes) -> bytes:
    head = [b"HTTP/1.1 " + status, *headers, b"Content-Length: %d" % len(body),
            b"Connection: close", b"X-Content-Type-Options: nosniff"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


# Answers written straight to the socket: neither needs the request, which the client has not
# sent (408) or the server will not read (503).
_REFUSED = _canned(b"503 Service Unavailable", [
    b"Content-Type: application/json", b"Retry-After: %d" % RETRY_AFTER_S],
    json.dumps({"error": {
        "message": "too many connections: every connection the server holds "
                   "(frontend.max_connections) has a request in progress; retry later",
        "type": "service_unavailable", "param": None, "code": "too_many_connections"}}).encode())
_TIMED_OUT = _canned(b"408 Request Timeout", [], b"")


# --------------------------------------------------------------------------- the file limit
def open_files() -> int:
    """How many files this process has open (0 where the platform does not say)."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path)) - 1         # less the directory being listed
        except OSError:
            continue
    return 0


def connection_cap(configured: int | None) -> int:
    """The most connections the server holds: ``configured`` (``frontend.max_connections``), or
    by default what the file limit (at most ``FILE_LIMIT_TARGET``) leaves after the files open
    now and ``FILE_RESERVE``. The soft limit is raised first, toward the hard limit: as far as
    ``configured`` needs, or up to ``FILE_LIMIT_TARGET`` by default (systemd's default limits,
    1,024 soft and 524,288 hard, expect a program that needs more files to raise its own).
    Call it once the engine core has started, so its pipes and sockets are counted and the core
    process keeps the limit it was started with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_files()
    unlimited = resource.RLIM_INFINITY
    wanted = FILE_LIMIT_TARGET if configured is None else configured + in_use + FILE_RESERVE
    if hard != unlimited and wanted > hard:
        if configured is not None:
            raise CorellmError(
                f"frontend.max_connections: {configured} connections need about {wanted} open "
                f"files ({in_use} are in use, {FILE_RESERVE} kept free), over this process's "
                f"hard limit of {hard} (ulimit -Hn); lower it or raise the limit")
        wanted = hard
    if soft != unlimited and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted,
                           exc)
    if configured is not None:
        if soft != unlimited and configured > soft - in_use - FILE_RESERVE:
            raise CorellmError(
                f"frontend.max_connections: {configured} connections need about "
                f"{configured + in_use + FILE_RESERVE} open files; the limit is {soft} "
                f"(ulimit -n) with {in_use} in use; lower it or raise the limit")
        return configured
    # FILE_LIMIT_TARGET bounds the default also where the limit was higher to begin with.
    limit = FILE_LIMIT_TARGET if soft == unlimited else min(soft, FILE_LIMIT_TARGET)
    room = limit - in_use - FILE_RESERVE
    if room < 1:
        raise CorellmError(
            f"frontend.max_connections: no open files are left for connections: the limit is "
            f"{soft} (ulimit -n), {in_use} are in use and {FILE_RESERVE} are kept free; raise "
            f"the limit")
    return room


# --------------------------------------------------------------------------- connections
class Connection(H11Protocol):
    """uvicorn's h11 protocol, on a deadline while it waits for a request head and known to its
    ``Listener``, which may close it then to make room.

    A new connection has ``header_timeout_s`` to send its first request head. Between requests
    uvicorn's keep-alive timeout closes an idle connection, but any byte cancels that timer, so
    from a next request's first byte its head has ``header_timeout_s`` too."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], *,
                 listener: Listener, header_timeout_s: float) -> None:
        super().__init__(config, server_state, app_state)
        self.listener = listener
        self.header_timeout_s = header_timeout_s
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_started = False          # some bytes of the awaited head have come
        self.held = True                   # counted in the listener's ``held``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.head_timed_out)
        self.listener.waiting(self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self.head_started = True
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(self.header_timeout_s,
                                                       self.head_timed_out)
        else:
            self.cancel_head_timer()
            self.listener.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.head_started = False
            self.listener.waiting(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.cancel_head_timer()
        self.listener.release(self)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.head_started:
            # A client that sent nothing is a client that opened a connection it did not use:
            # closed quietly. One that began a head and stalled is answered and logged.
            self.transport.write(_TIMED_OUT)
            logger.info("closed the connection from %s: no complete request head within %g s "
                        "(frontend.header_timeout_s)", _peer(self.client), self.header_timeout_s)
        if self.transport.get_write_buffer_size():
            self.transport.abort()      # a client that does not read would hold the file
        else:
            self.transport.close()

    def evict(self) -> None:
        """Close the connection, which waits for a request head, to make room for a new one:
        aborted, so that its file is free on the loop's next turn even if the client has left
        part of an earlier response unread."""
        self.cancel_head_timer()
        self.transport.abort()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class Listener:
    """Accepts connections on a listening socket, holding at most ``cap``; takes the place of
    asyncio's server (uvicorn closes it, with ``close`` and ``wait_closed``, at shutdown).

    ``held`` counts the connections from accept until their transport is gone, so the files in
    use stay within the cap plus those being closed; ``idle`` holds the connections waiting for a
    request head, oldest first: those are the ones closed to make room."""

    def __init__(self, sock: socket.socket, cap: int,
                 make_protocol: Callable[[Listener], Connection]) -> None:
        self.sock, self.cap, self.make_protocol = sock, cap, make_protocol
        self.loop = asyncio.get_running_loop()
        self.held = 0
        self.idle: dict[Connection, None] = {}
        self.evicting: set[Connection] = set()
        self.pending: set[asyncio.Task] = set()
        self.reading = False
        self.retry: asyncio.TimerHandle | None = None
        self.closed = False

    def start(self) -> None:
        if not self.closed and not self.reading:
            self.loop.add_reader(self.sock.fileno(), self.accept)
            self.reading = True

    def pause(self, delay: float) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        self.retry = self.loop.call_later(delay, self.resume)

    def resume(self) -> None:
        self.retry = None
        self.start()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.retry is not None:
            self.retry.cancel()
        self.sock.close()

    async def wait_closed(self) -> None:
        return None

    # ------------------------------------------------------------------ accepting
    def accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            if self.held >= self.cap and len(self.evicting) >= EVICTING_MAX:
                return          # the connections being closed give their files back first
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                out_of_files = exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                             errno.ENOMEM)
                logger.error("cannot accept connections: %s (%d held, frontend.max_connections "
                             "%d; %d files open, limit %d); %sretrying in %g s", exc.strerror,
                             self.held, self.cap, open_files(),
                             resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                             "closing idle connections and " if out_of_files else "",
                             ACCEPT_RETRY_S)
                if out_of_files:
                    for _ in range(EVICTING_MAX):
                        if not self.evict_oldest():
                            break
                self.pause(ACCEPT_RETRY_S)
                return
            if self.held < self.cap or self.evict_oldest():
                self.admit(conn)
            else:
                self.refuse(conn)

    def admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.held += 1
        made: list[Connection] = []

        def protocol() -> Connection:
            made.append(self.make_protocol(self))
            return made[0]

        async def connect() -> None:
            try:
                await self.loop.connect_accepted_socket(protocol, conn)
            except BaseException as exc:
                conn.close()
                if made:
                    self.release(made[0])
                else:
                    self.held -= 1
                if not isinstance(exc, Exception):
                    raise
                logger.warning("could not set up a connection: %s", exc)

        task = self.loop.create_task(connect())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def refuse(self, conn: socket.socket) -> None:
        """Answer 503 and close at once. Whatever request the client has sent is read first:
        closing a socket with unread data resets the connection, and the client would see a
        reset instead of the 503."""
        try:
            conn.setblocking(False)
            conn.recv(65536)
        except OSError:
            pass
        try:
            conn.send(_REFUSED)
        except OSError:
            pass
        conn.close()
        logger.warning("refused a connection: all %d connections (frontend.max_connections) "
                       "have a request in progress", self.cap)

    def evict_oldest(self) -> bool:
        """Close the connection that has waited longest for a request head; False if none
        does."""
        for protocol in self.idle:
            del self.idle[protocol]
            if protocol.transport.is_closing():
                continue
            self.evicting.add(protocol)
            protocol.evict()
            logger.warning("at the limit of %d connections (frontend.max_connections): closed "
                           "the one that waited longest for a request (from %s) to take a new "
                           "one", self.cap, _peer(protocol.client))
            return True
        return False

    # ------------------------------------------------------------------ from connections
    def waiting(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)
        self.idle[protocol] = None

    def busy(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)

    def release(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)
        self.evicting.discard(protocol)
        if protocol.held:
            protocol.held = False
            self.held -= 1


# --------------------------------------------------------------------------- the log
def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:              # noqa: BLE001 - arguments that do not fit: the handler
        # reports those when it formats the record
        text = str(record.msg)
    return text.split("\n", 1)[0]


class RepeatFilter(logging.Filter):
    """Lets the first of a run of like records through and counts the rest: records are alike
    when they come from the same logger at the same level with the same message template, so a
    line logged per connection collapses whatever address it names. ``flush`` (called every
    ``window_s``) logs, for each run that had repeats and whose window has passed, one line
    saying how many were left out; the first record after the window starts a new run.

    Installed on handlers, it sees a record once per handler: the decision for the last record
    is remembered, so one record is counted once."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        # (logger, level, template) -> [start, repeats, the first record's first line]
        self.runs: dict[tuple[str, int, str], list[Any]] = {}
        self.lock = threading.Lock()
        self.last: tuple[logging.LogRecord | None, bool] = (None, True)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "corellm_repeats", None) is not None:
            return True
        now = self.clock()
        ended = None
        with self.lock:
            if self.last[0] is record:
                return self.last[1]
            key = (record.name, record.levelno, str(record.msg))
            run = self.runs.get(key)
            if run is not None and now - run[0] < self.window_s:
                run[1] += 1
                self.last = (record, False)
                return False
            if run is not None and run[1]:
                ended = run
            self.runs[key] = [now, 0, _first_line(record)]
            self.last = (record, True)
        if ended is not None:
            self._summarize(key, ended)
        return True

    def flush(self, everything: bool = False) -> None:
        """Summarize the runs whose window has passed (``everything``: all runs)."""
        now = self.clock()
        with self.lock:
            ended = [(k, run) for k, run in self.runs.items()
                     if everything or now - run[0] >= self.window_s]
            for k, _ in ended:
                del self.runs[k]
        for k, run in ended:
            if run[1]:
                self._summarize(k, run)

    def _summarize(self, key: tuple[str, int, str], run: list[Any]) -> None:
        name, level, _ = key
        logging.getLogger(name).log(level, "%s [and %d more like it within %g s]", run[2],
                                    run[1], self.window_s, extra={"corellm_repeats": run[1]})

    def install(self) -> Callable[[], None]:
        """Add the filter to every handler of the root logger and of the loggers that have
        their own (uvicorn's); return what removes it."""
        handlers = {id(h): h for h in logging.getLogger().handlers}
        for item in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(item, logging.Logger):
                handlers.update((id(h), h) for h in item.handlers)
        for handler in handlers.values():
            handler.addFilter(self)

        def remove() -> None:
            self.flush(everything=True)
            for handler in handlers.values():
                handler.removeFilter(self)
        return remove
