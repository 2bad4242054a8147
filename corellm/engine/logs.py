"""How every corellm process writes its log records: text lines with a timestamp, or JSON lines.

The ``corellm`` command configures this for itself (``corellm --log-format json --log-level
debug COMMAND``) and, through the environment (``CORELLM_LOG_FORMAT``, ``CORELLM_LOG_LEVEL``), for
the processes it starts: the engine core, tensor-parallel workers, a server that ``corellm bench
--start-server`` runs. Under ``corellm serve`` uvicorn's loggers write through the same handler.
A program that uses corellm as a library keeps its own logging; only corellm's child processes,
which have nothing else, configure themselves.

A JSON line holds ``ts`` (ISO 8601, local time with its UTC offset, milliseconds), ``level``,
``logger``, ``msg``, ``pid``, and ``exc`` (the formatted traceback) when the record carries an
exception.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import sys
from typing import IO

FORMAT_ENV = "CORELLM_LOG_FORMAT"
LEVEL_ENV = "CORELLM_LOG_LEVEL"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _timestamp(created: float) -> str:
    return _dt.datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """``2026-01-31 12:00:00.123 INFO corellm.server: message``, in local time."""

    default_msec_format = "%s.%03d"

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback is escaped inside ``exc``)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"ts": _timestamp(record.created), "level": record.levelname,
                                   "logger": record.name, "msg": record.getMessage(),
                                   "pid": record.process}
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


class _Handler(logging.StreamHandler):
    """corellm's handler on the root logger, a class of its own so that it can be found again.
    Without a stream of its own it writes to whatever ``sys.stderr`` is at the time, as
    logging's last-resort handler does, so a replaced stderr (a test's capture) never leaves it
    writing to a closed file."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        logging.Handler.__init__(self)      # not StreamHandler's: it would pin sys.stderr
        self._stream = stream

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr if self._stream is None else self._stream

    @stream.setter
    def stream(self, value: IO[str]) -> None:      # StreamHandler.setStream assigns it
        self._stream = value


def env_format() -> str:
    """The format ``CORELLM_LOG_FORMAT`` names (text when unset or unknown)."""
    fmt = os.environ.get(FORMAT_ENV, "").strip().lower()
    return fmt if fmt in FORMATS else "text"


def env_level() -> int | None:
    """The level ``CORELLM_LOG_LEVEL`` names, or None when unset or unknown."""
    name = os.environ.get(LEVEL_ENV, "").strip().lower()
    return getattr(logging, name.upper()) if name in LEVELS else None


def configure_logging(level: int | str | None = None, fmt: str | None = None,
                      stream: IO[str] | None = None) -> None:
    """Send every log record at ``level`` and above to ``stream`` (stderr) in ``fmt``, through one
    handler on the root logger (replacing the one an earlier call added; handlers others added,
    such as a test runner's, stay). ``fmt`` defaults to ``CORELLM_LOG_FORMAT``; ``level`` to
    ``CORELLM_LOG_LEVEL``, else WARNING."""
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    if level is None:
        level = env_level() or logging.WARNING
    handler = _Handler(stream)
    handler.setFormatter(make_formatter(fmt or env_format()))
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def configured() -> bool:
    """Whether ``configure_logging`` set up this process's logging (so that a component that
    would install handlers of its own, such as uvicorn, leaves them out)."""
    return any(isinstance(h, _Handler) for h in logging.getLogger().handlers)


def export_settings(fmt: str | None, level: str | None) -> None:
    """Put the format and (when the user chose one) the level into the environment, where the
    processes this one starts find them."""
    if fmt is not None:
        os.environ[FORMAT_ENV] = fmt
    if level is not None:
        os.environ[LEVEL_ENV] = level
