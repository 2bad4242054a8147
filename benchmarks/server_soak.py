"""A long run of mixed traffic against one server: does it keep answering, fail only what it
should, and keep its memory flat?

For ``--duration`` seconds, client threads of each kind loop until time is up:

- ``one_token``, ``short``: non-streaming completions of 1 and 16 tokens (timed: the latency
  table's p50/p99 is the server's responsiveness under the rest of the load);
- ``stream_chat``: streaming chat completions of 32 tokens;
- ``max_limit``: the largest request the default ``frontend.limits`` allow (128 streamed samples,
  64 stop strings of 256 characters, logprobs at the limit), with short outputs so that many run;
- ``oversized``: a 2 MiB body, which must be a 413; ``malformed``: broken JSON, a 400;
- ``slow_headers``: a connection that sends its request headers one line a second, then asks
  for ``/health`` (a 200, or the server closing the connection, is the right answer);
- ``disconnect``: a stream the client drops after its first events (the server must abort it).

Every ``--sample-s`` seconds the resident memory (RSS) of the API process and the engine core
is sampled and a progress line printed. At the end: completed and failed requests per kind
(each kind's expected answer counts as completed), latency percentiles, RSS over the run, and
the flatness check: **PASS when, for both processes, the peak RSS in the last
``--final-window`` seconds of load (60) is within ``--rss-tolerance-mb`` (32 MiB) of the peak in
the first ``--warmup`` seconds (120)**, else FAIL (exit status 1). Peaks rather than single
samples, since a sample may land in a step's temporaries; a leak of 5 MiB a minute fails a
10-minute run. RSS is read once more after ``--idle-s`` seconds without load (the engine core
trims its heap once idle). A server started here is stopped with SIGINT and its log is checked
for errors and for an exit code of None.

    CORELLM_DEFAULT_MODEL=random python3 benchmarks/server_soak.py --json soak.json --plot soak.png
    python3 benchmarks/server_soak.py --url http://127.0.0.1:8000 --pids API_PID,ENGINE_PID

A server started here runs the default configuration (or ``--config``); the timed requests
share the batch with the ``max_limit`` requests' 128 samples as the scheduler's seat share
allows. With ``--url`` the RSS columns need ``--pids`` (the processes must be on this machine).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import logger, pyplot, write_json  # noqa: E402
from benchmarks.server_abuse import worst_allowed_body  # noqa: E402
from corellm_plugins.bench.env import environment  # noqa: E402
from corellm_plugins.bench.metrics import percentile  # noqa: E402
from corellm_plugins.bench.server_process import ServerProcess  # noqa: E402

log = logger("server_soak")

# kind -> client threads (--clients overrides)
DEFAULT_CLIENTS = {"one_token": 1, "short": 1, "stream_chat": 2, "max_limit": 1,
                   "oversized": 1, "malformed": 1, "slow_headers": 2, "disconnect": 1}
# Seconds a client of these kinds waits between requests: they test a refusal path, and a
# tight loop of refusals would only measure how fast the server says no.
PAUSE_S = {"oversized": 1.0, "malformed": 0.25, "disconnect": 0.5}
MALFORMED = [b'{"prompt": "x", "max_tokens": ', b'{"prompt": "x",}', b"\xff\xfe{}",
             b'{"prompt": "x", "max_tokens": 1e999999}', b"[" * 10_000, b"not json"]
WORDS = ("river stone light paper window garden music winter orange silver market "
         "cloud engine forest letter yellow").split()


def _percentile(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process (Linux /proc), MiB, or None."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class KindStats:
    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)
    outcomes: collections.Counter = field(default_factory=collections.Counter)


class Soak:
    def __init__(self, client: Any, url: str, model: str, max_model_len: int,
                 args: argparse.Namespace) -> None:
        self.client, self.url, self.model = client, url, model
        self.max_model_len = max_model_len
        self.args = args
        split = urlsplit(url)
        self.host, self.port = split.hostname, split.port or 80
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.stats: dict[str, KindStats] = collections.defaultdict(KindStats)
        self.seq = 0

    def record(self, kind: str, ok: bool, seconds: float, outcome: str) -> None:
        with self.lock:
            s = self.stats[kind]
            if ok:
                s.ok += 1
                s.latencies.append(seconds)
            else:
                s.failed += 1
            s.outcomes[outcome] += 1

    def prompt(self, rng: random.Random) -> str:
        # Distinct prompts, some sharing a prefix, so the prefix cache both hits and churns.
        with self.lock:
            self.seq += 1
            n = self.seq
        head = "Shared context about rivers. " if n % 3 == 0 else ""
        return head + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24))) + f" {n}"

    # ------------------------------------------------------------------ the clients
    def one_token(self, rng: random.Random) -> tuple[bool, str]:
        return self._completion(rng, 1)

    def short(self, rng: random.Random) -> tuple[bool, str]:
        return self._completion(rng, 16)

    def _completion(self, rng: random.Random, max_tokens: int) -> tuple[bool, str]:
        r = self.client.post(f"{self.url}/v1/completions", timeout=self.args.timeout,
                             json={"model": self.model, "prompt": self.prompt(rng),
                                   "max_tokens": max_tokens, "ignore_eos": True})
        ok = r.status_code == 200 and \
            r.json()["usage"]["completion_tokens"] == max_tokens
        return ok, str(r.status_code)

    def _stream(self, path: str, body: dict[str, Any], stop_after: int | None = None,
                ) -> tuple[bool, str]:
        events = 0
        with self.client.stream("POST", f"{self.url}{path}", json={**body, "model": self.model},
                                timeout=self.args.timeout) as r:
            if r.status_code != 200:
                return False, str(r.status_code)
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return events > 0, "200"
                if line.startswith("data: "):
                    if '"error"' in line[:20]:
                        return False, "error event"
                    events += 1
                    if stop_after is not None and events >= stop_after:
                        return True, "dropped"        # leaving the block closes the connection
        return False, "no [DONE]"

    def stream_chat(self, rng: random.Random) -> tuple[bool, str]:
        return self._stream("/v1/chat/completions", {
            "messages": [{"role": "user", "content": self.prompt(rng)}], "max_tokens": 32,
            "ignore_eos": True, "stream": True})

    def max_limit(self, rng: random.Random) -> tuple[bool, str]:
        body = worst_allowed_body(self.max_model_len)
        body.update(prompt=self.prompt(rng), max_tokens=self.args.max_limit_tokens)
        return self._stream("/v1/completions", body)

    def disconnect(self, rng: random.Random) -> tuple[bool, str]:
        return self._stream("/v1/completions", {
            "prompt": self.prompt(rng), "max_tokens": min(256, self.max_model_len // 2),
            "ignore_eos": True, "stream": True},
            stop_after=3)

    def oversized(self, rng: random.Random) -> tuple[bool, str]:
        body = json.dumps({"model": self.model, "max_tokens": 1,
                           "prompt": "x" * self.args.oversize_bytes}).encode()
        r = self.client.post(f"{self.url}/v1/completions", content=body,
                             headers={"content-type": "application/json"},
                             timeout=self.args.timeout)
        return r.status_code == 413, str(r.status_code)

    def malformed(self, rng: random.Random) -> tuple[bool, str]:
        r = self.client.post(f"{self.url}/v1/completions", content=rng.choice(MALFORMED),
                             headers={"content-type": "application/json"},
                             timeout=self.args.timeout)
        return r.status_code == 400, str(r.status_code)

    def slow_headers(self, rng: random.Random) -> tuple[bool, str]:
        lines = [f"GET /health HTTP/1.1\r\nHost: {self.host}\r\n".encode()]
        lines += [f"X-Slow-{i}: {'a' * 20}\r\n".encode() for i in range(self.args.slow_lines)]
        with socket.create_connection((self.host, self.port), timeout=self.args.timeout) as s:
            try:
                for chunk in lines:
                    s.sendall(chunk)
                    if self.stop.wait(1.0):
                        return False, "stopped"      # by the end of the run: not counted
                s.sendall(b"Connection: close\r\n\r\n")
                head = s.recv(64)
            except (BrokenPipeError, ConnectionResetError):
                return True, "closed by server"
        if not head:
            return True, "closed by server"
        status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "garbage"
        return status in ("200", "408"), status

    # ------------------------------------------------------------------ running
    def client_loop(self, kind: str, index: int) -> None:
        fn: Callable[[random.Random], tuple[bool, str]] = getattr(self, kind)
        rng = random.Random(f"{self.args.seed}-{kind}-{index}")
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                ok, outcome = fn(rng)
            except Exception as exc:          # noqa: BLE001 - counted and reported
                ok, outcome = False, type(exc).__name__
            if self.stop.is_set() and not ok:
                return              # cut short by the end of the run: not the server's fault
            self.record(kind, ok, time.perf_counter() - t0, outcome)
            self.stop.wait(PAUSE_S.get(kind, 0.0))

    def snapshot(self) -> dict[str, tuple[int, int]]:
        with self.lock:
            return {k: (s.ok, s.failed) for k, s in self.stats.items()}


def parse_clients(text: str) -> dict[str, int]:
    clients = dict(DEFAULT_CLIENTS)
    for item in filter(None, text.split(",")):
        kind, _, n = item.partition("=")
        if kind not in DEFAULT_CLIENTS:
            raise argparse.ArgumentTypeError(f"unknown client kind {kind!r} (kinds: "
                                             f"{', '.join(DEFAULT_CLIENTS)})")
        clients[kind] = int(n)
    return clients


def growth_per_min(samples: list[dict[str, Any]], key: str, since: float) -> float | None:
    """Least-squares slope of ``key`` (MiB) over the samples from ``since`` on, MiB/minute."""
    pts = [(s["t"], s[key]) for s in samples if s["t"] >= since and s[key] is not None]
    if len(pts) < 3:
        return None
    mt = statistics.fmean(t for t, _ in pts)
    mv = statistics.fmean(v for _, v in pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return 60 * sum((t - mt) * (v - mv) for t, v in pts) / den if den else None


def memory_summary(samples: list[dict[str, Any]], warmup: float, window: float,
                   tolerance: float) -> dict[str, dict[str, Any]]:
    """Per process: RSS at the start, its peak during the warm-up and during the final
    ``window`` seconds of load, and whether the second exceeds the first by at most
    ``tolerance`` MiB. Peaks, not single samples: a sample can land in a step's temporaries."""
    out = {}
    for proc in ("api", "engine"):
        key = f"{proc}_rss_mb"
        vals = [s for s in samples if s[key] is not None]
        if not vals:
            continue
        end_t = vals[-1]["t"]
        warm = [s[key] for s in vals if s["t"] <= warmup] or [vals[0][key]]
        final = [s[key] for s in vals if s["t"] >= max(warmup, end_t - window)] or [vals[-1][key]]
        grew = max(final) - max(warm)
        out[proc] = {"start_mb": vals[0][key], "warm_peak_mb": max(warm),
                     "final_peak_mb": max(final), "end_mb": vals[-1][key],
                     "peak_mb": max(s[key] for s in vals), "growth_mb": grew,
                     "mb_per_min": growth_per_min(vals, key, warmup), "flat": grew <= tolerance}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    server = None
    if not args.url:
        server = ServerProcess(args.config, log_file=args.server_log)
        server.start()
    api_pid, engine_pid = (server.pid, server.engine_pid) if server else \
        (args.pids + [None, None])[:2]
    samples: list[dict[str, Any]] = []
    try:
        url = args.url or server.url
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        with httpx.Client(limits=limits) as client:
            info = client.get(f"{url}/v1/models", timeout=30).json()["data"][0]
            model, max_model_len = info["id"], info.get("max_model_len", 1024)
            soak = Soak(client, url, model, max_model_len, args)
            t0 = time.monotonic()

            def sample() -> dict[str, Any]:
                s = {"t": round(time.monotonic() - t0, 1), "api_rss_mb": rss_mb(api_pid),
                     "engine_rss_mb": rss_mb(engine_pid), "counts": soak.snapshot()}
                samples.append(s)
                return s

            sample()
            threads = [threading.Thread(target=soak.client_loop, args=(kind, i), daemon=True,
                                        name=f"soak-{kind}-{i}")
                       for kind, n in args.clients.items() for i in range(n)]
            for t in threads:
                t.start()
            log(f"{len(threads)} clients for {args.duration:.0f} s against {url} ({model})")
            deadline = t0 + args.duration
            while not soak.stop.wait(max(0.0, min(args.sample_s, deadline - time.monotonic()))):
                s = sample()
                done = sum(ok for ok, _ in s["counts"].values())
                failed = sum(f for _, f in s["counts"].values())
                lat = soak.stats["one_token"].latencies[-200:]
                p50 = _percentile(lat, 50)
                log(f"{s['t']:6.0f} s: {done} ok, {failed} failed; RSS api "
                    f"{s['api_rss_mb'] or 0:.0f} MiB, engine {s['engine_rss_mb'] or 0:.0f} MiB; "
                    f"1-token p50 {p50 * 1e3 if p50 else 0:.0f} ms")
                if time.monotonic() >= deadline:
                    soak.stop.set()
            for t in threads:
                t.join(args.timeout)
            stuck = [t.name for t in threads if t.is_alive()]
            # The load is over: what memory do the processes hold once idle?
            time.sleep(args.idle_s)
            idle = {"api_rss_mb": rss_mb(api_pid), "engine_rss_mb": rss_mb(engine_pid)}
            health = client.get(f"{url}/health", timeout=30).status_code
    finally:
        if server is not None:
            server.stop()
    log_problems = []
    if server is not None and args.server_log:
        for line in Path(args.server_log).read_text().splitlines():
            if "exit code None" in line or any(w in line for w in ("ERROR", "Traceback",
                                                                   "CRITICAL")):
                log_problems.append(line)
    kinds = {}
    for kind in args.clients:
        st = soak.stats[kind]
        kinds[kind] = {"ok": st.ok, "failed": st.failed, "outcomes": dict(st.outcomes),
                       "p50_ms": (_percentile(st.latencies, 50) or 0) * 1e3 or None,
                       "p99_ms": (_percentile(st.latencies, 99) or 0) * 1e3 or None}
    memory = memory_summary(samples, args.warmup, args.final_window, args.rss_tolerance_mb)
    return {"environment": environment(), "model": model, "url": url,
            "started_here": server is not None, "args": {
                k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "kinds": kinds, "samples": samples, "memory": memory, "idle_after_load": idle,
            "health_at_end": health, "stuck_clients": stuck, "server_log_problems": log_problems,
            "criterion": f"peak RSS in the last {args.final_window:g} s of load within "
                         f"{args.rss_tolerance_mb:g} MiB of the peak in the first "
                         f"{args.warmup:g} s, for the API process and the engine core",
            "flat": bool(memory) and all(m["flat"] for m in memory.values())}


def format_tables(results: dict[str, Any]) -> str:
    env = results["environment"]
    dur = results["args"]["duration"]
    lines = [f"# soak: {results['model']}, {dur:.0f} s, {env['cpu_model']} "
             f"({env['cpu_count']} CPUs), {env['date'][:10]}", "",
             "| client | threads | completed | failed | p50 ms | p99 ms | outcomes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    clients = results["args"]["clients"]
    for kind, k in results["kinds"].items():
        p50 = f"{k['p50_ms']:.0f}" if k["p50_ms"] else "-"
        p99 = f"{k['p99_ms']:.0f}" if k["p99_ms"] else "-"
        outcomes = ", ".join(f"{o}: {n}" for o, n in sorted(k["outcomes"].items()))
        lines.append(f"| {kind} | {clients[kind]} | {k['ok']} | {k['failed']} | {p50} | {p99} | "
                     f"{outcomes} |")
    mem, idle = results["memory"], results["idle_after_load"]
    args = results["args"]
    if mem:
        lines += ["", f"| process | RSS at start | peak, first {args['warmup']:.0f} s | peak, last "
                      f"{args['final_window']:.0f} s | growth | MiB/min after warm-up | end of "
                      f"load | {args['idle_s']:.0f} s idle after |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for proc, m in mem.items():
            rate = f"{m['mb_per_min']:+.2f}" if m["mb_per_min"] is not None else "-"
            idle_mb = idle.get(f"{proc}_rss_mb")
            lines.append(f"| {proc} | {m['start_mb']:.0f} MiB | {m['warm_peak_mb']:.0f} MiB | "
                         f"{m['final_peak_mb']:.0f} MiB | {m['growth_mb']:+.0f} MiB | {rate} | "
                         f"{m['end_mb']:.0f} MiB | "
                         + (f"{idle_mb:.0f} MiB |" if idle_mb is not None else "- |"))
    lines += ["", f"flatness ({results['criterion']}): "
                  f"{'PASS' if results['flat'] else 'FAIL' if mem else 'n/a (no RSS)'}",
              f"/health at the end: {results['health_at_end']}"]
    if results["stuck_clients"]:
        lines.append(f"clients still running at the end: {', '.join(results['stuck_clients'])}")
    if results["started_here"]:
        problems = results["server_log_problems"]
        lines.append(f"server log: {len(problems)} error line(s)"
                     + "".join(f"\n    {p}" for p in problems[:10]))
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    samples = results["samples"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [s["t"] for s in samples]
    for proc, label in (("api", "API process"), ("engine", "engine core")):
        vals = [s[f"{proc}_rss_mb"] for s in samples]
        if any(v is not None for v in vals):
            ax.plot(t, vals, marker=".", label=label)
    args = results["args"]
    ax.axvline(args["warmup"], color="gray", linestyle="--", linewidth=1, label="end of warm-up")
    ax.axvspan(max(args["warmup"], t[-1] - args["final_window"]), t[-1], color="gray",
               alpha=0.15, label="final window")
    ax.set_ylabel("RSS, MiB")
    ax.legend(fontsize=8)
    env = results["environment"]
    ax.set_title(f"soak: {results['model']} on {env['cpu_model']}, "
                 f"{'PASS' if results['flat'] else 'FAIL'}", fontsize=9)
    prev: dict[str, tuple[int, int]] = {}
    for kind in results["kinds"]:
        rate = []
        for i, s in enumerate(samples):
            ok = s["counts"].get(kind, (0, 0))[0]
            dt = s["t"] - samples[i - 1]["t"] if i else 0
            rate.append((ok - prev.get(kind, (0, 0))[0]) / dt if dt else 0)
            prev[kind] = s["counts"].get(kind, (0, 0))
        prev = {}
        ax2.plot(t, rate, label=kind)
    ax2.set_ylabel("completed / s")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; default: start `corellm serve` here")
    p.add_argument("--pids", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="with --url: API_PID,ENGINE_PID, whose RSS is sampled")
    p.add_argument("--config", help="config for the server started here")
    p.add_argument("--duration", type=float, default=600, help="seconds of load")
    p.add_argument("--warmup", type=float, default=120,
                   help="seconds of load in which RSS may rise to its working level")
    p.add_argument("--final-window", type=float, default=60,
                   help="the last seconds of load, whose peak RSS is compared with the warm-up's")
    p.add_argument("--rss-tolerance-mb", type=float, default=32,
                   help="growth allowed from the warm-up's peak RSS to the final window's, "
                        "per process")
    p.add_argument("--sample-s", type=float, default=10, help="seconds between RSS samples")
    p.add_argument("--idle-s", type=float, default=10,
                   help="seconds idle after the load before the last RSS reading (the engine "
                        "core trims its heap after 5 s idle)")
    p.add_argument("--clients", type=parse_clients, default=dict(DEFAULT_CLIENTS),
                   help="KIND=N[,...]: client threads per kind (0 leaves a kind out); "
                        f"default {','.join(f'{k}={n}' for k, n in DEFAULT_CLIENTS.items())}")
    p.add_argument("--max-limit-tokens", type=int, default=16,
                   help="max_tokens of each of a max_limit request's 128 samples")
    p.add_argument("--oversize-bytes", type=int, default=2 << 20,
                   help="size of an oversized body (the default limit is 1 MiB)")
    p.add_argument("--slow-lines", type=int, default=5,
                   help="header lines a slow client sends, one a second")
    p.add_argument("--timeout", type=float, default=120, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default=None,
                   help="where the server started here logs (default: a temporary file)")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--plot", metavar="OUT.png")
    args = p.parse_args(argv)
    if args.url is None and args.server_log is None:
        import tempfile
        args.server_log = tempfile.mkstemp(prefix="corellm-soak-", suffix=".log")[1]
    results = run(args)
    print(format_tables(results), flush=True)
    if args.json:
        write_json(results, args.json, log)
    if args.plot and write_plot(results, args.plot):
        log(f"wrote {args.plot}")
    return 0 if results["flat"] or not results["memory"] else 1


if __name__ == "__main__":
    sys.exit(main())
