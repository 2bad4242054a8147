"""``corellm serve`` started here, as a child process, for a benchmark or a soak test."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .progress import log
from .targets import RunOptions


READY = re.compile(r"serving '(?P<name>.*)' on (?P<url>https?://\S+) "
                   r"\(engine core pid (?P<pid>\d+)\)")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def process_tree(pid: int) -> set[int]:
    """``pid`` and every live descendant of it (the engine core, workers, check and compile
    processes and their fork servers)."""
    found, todo = {pid}, [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()} - found
            except OSError:
                continue
            found |= kids
            todo.extend(kids)
    return found


def tree_pss(pid: int) -> int:
    """Proportional set size of ``pid`` and its descendants, in bytes (Linux): the pages they
    share (a fork server's preloaded modules) are counted once over the processes sharing
    them, which summing their RSS would count again in each."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class ServerProcess:
    """``python -m corellm serve`` as a child in its own session: started, waited for (the
    "serving ... on URL" log line), and stopped with SIGINT (then SIGTERM, then SIGKILL to its
    process group, so its engine core cannot outlive it either)."""

    def __init__(self, config: str | Path | None, timeout: float = 300.0,
                 log_file: str | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, max_open_files: int | None = None,
                 cwd: str | Path | None = None) -> None:
        """``env``: variables added to this process's environment for the server;
        ``max_open_files``: its open-file limit (soft and hard), as a host's ulimit sets it;
        ``cwd``: its working directory (``python -m`` imports from there first)."""
        self.cmd = [sys.executable, "-m", "corellm", "serve", "--host", "127.0.0.1",
                    "--port", "0", *(["--config", str(config)] if config else []), *extra_args]
        self.env = {**os.environ, **env} if env else None
        self.max_open_files = max_open_files
        self.cwd = cwd
        self.log_bytes = 0          # bytes of log the server has written
        self.timeout = timeout
        self.log_file = open(log_file, "w") if log_file else None
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.model_name: str | None = None
        self.engine_pid: int | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_bytes += len(line)
            line = line.rstrip("\n")
            self.tail.append(line)
            if self.log_file:
                self.log_file.write(line + "\n")
                self.log_file.flush()
            m = READY.search(line)
            if m and not self.ready.is_set():
                self.url, self.model_name = m["url"], m["name"]
                self.engine_pid = int(m["pid"])
                self.ready.set()
            elif any(w in line for w in ("WARNING", "ERROR", "CRITICAL", "Traceback")):
                log(f"server: {line}")

    def start(self) -> None:
        log(f"starting the server: {' '.join(self.cmd)}")
        t0 = time.perf_counter()
        limit = self.max_open_files

        def set_limits() -> None:
            if limit is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True, env=self.env, cwd=self.cwd,
                                     preexec_fn=set_limits if limit is not None else None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"the server exited with status {self.proc.returncode} "
                                   f"before it was ready; its last output:\n{self.log_tail()}")
            if time.perf_counter() - t0 > self.timeout:
                raise RuntimeError(f"the server was not ready after {self.timeout:.0f} s; its "
                                   f"last output:\n{self.log_tail()}")
        log(f"server ready in {time.perf_counter() - t0:.1f} s: {self.model_name!r} on "
            f"{self.url} (server pid {self.proc.pid}, engine core pid {self.engine_pid})")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(f"    {line}" for line in list(self.tail)[-n:]) or "    (no output)"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            log("stopping the server (SIGINT)...")
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10)):
                try:
                    proc.send_signal(sig)
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    log(f"the server did not exit within {wait} s of {sig.name}")
            else:
                self._kill_group()
                proc.wait(10)
            log(f"server exited with status {proc.returncode}")
        else:
            log(f"the server had already exited with status {proc.returncode}")
        # Its engine core must go with it; it is in the server's process group (our session).
        deadline = time.monotonic() + 10
        while self.engine_pid and _alive(self.engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.engine_pid and _alive(self.engine_pid):
            log(f"the engine core (pid {self.engine_pid}) outlived the server; killing it")
            self._kill_group()
        if self._reader:
            self._reader.join(5)
        if self.log_file:
            self.log_file.close()
            self.log_file = None

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def started_server(config: str | Path | Mapping[str, Any] | None, options: RunOptions):
    """``corellm serve`` with this config (a dict is written to a temporary file) for the
    duration of the block; the server's last output is logged if the block fails."""
    tmp = None
    if isinstance(config, Mapping):
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(dict(config), tmp)
        tmp.close()
        config = tmp.name
    server = ServerProcess(config, options.server_timeout, options.server_log)
    try:
        server.start()
        yield server
    except BaseException:
        if server.proc is not None:
            log(f"the server's last output:\n{server.log_tail(15)}")
        raise
    finally:
        server.stop()
        if tmp is not None:
            os.unlink(tmp.name)
