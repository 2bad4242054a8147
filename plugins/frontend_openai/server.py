"""The OpenAI-compatible server: FastAPI routes over an ``AsyncLLM`` whose engine core runs in
its own process, served by uvicorn.

Nothing a single request asks for may stall the others: what it may ask for is bounded
(``frontend.limits``, and a text is refused by its length when it cannot fit the context),
parsing large bodies, chat templates and tokenization run on worker threads that take the
cheapest job first (``corellm.serving.fair.FairExecutor``), and outputs are processed in short
slices (``AsyncLLM``), so the event loop answers ``/health`` and other clients while the largest
allowed request runs. On SIGTERM/SIGINT the server drains: new requests get 503, running ones
may finish within ``frontend.drain_timeout_s``, the rest end with an error event naming the
shutdown, then every process exits.

This module is the ``Frontend``: it binds the port, starts the engine and uvicorn, and stops
them. The rest lives beside it: the app and its routes (``app.py``), what each route does
(``serving.py``), request bodies (``body.py``), errors (``errors.py``), server-sent events
(``streaming.py``), the Host, API-key and drain checks (``guard.py``) and the connections
(``connections.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import typing
from collections.abc import Callable
from typing import Any

from corellm.components import BuildContext
from corellm.engine.async_llm import AsyncLLM
from corellm.errors import CorellmError, RequestAbortedError
from corellm.interfaces import Frontend
from corellm.engine.logs import configured as logs_configured
from corellm.checkpoint.reader import checkpoint_name

from .app import build_app
from .guard import ServerState
from .options import API_KEY_ENV, OpenAIServerOptions

if typing.TYPE_CHECKING:
    from .log_repeats import RepeatFilter

logger = logging.getLogger("corellm.server")


def default_model_name(config: Any) -> str:
    return checkpoint_name(config.model.path)


# After the drain: how long ended requests get to send their last event, uvicorn gets to close
# connections, and the engine core gets to stop before it is killed.
SETTLE_S = 2.0
ENGINE_STOP_TIMEOUT_S = 5.0
# Like log records within this time collapse into the first and a count (connections.py).
LOG_REPEAT_WINDOW_S = 10.0
# Said once the server is up: small models' sampled answers look broken, and a user who sent
# no temperature may not know that OpenAI's default of 1 applies.
TEMPERATURE_HINT = ('requests without "temperature" are sampled at temperature 1.0 (OpenAI\'s '
                    'default); send "temperature": 0 for greedy, repeatable answers')


def _uvicorn_server(config: Any, sock: socket.socket, cap: int, header_timeout_s: float,
                    on_serving: Callable[[], None] | None = None, *,
                    body_timeout_s: float = 10.0, body_min_rate: int = 500) -> Any:
    """uvicorn's server with its own signal capture turned off (``OpenAIServer`` handles
    SIGINT/SIGTERM itself: drain, then stop, for the whole life of the engine), serving ``sock``
    through a ``Listener`` instead of asyncio's server: asyncio accepts until the process runs
    out of files, the ``Listener`` holds at most ``cap`` connections and closes those that do
    not send a request head within ``header_timeout_s``, or a body within ``body_timeout_s``
    and then at ``body_min_rate`` bytes a second (see connections.py; the defaults are the
    options'). ``on_serving`` is called just before the listener takes its first connection."""
    import uvicorn

    from .connections import Connection, Listener

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=[])         # the app's lifespan, no listening
            if not self.started:
                return

            def connection(listener: Listener) -> Connection:
                return Connection(self.config, self.server_state, self.lifespan.state,
                                  listener=listener, header_timeout_s=header_timeout_s,
                                  body_timeout_s=body_timeout_s, body_min_rate=body_min_rate)

            listener = Listener(sock, cap, connection)
            self.servers.append(listener)             # closed by uvicorn's shutdown
            # Before the first accept: connections queued while the model loaded are served
            # at once, and the "serving" line comes before any of their answers.
            if on_serving is not None:
                on_serving()
            listener.start()

    return Server(config)


async def _flush_log_repeats(repeats: RepeatFilter) -> None:
    while True:
        await asyncio.sleep(LOG_REPEAT_WINDOW_S)
        repeats.flush()


def _file_limit() -> str:
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


class OpenAIServer(Frontend):
    def __init__(self, options: OpenAIServerOptions, ctx: BuildContext) -> None:
        self.options = options
        self.config = ctx.config
        self.model_name = options.served_model_name or default_model_name(ctx.config)
        # The tool and reasoning parsers and the chat template, checked before the engine
        # starts: a ConfigError names the key.
        from corellm.engine.chat import load_chat_template
        from .tools import ChatTools
        ChatTools.for_options(options, ctx.registry)
        if options.chat_template:
            load_chat_template(options.chat_template, "frontend.chat_template")
        from .replicas import server_arms
        self.arms = server_arms(options, ctx.config)

    async def _start_engine(self) -> Any:
        """One engine, or the replicas (``EngineGroup``) of a data-parallel or A/B server."""
        if self.arms is None:
            return await AsyncLLM.create(self.config)
        from corellm.engine.replicas import EngineGroup
        router = self.options.router
        return await EngineGroup.create(self.arms, affinity=router.session_affinity,
                                        affinity_slack=router.affinity_slack,
                                        restart=router.restart_replicas,
                                        max_restarts=router.max_restarts)

    def run(self) -> int:
        # Until the server is up, SIGTERM ends start-up as Ctrl-C does; from then on serve()
        # handles both signals (drain, then stop).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            return asyncio.run(self.serve())
        except (KeyboardInterrupt, SystemExit):
            return 0

    async def serve(self) -> int:
        """Serve until SIGINT/SIGTERM (drain, exit status 0) or the engine core's death (status
        1 unless ``frontend.exit_on_engine_death`` is false)."""
        import uvicorn

        opts = self.options
        # Bind first: a port in use is reported before minutes of model loading, not after.
        sock = socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((opts.host, opts.port))
        except OSError as exc:
            sock.close()
            raise CorellmError(f"frontend.port: cannot listen on {opts.host}:{opts.port}: "
                               f"{exc.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        try:
            engine = await self._start_engine()
        except BaseException:
            sock.close()
            raise
        loop = asyncio.get_running_loop()
        signals: asyncio.Queue[int] = asyncio.Queue()
        previous = {sig: signal.signal(sig, lambda sig, _: loop.call_soon_threadsafe(
            signals.put_nowait, sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
        state = ServerState()
        app = None
        status = 1                    # unless the server starts and stops as asked
        unfilter = None
        flusher = None
        try:
            from .connections import connection_cap
            from .log_repeats import RepeatFilter

            # After the engine core started: its files are counted, and it keeps the limit.
            cap = connection_cap(opts.max_connections)
            app = build_app(engine, opts, self.model_name, state)
            app.state.metrics.attach_finished(engine)
            await app.state.metrics.start()       # one get_stats: gauges before the first step
            # Under the corellm command (corellm.engine.logs), uvicorn's loggers write through its
            # handler, in its format; elsewhere uvicorn installs its own handlers.
            own_logs = {"log_config": None} if logs_configured() else {}
            config = uvicorn.Config(
                app, log_level=opts.log_level, timeout_graceful_shutdown=SETTLE_S,
                access_log=opts.log_level == "debug", http="h11", ws="none",
                timeout_keep_alive=opts.keep_alive_timeout_s,
                **own_logs)   # type: ignore[arg-type]
            # After uvicorn.Config, which replaces uvicorn's log handlers.
            repeats = RepeatFilter(LOG_REPEAT_WINDOW_S)
            unfilter = repeats.install()
            flusher = asyncio.create_task(_flush_log_repeats(repeats))

            def announce() -> None:
                logger.info("holding up to %d connections (frontend.max_connections; open-file "
                            "limit %s)", cap, _file_limit())
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                logger.info("serving %r on http://%s:%d (engine core pid %d)%s", self.model_name,
                            host, port, engine.engine_pid,
                            "; /v1 requires an API key" if opts.api_key
                            or os.environ.get(API_KEY_ENV) else "")
                logger.info(TEMPERATURE_HINT)

            server = _uvicorn_server(config, sock, cap, opts.header_timeout_s, announce,
                                     body_timeout_s=opts.body_timeout_s,
                                     body_min_rate=opts.body_min_rate)
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                status = await self._until_stopped(engine, state, signals, task)
                server.should_exit = True
                if not signals.empty():
                    server.force_exit = True
            await task
        finally:
            sock.close()                # the listener closes it; not if the server never started
            if flusher is not None:
                flusher.cancel()
            if unfilter is not None:
                unfilter()
            if app is not None:
                app.state.serving.close()
            logger.info("shutting down the engine core")
            try:
                await engine.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return status

    async def _until_stopped(self, engine: AsyncLLM, state: ServerState,
                             signals: asyncio.Queue[int], server_task: asyncio.Task) -> int:
        """Wait for a signal (then drain) or the engine's death; return the exit status."""
        opts = self.options
        death: asyncio.Future | None = asyncio.ensure_future(engine.wait_dead())
        got_signal = asyncio.ensure_future(signals.get())
        try:
            while True:
                waiting = {got_signal, server_task} | ({death} if death else set())
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if got_signal.done():
                    await self._drain(engine, state, signal.Signals(got_signal.result()).name,
                                      signals)
                    return 0
                if server_task.done():
                    return 1
                if death is not None and death.done():
                    if not opts.exit_on_engine_death:
                        logger.error("engine core died (%s); answering 503 until stopped "
                                     "(frontend.exit_on_engine_death: false)", death.result())
                        death = None
                        continue
                    logger.error("engine core died (%s); exiting with status 1 "
                                 "(frontend.exit_on_engine_death)", death.result())
                    state.draining = True
                    await state.wait_idle(SETTLE_S)     # in-flight requests send their error
                    return 1
        finally:
            got_signal.cancel()
            if death is not None:
                death.cancel()

    async def _drain(self, engine: AsyncLLM, state: ServerState, name: str,
                     signals: asyncio.Queue[int]) -> None:
        timeout = self.options.drain_timeout_s
        state.draining = True
        if state.inflight:
            logger.info("%s: draining %d requests in flight (up to %g s, "
                        "frontend.drain_timeout_s; new requests get 503; signal again to stop "
                        "now)", name, state.inflight, timeout)
            again = asyncio.Event()
            forced = asyncio.ensure_future(signals.get())
            forced.add_done_callback(lambda f: again.set())
            try:
                await state.wait_idle(timeout, again)
            finally:
                forced.cancel()
            if again.is_set():
                signals.put_nowait(signal.SIGTERM)       # tells serve() to force uvicorn's exit
        else:
            logger.info("%s: shutting down", name)
        if state.inflight or engine.output_processor.has_unfinished_requests():
            why = "signalled again" if not signals.empty() else \
                f"the drain timeout of {timeout:g} s (frontend.drain_timeout_s) passed"
            n = engine.abort_all(RequestAbortedError(
                "shutdown", f"the server is shutting down ({why}); request not finished"),
                "shutdown")
            logger.warning("ended %d requests still running at shutdown (%s)", n, why)
            await state.wait_idle(SETTLE_S)
