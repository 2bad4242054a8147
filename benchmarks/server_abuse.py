"""Can one client hurt the others? Each abuse scenario runs against a fresh ``corellm serve``
(default configuration unless --config) while ``/health`` and the first token of a one-token
completion are timed; with ``--before REV`` every scenario also runs against a server of that
git revision, and the two are reported side by side.

Scenarios (the load each one puts on the server):

- ``idle``: none.
- ``stop-flood``: 60,000 distinct stop strings with ``n: 128``, 16 tokens (a 400 under
  ``frontend.limits``).
- ``request-id``: a 900 KB ``request_id`` on a streamed ``n: 128`` x 16-token request; every
  chunk of every sample echoes the id unless it is bounded.
- ``worst-allowed``: the largest request the default limits allow: 128 streamed samples to the
  end of the context (within ``max_generated_tokens``), 64 stop strings of 256 characters, the
  logprobs ``max_output_entries`` leaves (2). 128 samples exceed the default 64 seats. Probing starts once it streams and the
  request is dropped when the probes end; the row gives its own pace meanwhile.
- ``slowloris``: 1,100 connections that send their request head a few bytes a second, against
  a server whose open-file limit is 1,024 (a common default); the row gives the log the server
  wrote meanwhile.
- ``body-drip``: as many connections as the server holds (its open-file limit 256; the cap its
  start-up log gives), each sending a complete head for a completion with a 200,000-byte body on
  time and then a byte of the body a second, refilled as the server closes them, for 15 s (past
  the default body deadline, 10 s); probed once a second.
- ``pattern-check``: two ~150-byte requests at once whose JSON schema's ``pattern`` is
  ``[a-z]{1,10000}`` (checking it costs xgrammar seconds, growing with the square of the count).
- ``compile-flood``: four requests at once with schemas of 3,000 optional integer properties
  (~150 KB; cheap to check, tens of seconds to compile against the vocabulary); besides the usual
  probes, a small constrained request (a ``choice``) is timed each round: the row gives its
  latencies and what the four got. This and ``pattern-check`` first send one small constrained
  request, so that they measure a server that has served one.
- ``schema-memory``: 150 distinct schemas of 900 KB each (a description padding a small
  schema), one after the other; the row gives the growth of the server's processes (API, engine
  and their children; proportional set size, shared pages counted once) from a first
  constrained request to the end.
- ``amplification``: a ~200-byte streamed chat request (``n`` 51, ``top_logprobs`` 20,
  ``max_tokens`` 2570, ``ignore_eos``): probing starts once it streams, and it is dropped when
  the probes end (it would stream ~274 MB for ten minutes); the row gives its status and pace.
- ``chat-flood``: 20 clients in a loop, each sending 1 MiB chat bodies of 30,000 messages.
- ``group-sigterm``: SIGTERM to the server's whole process group (Ctrl-C in a terminal,
  systemd's ``KillMode=control-group``) while 8 streams run: how many finish (drain) and how
  many end with an error.

    CORELLM_DEFAULT_MODEL=random python3 benchmarks/server_abuse.py --before e6e225b \\
        --json out.json --plot out.png
    python3 benchmarks/server_abuse.py --url http://127.0.0.1:8000 --scenarios idle,worst-allowed

A probe that gets no answer within ``--probe-timeout`` seconds counts as that many seconds and
as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import logger  # noqa: E402
from corellm_plugins.bench.env import environment  # noqa: E402
from corellm_plugins.bench.server_process import ServerProcess, tree_pss  # noqa: E402

log = logger("server_abuse")
REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ["idle", "stop-flood", "request-id", "worst-allowed", "slowloris", "body-drip",
             "pattern-check", "compile-flood", "schema-memory", "amplification", "chat-flood",
             "group-sigterm"]
SLOWLORIS_FILE_LIMIT = 1024
SLOWLORIS_CONNECTIONS = 1100
BODY_DRIP_FILE_LIMIT = 256
BODY_DRIP_CONNECTIONS = 170       # the cap at that limit, for a server whose log is not read here
BODY_DRIP_BYTES = 200_000
BODY_DRIP_S = 15.0
BODY_DRIP_MAX_CONNECTIONS = 2000  # opened in all, refills included


# --------------------------------------------------------------------------- probes
def probe(url: str, model: str, timeout: float) -> tuple[float, float, bool]:
    """(/health seconds, seconds to a one-token completion's first text chunk, all answered)."""
    import httpx

    ok = True
    t0 = time.perf_counter()
    try:
        ok = httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        ok = False
    health = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=timeout,
                          json={"model": model, "prompt": "Hi", "max_tokens": 1,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text": ""' not in line:
                    first = time.perf_counter() - t0
                    break
                if time.perf_counter() - t0 > timeout:
                    break
    except httpx.HTTPError:
        pass
    if first is None:
        ok, first = False, max(time.perf_counter() - t0, timeout)
    return health, first, ok


def probe_while(url: str, model: str, busy: Callable[[], bool], args: argparse.Namespace,
                ) -> dict[str, Any]:
    """Probe while ``busy()`` (at least ``--min-probes``, at most ``--max-probes``)."""
    health, first, failed = [], [], 0
    while len(health) < args.max_probes and (busy() or len(health) < args.min_probes):
        h, f, ok = probe(url, model, args.probe_timeout)
        health.append(h)
        first.append(f)
        failed += not ok
    return {"probes": len(health), "probes_failed": failed,
            "health_median_ms": statistics.median(health) * 1e3,
            "health_max_ms": max(health) * 1e3,
            "first_token_median_ms": statistics.median(first) * 1e3,
            "first_token_max_ms": max(first) * 1e3}


def background(fn: Callable[[], None]) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:      # noqa: BLE001 - a load that fails is reported by its row
            log(f"load failed: {type(exc).__name__}: {exc}")
        finally:
            done.set()
    threading.Thread(target=run, daemon=True).start()
    return done


def stream_request(url: str, body: dict[str, Any], timeout: float, out: dict[str, Any],
                   stop: threading.Event | None = None) -> None:
    """POST a completion, reading the whole answer; ``out`` gets status, bytes, seconds and the
    count of finished samples and error events."""
    import httpx

    t0 = time.perf_counter()
    out.update(status=None, bytes=0, finished=0, errors=0)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                out["bytes"] += len(line) + 1
                if line.startswith("data: {"):
                    out["finished"] += line.count('"finish_reason": "length"') + \
                        line.count('"finish_reason":"length"')
                    out["errors"] += '"error"' in line
                out["events"] = out.get("events", 0) + line.startswith("data: ")
                if stop is not None and stop.is_set():
                    break
    except httpx.HTTPError as exc:
        out["status"] = out["status"] or type(exc).__name__
    out["seconds"] = time.perf_counter() - t0


# --------------------------------------------------------------------------- scenarios
def scenario_idle(url: str, model: str, server: ServerProcess | None,
                  args: argparse.Namespace) -> dict[str, Any]:
    return {**probe_while(url, model, lambda: False, args), "load": "-"}


def _heavy(url: str, model: str, body: dict[str, Any], args: argparse.Namespace,
           streaming_events: int = 0) -> dict[str, Any]:
    """Probe while ``body`` runs. With ``streaming_events``, probing starts once the request
    has streamed that many events (every sample queued and running) and the request is dropped
    when the probes are done: the row then gives its own pace meanwhile."""
    out: dict[str, Any] = {}
    stop = threading.Event() if streaming_events else None
    done = background(lambda: stream_request(url, {**body, "model": model}, args.timeout, out,
                                              stop))
    deadline = time.monotonic() + args.timeout
    while out.get("events", 0) < streaming_events and not done.is_set() \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)                   # let it reach the server (and the engine's batch)
    t0, events0 = time.perf_counter(), out.get("events", 0)
    row = probe_while(url, model, lambda: not done.is_set(), args)
    if stop is not None:
        pace = (out.get("events", 0) - events0) / (time.perf_counter() - t0)
        stop.set()
        done.wait(args.timeout)
        row["load"] = (f"{out.get('status')}, streaming {pace:.0f} events/s while probed "
                       f"(dropped after the probes)")
        row["load_events_per_s"] = pace
        return row
    done.wait(args.timeout)
    mb = out.get("bytes", 0) / 1e6
    row["load"] = (f"{out.get('status')} in {out.get('seconds', 0):.1f} s, "
                   f"{mb:.1f} MB" if mb >= 0.1 else
                   f"{out.get('status')} in {out.get('seconds', 0):.2f} s")
    row["load_seconds"] = out.get("seconds")
    row["load_bytes"] = out.get("bytes")
    return row


def scenario_stop_flood(url: str, model: str, server: ServerProcess | None,
                        args: argparse.Namespace) -> dict[str, Any]:
    stops = [f"\u00a7{i:05d}\u00a4" for i in range(60_000)]
    return _heavy(url, model, {"prompt": "The meaning of life", "max_tokens": 16, "n": 128,
                               "ignore_eos": True, "stop": stops, "stream": True}, args)


def scenario_request_id(url: str, model: str, server: ServerProcess | None,
                        args: argparse.Namespace) -> dict[str, Any]:
    return _heavy(url, model, {"prompt": "The meaning of life", "max_tokens": 16, "n": 128,
                               "ignore_eos": True, "stream": True,
                               "request_id": "r" * 900_000}, args)


def worst_allowed_body(max_model_len: int) -> dict[str, Any]:
    """The largest request the default frontend.limits allow: 128 streamed samples to the end
    of the context within max_generated_tokens (131072), 64 stop strings of 256 characters,
    and as many logprobs as max_output_entries (524288) leaves: 2 at 1,024 tokens a sample."""
    stops = [f"{i:03d}" + "\u00e9z" * 126 + "q" for i in range(64)]
    max_tokens = min(131072 // 128, max_model_len - 8)
    logprobs = min(8, (1 << 19) // (128 * max_tokens) - 2)
    return {"prompt": "The meaning of life", "max_tokens": max_tokens, "n": 128,
            "ignore_eos": True, "stop": stops, "logprobs": logprobs, "stream": True}


def scenario_worst_allowed(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    max_model_len = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0].get(
        "max_model_len", 1024)
    return _heavy(url, model, worst_allowed_body(max_model_len), args, streaming_events=129)


def scenario_slowloris(url: str, model: str, server: ServerProcess | None,
                       args: argparse.Namespace) -> dict[str, Any]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\n").encode()
    stop = threading.Event()
    stats = {"opened": 0, "refused": 0, "closed_by_server": 0}
    socks: list[socket.socket] = []

    def slow_clients() -> None:
        for _ in range(SLOWLORIS_CONNECTIONS):
            if stop.is_set():
                return
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect((host, int(port)))
                s.setblocking(False)
                socks.append(s)
                stats["opened"] += 1
            except OSError:
                stats["refused"] += 1
                s.close()
        sent = 0
        while not stop.is_set() and sent < len(head):       # a few bytes a second
            for s in list(socks):
                try:
                    s.send(head[sent:sent + 4])
                except OSError:
                    socks.remove(s)
                    s.close()
                    stats["closed_by_server"] += 1
            sent += 4
            stop.wait(1.0)
        stop.wait()

    log_before = server.log_bytes if server is not None else 0
    done = background(slow_clients)
    time.sleep(3)                     # every connection opened, heads trickling in
    row = probe_while(url, model, lambda: not done.is_set(), args)
    stop.set()
    done.wait(10)
    for s in socks:
        s.close()
    logged = (server.log_bytes - log_before) if server is not None else 0
    row["load"] = (f"{stats['opened']} open, {stats['refused']} refused, "
                   f"{stats['closed_by_server']} closed by the server; "
                   f"log +{logged / 1e3:.0f} KB")
    row["log_bytes"] = logged
    return row


def scenario_body_drip(url: str, model: str, server: ServerProcess | None,
                       args: argparse.Namespace) -> dict[str, Any]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    held = [line for line in (server.tail if server is not None else ())
            if "holding up to " in line]
    want = int(held[0].split("holding up to ", 1)[1].split()[0]) if held \
        else BODY_DRIP_CONNECTIONS
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {BODY_DRIP_BYTES}\r\n\r\n"
            "{").encode()
    stop = threading.Event()
    stats = {"opened": 0, "refused": 0, "closed_by_server": 0, "answered_408": 0}
    socks: dict[socket.socket, bytes] = {}          # what the server has answered on each

    def open_one() -> None:
        if stats["opened"] + stats["refused"] >= BODY_DRIP_MAX_CONNECTIONS:
            return
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, int(port)))
            s.sendall(head)
            s.setblocking(False)
        except OSError:
            stats["refused"] += 1
            s.close()
            return
        socks[s] = b""
        stats["opened"] += 1

    def drip() -> None:
        """Fill the cap; then every second: count the connections the server closed (a 503 as
        refused) and open one in each one's place, and send a byte of body on the others."""
        for _ in range(want):
            if stop.is_set():
                return
            open_one()
        while not stop.is_set():
            for s in list(socks):
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    try:
                        s.send(b" ")
                    except OSError:
                        pass                            # a reset shows on the next recv
                    continue
                except OSError:
                    data = b""
                if data:
                    socks[s] += data                    # an answer; EOF comes next
                    continue
                answer = socks.pop(s)
                s.close()
                if answer.startswith(b"HTTP/1.1 503"):
                    stats["refused"] += 1
                    stats["opened"] -= 1
                else:
                    stats["closed_by_server"] += 1
                    stats["answered_408"] += answer.startswith(b"HTTP/1.1 408")
                open_one()
            stop.wait(1.0)

    done = background(drip)
    until = time.monotonic() + BODY_DRIP_S
    time.sleep(2)                     # every connection open, bodies dripping
    open_at_probe = len(socks)

    def paced() -> bool:
        """One probe a second, while the drip runs."""
        stop.wait(1.0)
        return time.monotonic() < until and not done.is_set()

    row = probe_while(url, model, paced, args)
    stop.wait(max(0.0, until - time.monotonic()))  # on past the first bodies' deadline
    stop.set()
    done.wait(10)
    for s in list(socks):
        s.close()
    row["load"] = (f"{open_at_probe} dripping when probed; {stats['opened']} opened in "
                   f"{BODY_DRIP_S:.0f} s, {stats['closed_by_server']} closed by the server "
                   f"({stats['answered_408']} with a 408), {stats['refused']} refused")
    row.update({f"drip_{k}": v for k, v in stats.items()}, drip_open_at_probe=open_at_probe)
    return row


def _post_json(url: str, path: str, body: dict[str, Any], timeout: float,
               out: list[Any]) -> None:
    """POST ``body``; append (status or exception name, seconds, error code) to ``out``."""
    import httpx

    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{url}{path}", json=body, timeout=timeout)
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        out.append((r.status_code, time.perf_counter() - t0, code))
    except httpx.HTTPError as exc:
        out.append((type(exc).__name__, time.perf_counter() - t0, None))


def _answers(out: list[Any]) -> str:
    counts: dict[str, int] = {}
    for status, _, code in out:
        key = f"{status}" + (f" {code}" if code else "")
        counts[key] = counts.get(key, 0) + 1
    slowest = max((s for _, s, _ in out), default=0.0)
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items())) + \
        f" (last in {slowest:.1f} s)"


def scenario_pattern_check(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    _warm(url, model, args)
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "structured_outputs": {
        "json": {"type": "string", "pattern": "[a-z]{1,10000}"}}}
    out: list[Any] = []
    dones = [background(lambda: _post_json(url, "/v1/completions", body, args.timeout, out))
             for _ in range(2)]
    time.sleep(0.2)
    row = probe_while(url, model, lambda: not all(d.is_set() for d in dones), args)
    for d in dones:
        d.wait(args.timeout)
    row["load"] = "2 requests: " + _answers(out)
    row["attack_statuses"] = [o[0] for o in out]
    return row


def _properties_schema(n: int, tag: str) -> dict[str, Any]:
    return {"type": "object", "title": tag,
            "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def _warm(url: str, model: str, args: argparse.Namespace) -> None:
    """One small constrained request, so that a scenario measures a server that has served
    one before (the first loads xgrammar in the processes that check and compile)."""
    _post_json(url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2,
                                        "structured_outputs": {"choice": ["a", "b"]}},
               args.timeout, [])


def scenario_compile_flood(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    _warm(url, model, args)
    out: list[Any] = []
    dones = []
    for i in range(4):
        schema = _properties_schema(3000, f"flood {i}")
        schema["properties"][f"q{i}"] = {"type": "string"}          # four distinct schemas
        body = {"model": model, "prompt": "Hi", "max_tokens": 2,
                "structured_outputs": {"json": schema}}
        dones.append(background(lambda b=body: _post_json(url, "/v1/completions", b,
                                                          args.timeout, out)))
    time.sleep(0.5)
    small: list[Any] = []

    def busy() -> bool:
        _post_json(url, "/v1/completions", {
            "model": model, "prompt": "Hi", "max_tokens": 3,
            "structured_outputs": {"choice": ["yes", "no"]}}, args.probe_timeout, small)
        return not all(d.is_set() for d in dones)

    row = probe_while(url, model, busy, args)
    for d in dones:
        d.wait(args.timeout)
    row["load"] = (f"4 requests: {_answers(out)}; small constrained: "
                   f"{_answers(small)}, max {max(s for _, s, _ in small):.2f} s")
    row["small_constrained_max_s"] = max(s for _, s, _ in small)
    row["small_constrained_ok"] = sum(st == 200 for st, _, _ in small)
    row["attack_statuses"] = [o[0] for o in out]
    return row


def scenario_schema_memory(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    if server is None:
        return {"load": "needs a server started here (not --url)"}
    out: list[Any] = []

    def schema(i: int) -> dict[str, Any]:
        return {"type": "object", "description": f"{i:04d}" + "d" * 900_000,
                "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}

    def body(i: int) -> dict[str, Any]:
        return {"model": model, "prompt": "Hi", "max_tokens": 1,
                "structured_outputs": {"json": schema(i)}}

    _post_json(url, "/v1/completions", body(-1), args.timeout, out)     # starts every process
    before = tree_pss(server.proc.pid)
    t0 = time.perf_counter()
    for i in range(150):
        _post_json(url, "/v1/completions", body(i), args.timeout, out)
        if (i + 1) % 50 == 0:
            log(f"  {i + 1}/150 schemas, {(tree_pss(server.proc.pid) - before) / 2**20:+.0f} "
                "MiB")
    took = time.perf_counter() - t0
    after = tree_pss(server.proc.pid)
    row = probe_while(url, model, lambda: False, args)
    grown = (after - before) / 2**20
    row["load"] = (f"150 x 900 KB schemas in {took:.0f} s: {_answers(out[1:])}; the server's "
                   f"processes {before / 2**20:.0f} -> {after / 2**20:.0f} MiB "
                   f"({grown:+.0f} MiB)")
    row["memory_growth_mib"] = grown
    return row


def scenario_amplification(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
            "n": 51, "logprobs": True, "top_logprobs": 20, "max_tokens": 2570,
            "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"status": None, "bytes": 0, "events": 0}
    stop = threading.Event()

    def run() -> None:
        t0 = time.perf_counter()
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                              timeout=args.timeout) as r:
                out["status"] = r.status_code
                for chunk in r.iter_bytes():
                    out["bytes"] += len(chunk)
                    out["events"] += chunk.count(b"data: ")
                    if stop.is_set():
                        break
        except httpx.HTTPError as exc:
            out["status"] = out["status"] or type(exc).__name__
        out["seconds"] = time.perf_counter() - t0

    done = background(run)
    deadline = time.monotonic() + 60
    while out["events"] < 52 and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0, bytes0 = time.perf_counter(), out["bytes"]
    row = probe_while(url, model, lambda: not done.is_set(), args)
    rate = (out["bytes"] - bytes0) / (time.perf_counter() - t0)
    stop.set()
    done.wait(args.timeout)
    row["load"] = (f"{out['status']}" + (f", streaming {rate / 1e6:.2f} MB/s while probed "
                                         f"({out['bytes'] / 1e6:.0f} MB sent; dropped after "
                                         "the probes)" if out["status"] == 200 else
                                         f" in {out.get('seconds', 0):.2f} s"))
    row["load_status"] = out["status"]
    row["load_bytes"] = out["bytes"]
    return row


def scenario_chat_flood(url: str, model: str, server: ServerProcess | None,
                        args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = json.dumps({"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}] * 30_000}, separators=(",", ":")).encode()
    assert len(body) <= 1 << 20, len(body)
    stop = threading.Event()
    statuses: dict[str, int] = {}

    def client() -> None:
        with httpx.Client(timeout=args.timeout) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{url}/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
                    key = str(r.status_code)
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                statuses[key] = statuses.get(key, 0) + 1

    workers = [background(client) for _ in range(20)]
    time.sleep(1.0)
    row = probe_while(url, model, lambda: True, args)
    stop.set()
    for w in workers:
        w.wait(args.timeout)
    row["load"] = "20 clients: " + ", ".join(f"{n} x {k}" for k, n in sorted(statuses.items()))
    return row


def scenario_group_sigterm(url: str, model: str, server: ServerProcess | None,
                           args: argparse.Namespace) -> dict[str, Any]:
    if server is None:
        return {"load": "needs a server started here (not --url)"}
    outs: list[dict[str, Any]] = [{} for _ in range(8)]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 128,
            "ignore_eos": True, "stream": True}
    dones = [background(lambda o=o: stream_request(url, body, args.timeout, o)) for o in outs]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(o.get("events", 0) > 2 for o in outs):
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGTERM)
    for d in dones:
        d.wait(args.timeout)
    try:
        code = server.proc.wait(60)           # the whole group exits by itself
    except subprocess.TimeoutExpired:
        code = None
    drained = sum(o.get("finished", 0) == 1 and not o.get("errors") for o in outs)
    errors = sum(bool(o.get("errors")) for o in outs)
    return {"load": f"{drained}/8 streams finished, {errors} ended with an error; server exit "
                    f"status {code}", "drained": drained, "errored": errors, "exit_status": code}


RUN: dict[str, Callable[..., dict[str, Any]]] = {
    "idle": scenario_idle, "stop-flood": scenario_stop_flood,
    "request-id": scenario_request_id, "worst-allowed": scenario_worst_allowed,
    "slowloris": scenario_slowloris, "body-drip": scenario_body_drip,
    "pattern-check": scenario_pattern_check, "compile-flood": scenario_compile_flood,
    "schema-memory": scenario_schema_memory, "amplification": scenario_amplification,
    "chat-flood": scenario_chat_flood,
    "group-sigterm": scenario_group_sigterm}


# --------------------------------------------------------------------------- servers
class Revision:
    """A checkout of ``rev`` in a temporary git worktree, imported ahead of the installed
    corellm by a server started there (its ``plugins/`` folder as the ``corellm_plugins``
    package)."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        self.tmp = tempfile.TemporaryDirectory(prefix="corellm-before-")
        self.path = Path(self.tmp.name) / "src"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                        str(self.path), rev], check=True)
        (self.path / "corellm_plugins").symlink_to("plugins")
        self.env = {"PYTHONPATH": str(self.path)}
        self.label = "before " + subprocess.run(
            ["git", "-C", str(self.path), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True).stdout.strip()

    def close(self) -> None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                        str(self.path)], check=False)
        self.tmp.cleanup()


def run_scenario(name: str, label: str, rev: Revision | None,
                 args: argparse.Namespace) -> dict[str, Any]:
    server = None
    if args.url:
        url = args.url
    else:
        config = None if args.config is None else str(Path(args.config).resolve())
        server = ServerProcess(config, env=rev.env if rev else None,
                               cwd=rev.path if rev else None,
                               max_open_files={"slowloris": SLOWLORIS_FILE_LIMIT,
                                               "body-drip": BODY_DRIP_FILE_LIMIT}.get(name))
        server.start()
        url = server.url
    try:
        import httpx
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        log(f"{name} against {label}...")
        row = RUN[name](url, model, server, args)
    finally:
        if server is not None:
            server.stop()
    row = {"scenario": name, "server": label, **row}
    log(f"{name} / {label}: /health max {row.get('health_max_ms', 0):.0f} ms, first token max "
        f"{row.get('first_token_max_ms', 0):.0f} ms; {row['load']}")
    return row


# --------------------------------------------------------------------------- report
def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<14} {'server':<16} {'probes':>6} {'failed':>6} {'/health max':>12} "
            f"{'1st token med':>14} {'1st token max':>14}  load")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "probes" not in r:
            lines.append(f"{r['scenario']:<14} {r['server']:<16} {'-':>6} {'-':>6} {'-':>12} "
                         f"{'-':>14} {'-':>14}  {r['load']}")
            continue
        lines.append(f"{r['scenario']:<14} {r['server']:<16} {r['probes']:>6} "
                     f"{r['probes_failed']:>6} {r['health_max_ms']:>10.0f}ms "
                     f"{r['first_token_median_ms']:>12.0f}ms {r['first_token_max_ms']:>12.0f}ms"
                     f"  {r['load']}")
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "probes" in r]
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(servers))
    for j, label in enumerate(servers):
        xs, ft, hl = [], [], []
        for i, sc in enumerate(scenarios):
            row = next((r for r in rows if r["scenario"] == sc and r["server"] == label), None)
            if row is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ft.append(row["first_token_max_ms"])
                hl.append(row["health_max_ms"])
        ax.bar(xs, ft, width, label=f"{label}: first token (max)")
        ax.plot(xs, hl, "k_", markersize=14, markeredgewidth=2,
                label="/health (max)" if j == 0 else None)
    ax.axhline(1000, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8, rotation=25, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("latency while the load runs, ms (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (no --before; group-sigterm is skipped)")
    p.add_argument("--config", help="config of the servers started here (default: built-in)")
    p.add_argument("--before", metavar="REV", help="also run each scenario against a server of "
                                                   "this git revision, side by side")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--min-probes", type=int, default=3)
    p.add_argument("--max-probes", type=int, default=10)
    p.add_argument("--probe-timeout", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per load request")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--plot", metavar="OUT.png")
    args = p.parse_args()
    names = [s for s in args.scenarios.split(",") if s]
    unknown = set(names) - set(RUN)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    if args.url and args.before:
        p.error("--before starts its own servers: leave out --url")

    before = Revision(args.before) if args.before else None
    rows = []
    try:
        for i, name in enumerate(names):
            log(f"[{i + 1}/{len(names)}] {name}")
            if before is not None:
                rows.append(run_scenario(name, before.label, before, args))
            rows.append(run_scenario(name, "this tree", None, args))
    finally:
        if before is not None:
            before.close()
    env = environment()
    config = f"config {Path(args.config).name}" if args.config else "default config"
    title = (f"one client against the others, {config}, {env.get('cpu_model', '?')} "
             f"({os.cpu_count()} CPUs)")
    print(f"\n{title}\n{format_table(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    if args.plot:
        write_plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
