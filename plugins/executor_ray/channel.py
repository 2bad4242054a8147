"""Messages over a TCP connection: an 8-byte length, then the pickle. The Ray executor's link to
each rank (its replies to ``collective_rpc``, its failure, and for a rank on another node the
plans and rank 0's outputs, which ranks on the driver's node take through the shared-memory
ring)."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_LEN = struct.Struct("!Q")
TOKEN_BYTES = 16
_HELLO = struct.Struct("!BI")          # kind (0 link, 1 doorbell), rank
HANDSHAKE_TIMEOUT_S = 10.0


def connect(address: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def greet(sock: socket.socket, token: bytes, kind: str, rank: int) -> None:
    """A rank's first bytes on a new connection: the executor's token, then which link it is.
    Nothing is unpickled from a peer before its token matched."""
    sock.sendall(token + _HELLO.pack(0 if kind == "link" else 1, rank))


def hello(sock: socket.socket, token: bytes, ranks: int) -> tuple[str, int] | None:
    """The executor's side of ``greet``: (kind, rank), or None for a peer that is not one of
    its ranks (a wrong token, a bad rank, or nothing within ``HANDSHAKE_TIMEOUT_S``)."""
    import hmac
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        got = _exactly(sock, len(token) + _HELLO.size)
    except (OSError, ConnectionError):
        return None
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(bytes(got[:len(token)]), token):
        return None
    kind, rank = _HELLO.unpack(bytes(got[len(token):]))
    if kind > 1 or rank >= ranks:
        return None
    return ("link" if kind == 0 else "bell"), rank


def send(sock: socket.socket, obj: Any) -> None:
    send_bytes(sock, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data if len(data) < 65536 else _LEN.pack(len(data)))
    if len(data) >= 65536:
        sock.sendall(data)


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return buf


def recv(sock: socket.socket) -> Any:
    """The next message; ``ConnectionError`` when the other end is gone."""
    (n,) = _LEN.unpack(_exactly(sock, _LEN.size))
    return pickle.loads(_exactly(sock, n))
