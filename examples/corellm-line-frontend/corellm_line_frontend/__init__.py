"""A line-oriented front end: one prompt per input line, one JSON line per prompt.

Once the package is installed, ``frontend: {name: lines}`` selects it and ``corellm serve -c
config.yaml`` runs it. Every line is submitted to the engine as soon as it is read, so all of
them run concurrently; the answers are written in input order, each as soon as it and every
answer before it are done. The process exits with status 0 at the end of the input once every
prompt is answered, 1 if the engine died, and 128 + the signal's number on SIGINT or SIGTERM
(what is in flight is aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import Field

from corellm import SamplingParams, hookimpl
from corellm.components import BuildContext, FrontendOptions, FrontendSpec
from corellm.errors import InvalidRequestError, OptionError
from corellm.interfaces import Frontend

if TYPE_CHECKING:
    from corellm import AsyncLLM

CORELLM_PLUGIN_API = "1.7"

logger = logging.getLogger(__name__)


class LinesOptions(FrontendOptions):
    name: str = "lines"
    input: str = Field("-", min_length=1, description=(
        "File of prompts, one per line (UTF-8); '-' reads standard input. Blank lines are "
        "skipped but counted in the line numbers."))
    output: str = Field("-", min_length=1, description=(
        "File the answers are written to, one JSON object per line; '-' is standard output."))
    max_tokens: int = Field(32, ge=1, le=1 << 20, description="Most tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description=(
        "Sampling temperature; 0 is greedy decoding (the same input gives the same answers)."))
    ignore_eos: bool = Field(False, description=(
        "Generate max_tokens for every prompt, past the end-of-sequence token."))


class Interrupted(Exception):
    """What the streams still in flight raise when a signal stops the front end."""


class LinesFrontend(Frontend):
    def __init__(self, options: LinesOptions, ctx: BuildContext) -> None:
        self.options = options
        self.config = ctx.config
        self.params = SamplingParams(max_tokens=options.max_tokens,
                                     temperature=options.temperature,
                                     ignore_eos=options.ignore_eos)
        self.engine: AsyncLLM | None = None          # set while serve() runs

    def run(self) -> int:
        try:
            return asyncio.run(self.serve())
        except KeyboardInterrupt:            # Ctrl-C while the engine was starting
            return 128 + signal.SIGINT

    async def serve(self) -> int:
        # The engine imports torch: only once the front end runs, not at discovery.
        from corellm import AsyncLLM

        self.engine = engine = await AsyncLLM.create(self.config)
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[int] = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: stop.done() or stop.set_result(sig))
        work = asyncio.create_task(self.answer_all(engine))
        death = asyncio.ensure_future(engine.wait_dead())
        try:
            await asyncio.wait({work, death, stop}, return_when=asyncio.FIRST_COMPLETED)
            # The engine's death also fails every stream, so `work` may be done too: the death
            # is the cause to report.
            if death.done():
                logger.error("engine core died: %s", death.result())
                return 1
            if stop.done():
                name = signal.Signals(stop.result()).name
                n = engine.abort_all(Interrupted(name), "interrupted")
                logger.warning("%s: aborted %d requests in flight", name, n)
                return 128 + stop.result()
            await work                       # re-raises what failed in it, if anything
            return 0
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            death.cancel()
            work.cancel()
            # What an abort or a death ended is an expected error here; the cause is reported.
            await asyncio.gather(work, return_exceptions=True)
            await engine.shutdown()

    async def answer_all(self, engine: AsyncLLM) -> None:
        """Submit every line as it is read; write the answers in input order."""
        in_order: asyncio.Queue[asyncio.Task[dict[str, Any]] | None] = asyncio.Queue()
        with _open_output(self.options.output) as out:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(_write_in_order(in_order, out))
                async for number, prompt in _read_lines(self.options.input):
                    in_order.put_nowait(tasks.create_task(self.answer(engine, number, prompt)))
                in_order.put_nowait(None)

    async def answer(self, engine: AsyncLLM, number: int, prompt: str) -> dict[str, Any]:
        text, finish_reason = "", None
        try:
            async for out in engine.generate(prompt, self.params, f"line-{number}"):
                text += out.outputs[0].text              # outputs are deltas
                finish_reason = out.outputs[0].finish_reason
        except InvalidRequestError as exc:               # this prompt only: say why, go on
            return {"line": number, "prompt": prompt, "error": str(exc)}
        return {"line": number, "prompt": prompt, "text": text, "finish_reason": finish_reason}


async def _write_in_order(in_order: asyncio.Queue, out: TextIO) -> None:
    while (task := await in_order.get()) is not None:
        out.write(json.dumps(await task, ensure_ascii=False) + "\n")
        out.flush()


async def _read_lines(path: str) -> AsyncIterator[tuple[int, str]]:
    """(line number, prompt) for each non-blank line of ``path`` ('-': standard input).

    A daemon thread reads, so a read blocked on a terminal or a pipe neither stalls the event
    loop nor keeps the process alive once the front end has stopped."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[tuple[int, str] | Exception | None] = asyncio.Queue()

    def put(item: tuple[int, str] | Exception | None) -> None:
        with contextlib.suppress(RuntimeError):          # the loop has closed: nobody reads
            loop.call_soon_threadsafe(lines.put_nowait, item)

    def read() -> None:
        try:
            with (contextlib.nullcontext(sys.stdin) if path == "-"
                  else open(path, encoding="utf-8")) as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        put((number, line.rstrip("\r\n")))
        except (OSError, ValueError) as exc:             # unreadable, or not UTF-8
            put(exc)
        else:
            put(None)

    threading.Thread(target=read, name="corellm-lines-reader", daemon=True).start()
    while (item := await lines.get()) is not None:
        if isinstance(item, Exception):
            raise item
        yield item


def _open_output(path: str) -> contextlib.AbstractContextManager[TextIO]:
    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w", encoding="utf-8")


def make_lines(options: LinesOptions, ctx: BuildContext) -> LinesFrontend:
    # Checked here, before the model loads: a wrong path fails in a second, as a config error.
    if options.input != "-" and not Path(options.input).is_file():
        raise OptionError("input", f"{options.input!r} is not a file")
    if options.output != "-" and not Path(options.output).parent.is_dir():
        raise OptionError("output", f"the directory of {options.output!r} does not exist")
    return LinesFrontend(options, ctx)


@hookimpl
def corellm_frontends() -> Iterator[FrontendSpec]:
    yield FrontendSpec(name="lines", factory=make_lines, options=LinesOptions,
                       summary="Answers one prompt per input line with one JSON line each.")
