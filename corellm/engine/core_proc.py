"""The engine core in its own process: a busy loop that drains new requests, steps, and pushes
outputs, so that HTTP parsing, tokenization and detokenization (in the client's process) never
stall the step loop.

Three threads: the main one runs the loop; one receives and decodes client messages into a
queue; one encodes and sends outputs from a queue, overlapping serialization with the next
step (ZeroMQ and msgspec release the GIL while they copy).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from corellm.engine import ipc
from corellm.outputs import EngineCoreOutput, EngineCoreOutputs

logger = logging.getLogger("corellm.engine_core")


class EngineCoreProc:
    def __init__(self, engine: Any, input_addr: str, output_addr: str) -> None:
        self.engine = engine
        self.inputs: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self._stop = False
        self._closing = False
        self._threads = [
            threading.Thread(target=self._recv_loop, args=(input_addr,), daemon=True,
                             name="corellm-core-input"),
            threading.Thread(target=self._send_loop, args=(output_addr,), daemon=True,
                             name="corellm-core-output"),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ socket threads
    def _recv_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        decoders = {ipc.ADD: ipc.request_decoder.decode, ipc.ABORT: ipc.abort_decoder.decode,
                    ipc.UTILITY: ipc.utility_call_decoder.decode, ipc.SHUTDOWN: lambda b: None}
        while not self._closing:
            if not sock.poll(200):
                continue
            kind, payload = sock.recv_multipart(copy=False)
            kind = bytes(kind.buffer)
            try:
                self.inputs.put((kind, decoders[kind](payload.buffer)))
            except Exception:   # a malformed message must not kill the engine
                logger.exception("dropping an undecodable %r message", kind)
        sock.close(linger=0)

    def _send_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)     # flush the last outputs (e.g. DEAD) on exit
        sock.connect(addr)
        while True:
            item = self.outputs.get()
            if item is None:
                sock.close()
                return
            kind, obj = item
            sock.send_multipart((kind, ipc.encoder.encode(obj)), copy=False)

    # ------------------------------------------------------------------ the loop
    def run_busy_loop(self) -> None:
        engine = self.engine
        while not self._stop:
            # Block only when there is nothing to step.
            self._handle_inputs(block=not engine.has_unfinished_requests())
            if self._stop:
                break
            if engine.has_unfinished_requests():
                outputs = engine.step()
                if outputs:
                    self._send_outputs(outputs)

    def _handle_inputs(self, block: bool) -> None:
        if block:
            try:
                self._handle(*self.inputs.get(timeout=1.0))
            except queue.Empty:
                return
        while not self._stop:
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, kind: bytes, payload: Any) -> None:
        if kind == ipc.ADD:
            try:
                self.engine.add_request(payload)
            except Exception as exc:    # one bad request (a duplicate id...) is not fatal
                logger.error("rejected request %s: %s", payload.request_id, exc)
                self._send_outputs([EngineCoreOutput(payload.request_id, [],
                                                     finish_reason="error",
                                                     stop_reason=str(exc))])
        elif kind == ipc.ABORT:
            outputs = self.engine.abort_requests(payload)
            if outputs:
                self._send_outputs(outputs)
        elif kind == ipc.UTILITY:
            self._call_utility(payload)
        elif kind == ipc.SHUTDOWN:
            self._stop = True

    def _call_utility(self, call: ipc.UtilityCall) -> None:
        result: Any = None
        error = None
        if call.method not in ipc.UTILITY_RESULT_TYPES:
            error = f"unknown utility method {call.method!r}"
        else:
            try:
                result = time.time() if call.method == "ping" else \
                    getattr(self.engine, call.method)(*call.args)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self.outputs.put((ipc.UTILITY_RESULT, ipc.UtilityResult(
            call.call_id, error, ipc.msgspec.Raw(ipc.encoder.encode(result)))))

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.outputs.put((ipc.OUTPUTS, EngineCoreOutputs(outputs, time.time())))

    def send_dead(self, reason: str) -> None:
        self.outputs.put((ipc.DEAD, reason))

    def close(self) -> None:
        self._closing = True
        self.outputs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        if not any(t.is_alive() for t in self._threads):
            self.ctx.term()        # else: a stuck socket; process exit reclaims it


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (killed with SIGKILL, say): an engine
    nobody can reach must not hold the accelerator or the port's memory forever."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            logger.error("parent process %d is gone; engine core exiting", parent_pid)
            os._exit(1)


def run_engine_core(config_data: dict[str, Any], input_addr: str, output_addr: str,
                    ready: Connection, parent_pid: int, log_level: int) -> None:
    """Entry point of the engine-core process (started with the spawn method)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the client coordinates shutdown, so the core
    # ignores SIGINT and leaves on SIGTERM or a SHUTDOWN message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="corellm-parent-watch").start()

    engine = proc = None
    try:
        from corellm.config import load_config
        from corellm.engine.core import EngineCore
        from corellm.plugins import load_registry

        registry = load_registry(disable=(config_data.get("plugins") or {}).get("disable", []))
        config = load_config(config_data, registry=registry)
        engine = EngineCore(config, registry)
        proc = EngineCoreProc(engine, input_addr, output_addr)
    except BaseException as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        if engine is not None:
            engine.shutdown()
        raise SystemExit(1) from None
    mi = engine.model_info
    ready.send(("ready", {"vocab_size": mi.vocab_size, "max_model_len": mi.max_model_len,
                          "architecture": mi.architecture, "pid": os.getpid()}))
    ready.close()

    code = 0
    error: BaseException | None = None
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as exc:
        code, error = 1, exc
        logger.error("engine core failed: %s", "".join(traceback.format_exception(exc)))
        proc.send_dead(f"engine core step failed: {type(exc).__name__}: {exc}")
    finally:
        # The client sends SIGTERM 10 s after asking us to stop: let the stop hooks (sinks
        # flushing) finish instead of being cut by a SystemExit; SIGKILL follows 5 s later.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            engine.shutdown(error)
        finally:
            proc.close()
    raise SystemExit(code)
