"""The server's connections: how many it holds, and how long a client may take to send a request
head and its body (the log that a flood of connections cannot flood: ``log_repeats``).

A connection costs the process an open file. Left to asyncio, the listening socket is accepted
from until the file limit is reached; then ``accept()`` fails with EMFILE, asyncio logs each
failure with its traceback (in a tight loop) and nothing new gets in, not even
``/health``, for as long as the held connections stay open. Here the listening socket is served
by a ``Listener`` that holds at most ``frontend.max_connections`` connections, which by default
is what the file limit leaves once the engine's own files are open. At the cap it makes room by
closing the connection that has waited longest for a request head (an idle keep-alive or a slow
client: nothing in progress is lost), as nginx reuses its idle connections when
``worker_connections`` runs out, else the one that has been receiving a request body longest
(its request cannot have started to be served); only when every connection has its whole
request in and a response in progress is a new one refused, with a canned 503 written without
parsing anything. A connection that has not sent a complete request head within
``frontend.header_timeout_s`` is closed (a 408 when part of a head came), and so is one whose
body does not keep arriving: ``frontend.body_timeout_s``, then ``frontend.body_min_rate`` bytes a
second (a 408), as Apache's mod_reqtimeout does; so slow clients give their files back.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
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
class _Flow(FlowControl):
    """uvicorn's flow control, which also counts the time reading is paused: uvicorn stops
    reading a body while the app has not taken the last 64 KiB read (``HIGH_WATER_LIMIT``), and
    that time is the server's, not the client's, so the body deadline does not count it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.clock = asyncio.get_running_loop().time
        self.paused_at: float | None = None
        self.paused_total = 0.0

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.paused_at = self.clock()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.paused_at is not None:
            self.paused_total += self.clock() - self.paused_at
            self.paused_at = None
        super().resume_reading()

    def paused_s(self) -> float:
        """Seconds reading has been paused so far, a pause in progress included."""
        now = 0.0 if self.paused_at is None else self.clock() - self.paused_at
        return self.paused_total + now


class Connection(H11Protocol):
    """uvicorn's h11 protocol, on a deadline while it waits for a request head or receives a
    request body, and known to its ``Listener``, which may close it then to make room.

    A new connection has ``header_timeout_s`` to send its first request head. Between requests
    uvicorn's keep-alive timeout closes an idle connection, but any byte cancels that timer, so
    from a next request's first byte its head has ``header_timeout_s`` too.

    A body (h11's ``SEND_BODY``: the head came, the body has not all come) has
    ``body_timeout_s`` from the end of the head, extended by a second for every
    ``body_min_rate`` bytes received (0: the whole body within ``body_timeout_s``), as Apache's
    mod_reqtimeout does with ``body=10,MinRate=500``: a client on a slow link keeps sending, one
    that drips a byte a second to hold the connection does not. Time while the server has paused
    reading (the app has not taken the body read so far) is not counted. The deadline is
    checked when it is due, not on every read, so a fast body costs a counter."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], *,
                 listener: Listener, header_timeout_s: float, body_timeout_s: float,
                 body_min_rate: int) -> None:
        super().__init__(config, server_state, app_state)
        self.listener = listener
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s, self.body_min_rate = body_timeout_s, body_min_rate
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_started = False          # some bytes of the awaited head have come
        self.body_timer: asyncio.TimerHandle | None = None
        self.body_started = 0.0            # loop time at the end of the current request's head
        self.body_received = 0             # bytes read since (the body's, its framing's)
        self.body_paused = 0.0             # the flow's paused_s() then
        self.held = True                   # counted in the listener's ``held``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport)
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.head_timed_out)
        self.listener.waiting(self)

    def data_received(self, data: bytes) -> None:
        receiving = self.body_timer is not None
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if receiving:
                self.body_received += len(data)
            else:
                self.start_body()
            return
        self.end_body()
        if state is h11.IDLE:
            # Some bytes of a head; or a body that ended after its response was sent (a 413 or
            # 415 is answered without reading the body), and then maybe the next head's first.
            self.head_started = not receiving or bool(self.conn.trailing_data[0])
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(self.header_timeout_s,
                                                       self.head_timed_out)
            if receiving:
                self.listener.waiting(self)
        else:
            self.cancel_head_timer()
            self.listener.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self.head_started = False
            self.listener.waiting(self)
        elif self.conn.their_state is h11.SEND_BODY and self.body_timer is None:
            self.start_body()           # a pipelined request's head, read with the response

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.cancel_head_timer()
        self.end_body()
        self.listener.release(self)

    def start_body(self) -> None:
        self.cancel_head_timer()
        self.body_started = self.loop.time()
        self.body_received = 0
        self.body_paused = self.flow.paused_s()
        self.body_timer = self.loop.call_later(self.body_timeout_s, self.body_timed_out)
        self.listener.receiving(self)

    def end_body(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def body_deadline(self) -> float:
        if not self.body_min_rate:
            extension = 0.0
        else:
            extension = self.body_received / self.body_min_rate
        paused = self.flow.paused_s() - self.body_paused
        return self.body_started + self.body_timeout_s + extension + paused

    def body_timed_out(self) -> None:
        self.body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # Not the client's time: look again once the app may have taken the body.
            self.body_timer = self.loop.call_later(self.body_timeout_s, self.body_timed_out)
            return
        deadline = self.body_deadline()
        if now < deadline:
            self.body_timer = self.loop.call_at(deadline, self.body_timed_out)
            return
        self.cancel_head_timer()
        started = self.cycle is not None and self.cycle.response_started
        if not started:
            # The app, if it is awaiting the body, sees the client gone when the transport is;
            # no response of its own can follow the 408 (the transport takes no more writes).
            self.transport.write(_TIMED_OUT)
            _discard_input(self.transport)
        logger.info("closed the connection from %s: its request body was not received in time "
                    "(%d bytes in %.1f s; frontend.body_timeout_s %g, then "
                    "frontend.body_min_rate %d bytes/s)", _peer(self.client),
                    self.body_received, now - self.body_started, self.body_timeout_s,
                    self.body_min_rate)
        if started or self.transport.get_write_buffer_size():
            # A response begun, a 408 would corrupt; a client that does not read would hold
            # the file.
            self.transport.abort()
        else:
            self.transport.close()

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
        """Close the connection, which waits for a request head or is receiving a body, to make
        room for a new one: aborted, so that its file is free on the loop's next turn even if
        the client has left part of an earlier response unread (an app awaiting the body sees
        the client gone)."""
        self.cancel_head_timer()
        self.end_body()
        self.transport.abort()


def _discard_input(transport: asyncio.Transport) -> None:
    """Read and drop what the client has sent that the loop has not read yet (a few reads at
    most): a socket closed with unread input is reset, not closed, and a client that gets the
    reset may lose the answer written just before it."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        for _ in range(4):
            if not os.read(sock.fileno(), 65536):
                return
    except OSError:                 # BlockingIOError: nothing more
        pass


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class Listener:
    """Accepts connections on a listening socket, holding at most ``cap``; takes the place of
    asyncio's server (uvicorn closes it, with ``close`` and ``wait_closed``, at shutdown).

    ``held`` counts the connections from accept until their transport is gone, so the files in
    use stay within the cap plus those being closed; ``idle`` holds the connections waiting for a
    request head, oldest first: those are the ones closed to make room; then ``receiving``, the
    connections receiving a request body, by when their body began. Without them, clients that
    send a head on time and then a body a byte a second hold every connection until their body
    deadline, and keep doing so by reconnecting; closing the oldest keeps ``/health`` and new
    requests coming in. A connection with its whole request in and a response in progress is
    never closed to make room."""

    def __init__(self, sock: socket.socket, cap: int,
                 make_protocol: Callable[[Listener], Connection]) -> None:
        self.sock, self.cap, self.make_protocol = sock, cap, make_protocol
        self.loop = asyncio.get_running_loop()
        self.held = 0
        self.idle: dict[Connection, None] = {}
        self.receivers: dict[Connection, None] = {}
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
        """Close the connection that has waited longest for a request head, else the one that
        has been receiving a request body longest; False if none does either."""
        protocol = self._evict_first(self.idle)
        if protocol is not None:
            logger.warning("at the limit of %d connections (frontend.max_connections): closed "
                           "the one that waited longest for a request (from %s) to take a new "
                           "one", self.cap, _peer(protocol.client))
            return True
        protocol = self._evict_first(self.receivers)
        if protocol is not None:
            logger.warning("at the limit of %d connections (frontend.max_connections): closed "
                           "the one that has been receiving a request body longest (from %s) "
                           "to take a new one", self.cap, _peer(protocol.client))
            return True
        return False

    def _evict_first(self, queue: dict[Connection, None]) -> Connection | None:
        """Close the first connection of ``queue`` not closing already (one that timed out is
        until the loop's next turn); None if there is none."""
        while queue:
            protocol = next(iter(queue))
            del queue[protocol]
            if not protocol.transport.is_closing():
                self.evicting.add(protocol)
                protocol.evict()
                return protocol
        return None

    # ------------------------------------------------------------------ from connections
    def waiting(self, protocol: Connection) -> None:
        self.receivers.pop(protocol, None)
        self.idle.pop(protocol, None)
        self.idle[protocol] = None

    def receiving(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)
        self.receivers.pop(protocol, None)
        self.receivers[protocol] = None

    def busy(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)
        self.receivers.pop(protocol, None)

    def release(self, protocol: Connection) -> None:
        self.idle.pop(protocol, None)
        self.receivers.pop(protocol, None)
        self.evicting.discard(protocol)
        if protocol.held:
            protocol.held = False
            self.held -= 1
