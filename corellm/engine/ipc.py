"""The wire protocol between an engine-core client and an engine-core process.

Two ZeroMQ PUSH/PULL pipes over ``ipc://`` sockets; each message is two frames, a one-byte type
and a msgpack payload (msgspec). Payload types are fixed per message type, so decoding is typed
and no Python object is ever pickled. Start-up (ready, or why not) goes over a
``multiprocessing`` pipe before the sockets carry anything.
"""

from __future__ import annotations

from typing import Any

import msgspec

from corellm.errors import CorellmError
from corellm.outputs import EngineCoreOutputs, EngineStats
from corellm.request import EngineCoreRequest

# client -> core
ADD = b"A"            # EngineCoreRequest
ABORT = b"X"          # list[str]: engine-core request ids
UTILITY = b"U"        # UtilityCall
SHUTDOWN = b"Q"       # empty
CREDIT = b"C"         # int: OUTPUTS batches (with outputs) the client has finished processing

# core -> client
OUTPUTS = b"O"        # EngineCoreOutputs
UTILITY_RESULT = b"R"  # UtilityResult
DEAD = b"D"           # str: why the loop stopped


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    error: str | None = None
    result: msgspec.Raw = msgspec.Raw(b"\xc0")     # msgpack nil


# The methods a client may call between steps, with their result types.
UTILITY_RESULT_TYPES: dict[str, Any] = {
    "get_stats": EngineStats,
    "reset_prefix_cache": bool,
    "ping": float,            # answered by the busy loop between steps: proves it is stepping
}

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_call_decoder = msgspec.msgpack.Decoder(UtilityCall)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
utility_result_decoder = msgspec.msgpack.Decoder(UtilityResult)
str_decoder = msgspec.msgpack.Decoder(str)
int_decoder = msgspec.msgpack.Decoder(int)


class EngineDeadError(CorellmError):
    """The engine-core process is gone (crashed, killed, or failed a step); nothing more will
    come from it. In-flight requests end with this error."""


class EngineStartupError(CorellmError):
    """The engine-core process could not start (the message says why)."""
