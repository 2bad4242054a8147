"""A shared-memory ring buffer: one writer, N readers on the same machine.

Every step the engine broadcasts its plan to the worker processes through one of these, and rank
0 returns its sampled tokens through another. A message is pickled once and copied once into
shared memory whatever the number of readers (a pipe per worker would copy it through the
kernel once per worker); a message longer than a slot spans consecutive slots, so any size
goes through with flow control. Nothing spins: after writing, the writer rings each reader's
doorbell (one byte down a pipe) and a reader with nothing to read blocks on its doorbell, so
idle workers take no CPU from the busy ones (on a 2-core machine a spinning reader would).

Layout (one ``mmap`` of a file in ``/dev/shm``, unlinked once every process has mapped it, so
nothing outlives the processes even after ``kill -9``)::

    [read count of reader 0 .. N-1, one 64-byte line each]
    [slot 0: seq (int64), chunk bytes (int64), last chunk (int64), pad to 64 | data]
    [slot 1 ...]

Message k's chunk goes to slot ``k % slots`` once every reader has read message ``k - slots``;
a slot's ``seq`` is written after its data, and a reader reads it when ``seq`` equals its own
count. (The writer and readers are single processes each; x86 and ARM64 CPython processes see
the ``seq`` store after the data stores, as vLLM's shared-memory broadcast also relies on.)
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import pickle
import select
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_LINE = 64
_SLOT_HEADER = struct.Struct("qqq")     # seq + 1 (0 = never written), nbytes, last
_COUNT = struct.Struct("q")


class RingClosed(Exception):
    """The other side of the ring is gone (its process exited)."""


@dataclass
class RingSpec:
    """What a process needs to map a ring (picklable across ``spawn``)."""

    path: str
    num_readers: int
    slots: int
    slot_bytes: int


def _size(spec: RingSpec) -> int:
    return _LINE * spec.num_readers + spec.slots * (_LINE + spec.slot_bytes)


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def create_ring(num_readers: int, slots: int, slot_bytes: int) -> RingSpec:
    """Create the backing file (zeroed); the creator unlinks it with ``unlink_ring`` once every
    process has mapped it."""
    fd, path = tempfile.mkstemp(prefix="corellm-ring-", dir=_shm_dir())
    spec = RingSpec(path, num_readers, slots, slot_bytes)
    try:
        os.ftruncate(fd, _size(spec))
    finally:
        os.close(fd)
    return spec


def unlink_ring(spec: RingSpec) -> None:
    try:
        os.unlink(spec.path)
    except FileNotFoundError:
        pass


class _Mapped:
    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        fd = os.open(spec.path, os.O_RDWR)
        try:
            self.buf = mmap.mmap(fd, _size(spec))
        finally:
            os.close(fd)
        self.view = memoryview(self.buf)
        self._slots_at = _LINE * spec.num_readers

    def slot(self, index: int) -> int:
        return self._slots_at + index * (_LINE + self.spec.slot_bytes)

    def read_count(self, reader: int) -> int:
        return _COUNT.unpack_from(self.buf, reader * _LINE)[0]

    def close(self) -> None:
        try:
            self.view.release()
            self.buf.close()
        except (BufferError, ValueError):
            pass


class RingWriter:
    """The writing end. ``doorbells``: one write end (a ``multiprocessing`` Connection) per
    reader. ``alive()`` is called while waiting for space and raises when waiting is futile."""

    def __init__(self, spec: RingSpec, doorbells: list[Any],
                 alive: Callable[[], None] | None = None) -> None:
        self.m = _Mapped(spec)
        self.spec = spec
        self.doorbells = [d.fileno() for d in doorbells]
        self._keep = doorbells
        self.alive = alive
        self.count = 0          # messages (chunks) written

    def write(self, obj: Any) -> int:
        """Pickle ``obj`` into the ring; returns the bytes written."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.write_bytes(data)
        return len(data)

    def write_bytes(self, data: bytes) -> None:
        spec, m = self.spec, self.m
        step = spec.slot_bytes
        chunks = range(0, max(len(data), 1), step)
        for i, start in enumerate(chunks):
            chunk = data[start:start + step]
            self._wait_for_space()
            at = m.slot(self.count % spec.slots)
            m.view[at + _LINE:at + _LINE + len(chunk)] = chunk
            struct.pack_into("qq", m.buf, at + 8, len(chunk), int(i == len(chunks) - 1))
            _COUNT.pack_into(m.buf, at, self.count + 1)      # publish: seq last
            self.count += 1
            for fd in self.doorbells:
                try:
                    os.write(fd, b"\x01")
                except BlockingIOError:      # the pipe is full of unread rings: it is awake
                    pass
                except OSError as exc:
                    raise RingClosed(f"a reader's doorbell is closed ({exc})") from exc

    def _wait_for_space(self) -> None:
        oldest = self.count - self.spec.slots
        if oldest < 0:
            return
        delay = 1e-5
        while min(self.m.read_count(r) for r in range(self.spec.num_readers)) <= oldest:
            if self.alive is not None:
                self.alive()
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def close(self) -> None:
        self.m.close()


class RingReader:
    """The reading end of reader ``index``; ``doorbell``: the read end of its pipe."""

    def __init__(self, spec: RingSpec, index: int, doorbell: Any) -> None:
        self.m = _Mapped(spec)
        self.spec = spec
        self.index = index
        self.doorbell = doorbell
        self.fd = doorbell.fileno()
        os.set_blocking(self.fd, False)
        self.count = self.m.read_count(index)

    def _ready(self) -> bool:
        at = self.m.slot(self.count % self.spec.slots)
        return _COUNT.unpack_from(self.m.buf, at)[0] == self.count + 1

    def poll(self) -> bool:
        """Whether a message (its first chunk) is ready now."""
        return self._ready()

    def wait(self, timeout: float | None) -> bool:
        """Block until a chunk is ready or ``timeout`` seconds pass; True when one is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                try:
                    if not os.read(self.fd, 65536):
                        if not self._ready():
                            raise RingClosed("the ring's writer is gone")
                except BlockingIOError:
                    pass
        return True

    def read(self, timeout: float | None = None,
             idle: Callable[[], None] | None = None, idle_every: float = 1.0) -> Any:
        """The next message, unpickled. Waits up to ``timeout`` (None: for ever), calling
        ``idle()`` every ``idle_every`` seconds while waiting (to notice a dead peer); raises
        TimeoutError when the time runs out."""
        parts = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                wait = idle_every if left is None else min(idle_every, max(left, 0.0))
                if self.wait(wait):
                    break
                if left is not None and left <= wait:
                    raise TimeoutError("no message")
                if idle is not None:
                    idle()
            m = self.m
            at = m.slot(self.count % self.spec.slots)
            nbytes, last = struct.unpack_from("qq", m.buf, at + 8)
            parts.append(bytes(m.view[at + _LINE:at + _LINE + nbytes]))
            self.count += 1
            _COUNT.pack_into(m.buf, self.index * _LINE, self.count)
            if last:
                break
        return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.m.close()


def doorbell_pair() -> tuple[Any, Any]:
    """(read end, write end) of a doorbell pipe, passable to a spawned process."""
    r, w = mp.Pipe(duplex=False)
    os.set_blocking(w.fileno(), False)
    return r, w
