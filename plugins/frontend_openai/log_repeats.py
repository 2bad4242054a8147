"""A log that a flood cannot flood: ``RepeatFilter`` lets the first of a run of like records
through (a line logged per connection, whatever address it names) and counts the rest, then
says how many were left out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


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
