"""Per-step channel overhead of the tensor-parallel executor, with no model at all.

The multiproc executor (plugins/executor_multiproc) sends every step's plan to its N workers
through a shared-memory ring (one pickle, one copy into /dev/shm, a doorbell byte per reader) and
rank 0 returns its sampled tokens through a second ring. This measures that round trip, engine
-> every rank -> rank 0's output back to the engine, against the obvious alternative: a
``multiprocessing.Pipe`` per rank (``conn.send``: pickled once per rank, copied through the
kernel) with rank 0 replying on its pipe.

    python3 benchmarks/tp_channel.py                          # 2 ranks, decode B=1,16,64,256
    python3 benchmarks/tp_channel.py --steps 50               # a quick look
    python3 benchmarks/tp_channel.py --ranks 4 --slot-bytes 4096 --json out.json --plot out.png

The readers are spawned processes mimicking ranks (``multiprocessing.get_context("spawn")``,
wired like ``_SpawnBackend.start``): each reads every message; rank 0 answers each ``step``
message with a ``ModelRunnerOutput`` of one sampled token per request the plan samples. The
messages are the executor's own: ``("step", plan, prev)`` as ``_SpawnBackend.send_step`` writes
it, with realistic ``SchedulerOutput`` plans:

* ``null``: a tiny message (``("ping",)``, answered ``("pong",)``): the floor of the channel;
* ``decode B=..``: B running requests, a ``CachedRequestData`` for each that gets a new KV block (every 16
  tokens), the per-request dicts and lists, and the previous step's sampled tokens (``prev``);
* ``prefill 8x512``: 8 new requests of 512 prompt tokens (``NewRequestData`` with
  ``SamplingParams()``), the largest plan; with a small ``--slot-bytes`` it spans ring slots.

The time of a step includes pickling the message (both channels pay it, the pipe once per rank)
and building nothing else: plans are built before the clock starts. Each configuration is timed
in ``--rounds`` chunks alternating shm and pipe (after a warm-up), so a slow phase of the machine
falls on both. Reports median and p99 microseconds per step.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import pickle
import random
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# Light imports only at module level: every spawned reader re-imports this module.
from corellm.outputs import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                             SchedulerOutput)
from corellm.sampling_params import SamplingParams
from corellm.platforms.shm_ring import (RingReader, RingWriter, create_ring,
                                                   doorbell_pair, unlink_ring)

BLOCK_SIZE = 16
VOCAB = 32000
REPLY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


# --------------------------------------------------------------------------- reader side
def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _answer(msg: tuple, tokens: list[int]) -> Any:
    """Rank 0's reply to a message, or None when it needs none."""
    if msg[0] == "ping":
        return ("pong",)
    if msg[0] == "step":
        plan = msg[1]
        ids = list(plan.sampling_req_ids)
        # Shaped like the model runner's output: one token per sampled request, phase timings.
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=tokens[:len(ids)],
                                 timings={"prepare_inputs": 1e-4, "forward": 1e-2,
                                          "sample": 1e-4})
    return None


def _shm_reader(rank: int, plan_spec: Any, plan_bell: Any, out_spec: Any, out_bells: list,
                ready: Any) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    tokens = [random.randrange(VOCAB) for _ in range(4096)]
    reader = RingReader(plan_spec, rank, plan_bell)
    writer = RingWriter(out_spec, out_bells) if rank == 0 else None
    ready.send("ready")

    def parent_alive() -> None:
        if os.getppid() != parent:
            os._exit(1)

    while True:
        msg = reader.read(idle=parent_alive)
        if msg[0] == "stop":
            break
        if writer is not None:
            reply = _answer(msg, tokens)
            if reply is not None:
                writer.write(reply)
    os._exit(0)


def _pipe_reader(rank: int, conn: Any) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokens = [random.randrange(VOCAB) for _ in range(4096)]
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            os._exit(1)
        if msg[0] == "stop":
            break
        if rank == 0:
            reply = _answer(msg, tokens)
            if reply is not None:
                conn.send(reply)
    os._exit(0)


# --------------------------------------------------------------------------- engine side
class _Channel:
    name = ""
    procs: list[Any]

    def alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise RuntimeError(f"{self.name} reader rank {rank} exited ({p.exitcode})")

    def _stop_procs(self) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(2.0)


class ShmChannel(_Channel):
    """Wired as ``_SpawnBackend.start`` wires the executor's rings."""

    name = "shm"

    def __init__(self, ctx: Any, ranks: int, slots: int, slot_bytes: int) -> None:
        self.procs, self.writer, self.reader = [], None, None
        self.plan_spec = create_ring(ranks, slots, slot_bytes)
        self.out_spec = create_ring(1, slots, slot_bytes)
        try:
            plan_bells = [doorbell_pair() for _ in range(ranks)]
            out_r, out_w = doorbell_pair()
            ready = []
            for rank in range(ranks):
                mine, theirs = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_shm_reader, name=f"tp-channel-shm{rank}", daemon=True,
                                args=(rank, self.plan_spec, plan_bells[rank][0], self.out_spec,
                                      [out_w] if rank == 0 else [], theirs))
                p.start()
                theirs.close()
                self.procs.append(p)
                ready.append(mine)
            for r, _ in plan_bells:
                r.close()
            self.writer = RingWriter(self.plan_spec, [w for _, w in plan_bells],
                                     alive=self.alive)
            self.reader = RingReader(self.out_spec, 0, out_r)
            out_w.close()
            for rank, conn in enumerate(ready):
                if not conn.poll(120):
                    raise RuntimeError(f"shm reader rank {rank} did not start")
                conn.recv()
                conn.close()
        finally:
            # Every process has mapped both rings (or failed): the memory goes with the last.
            unlink_ring(self.plan_spec)
            unlink_ring(self.out_spec)

    def send(self, msg: tuple) -> int:
        return self.writer.write(msg)

    def recv(self) -> Any:
        return self.reader.read(timeout=REPLY_TIMEOUT_S, idle=self.alive, idle_every=1.0)

    def close(self) -> None:
        if self.writer is not None and all(p.exitcode is None for p in self.procs):
            try:
                self.writer.write(("stop",))
            except Exception:  # noqa: BLE001, S110 - best effort while stopping
                pass
        self._stop_procs()
        for end in (self.writer, self.reader):
            if end is not None:
                end.close()
        unlink_ring(self.plan_spec)
        unlink_ring(self.out_spec)


class PipeChannel(_Channel):
    """The baseline: a duplex ``multiprocessing.Pipe`` per rank."""

    name = "pipe"

    def __init__(self, ctx: Any, ranks: int) -> None:
        self.procs, self.conns = [], []
        for rank in range(ranks):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_pipe_reader, name=f"tp-channel-pipe{rank}", daemon=True,
                            args=(rank, theirs))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(120):
                raise RuntimeError(f"pipe reader rank {rank} did not start")
            conn.recv()

    def send(self, msg: tuple) -> int:
        for conn in self.conns:
            conn.send(msg)
        return 0

    def recv(self) -> Any:
        conn = self.conns[0]
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not conn.poll(1.0):
            self.alive()
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 did not answer")
        return conn.recv()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except Exception:  # noqa: BLE001, S110 - best effort while stopping
                pass
        self._stop_procs()
        for conn in self.conns:
            conn.close()


# --------------------------------------------------------------------------- the messages
def _req_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}-0"


class Ping:
    name = "null"

    def next(self, prev: Any) -> tuple:
        return ("ping",)


class Decode:
    """B running requests, each one token further every step; a new KV block every 16."""

    def __init__(self, batch: int, rng: random.Random) -> None:
        self.name = f"decode B={batch}"
        self.ids = [_req_id() for _ in range(batch)]
        self.computed = [rng.randrange(64, 2048) for _ in range(batch)]
        self.next_block = 10_000

    def next(self, prev: ModelRunnerOutput | None) -> tuple:
        cached, sched, computed = [], {}, {}
        for i, rid in enumerate(self.ids):
            n = self.computed[i]
            new_blocks: list[int] = []
            if n % BLOCK_SIZE == 0:
                new_blocks = [self.next_block]
                self.next_block += 1
                cached.append(CachedRequestData(rid, new_blocks, n))
            sched[rid] = 1
            computed[rid] = n
            self.computed[i] = n + 1
        plan = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                               num_scheduled_tokens=sched,
                               total_num_scheduled_tokens=len(self.ids),
                               num_computed_tokens=computed, sampling_req_ids=list(self.ids))
        return ("step", plan, prev)


class Prefill:
    """8 new requests of 512 prompt tokens each (fresh ids and prompts every step)."""

    def __init__(self, reqs: int, prompt_len: int, rng: random.Random) -> None:
        self.name = f"prefill {reqs}x{prompt_len}"
        self.reqs, self.prompt_len, self.rng = reqs, prompt_len, rng
        self.prompts = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(64)]
        self.k = 0

    def next(self, prev: ModelRunnerOutput | None) -> tuple:
        new, sched, computed = [], {}, {}
        blocks = -(-self.prompt_len // BLOCK_SIZE)
        for j in range(self.reqs):
            rid = _req_id()
            tokens = list(self.prompts[(self.k + j) % len(self.prompts)])
            new.append(NewRequestData(rid, tokens, self.prompt_len,
                                      list(range(j * blocks, (j + 1) * blocks)), 0,
                                      SamplingParams(), eos_token_id=2))
            sched[rid] = self.prompt_len
            computed[rid] = 0
        self.k += self.reqs
        plan = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                               num_scheduled_tokens=sched,
                               total_num_scheduled_tokens=self.reqs * self.prompt_len,
                               num_computed_tokens=computed, sampling_req_ids=list(sched))
        return ("step", plan, prev)


def _as_prev(out: Any) -> ModelRunnerOutput | None:
    """What the executor sends with the next plan (``MultiprocExecutor._wait_output``)."""
    if isinstance(out, ModelRunnerOutput) and out.req_ids:
        return ModelRunnerOutput(out.req_ids, out.sampled_token_ids)
    return None


def run_steps(chan: _Channel, source: Any, steps: int, state: dict, times: list[float] | None
              ) -> None:
    """``steps`` round trips; appends each one's seconds to ``times`` (None: warm-up)."""
    for _ in range(steps):
        msg = source.next(state.get("prev"))
        t0 = time.perf_counter()
        chan.send(msg)
        out = chan.recv()
        dt = time.perf_counter() - t0
        if times is not None:
            times.append(dt)
        state["prev"] = _as_prev(out)


def _stats(times: list[float]) -> dict[str, float]:
    us = sorted(t * 1e6 for t in times)
    p99 = statistics.quantiles(us, n=100, method="inclusive")[98] if len(us) > 1 else us[0]
    return {"median_us": statistics.median(us), "p99_us": p99, "mean_us": statistics.fmean(us),
            "min_us": us[0], "n": len(us)}


def measure(chans: dict[str, _Channel], source: Any, steps: int, warmup: int, rounds: int,
            log) -> dict[str, Any]:
    # Each transport keeps its own "previous output" (as an executor would).
    states = {name: {"prev": None} for name in chans}
    times: dict[str, list[float]] = {name: [] for name in chans}
    for name, chan in chans.items():
        run_steps(chan, source, warmup, states[name], None)
    # The size of one message as it is sent, and of rank 0's reply to it.
    msg = source.next(states["shm"]["prev"])
    plan_bytes = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    reply = _answer(msg, [0] * 4096)
    reply_bytes = len(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    # Serialization alone, in this process: what any channel pays before moving a byte.
    reps, ser = max(11, min(201, 20_000 // max(plan_bytes // 100, 1))), []
    for _ in range(reps):
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        ser.append(time.perf_counter() - t0)
    pickle_us = statistics.median(ser) * 1e6
    per = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
    order = list(chans)
    for i, n in enumerate(per):
        for name in (order if i % 2 == 0 else order[::-1]):
            run_steps(chans[name], source, min(warmup, 10), states[name], None)
            run_steps(chans[name], source, n, states[name], times[name])
    row = {"message": source.name, "bytes": plan_bytes, "reply_bytes": reply_bytes,
           "pickle_roundtrip_us": pickle_us}
    for name in chans:
        row[name] = _stats(times[name])
    row["shm_over_pipe"] = row["shm"]["median_us"] / row["pipe"]["median_us"]
    log(f"{source.name}: {plan_bytes} B, shm {row['shm']['median_us']:.0f} us, "
        f"pipe {row['pipe']['median_us']:.0f} us (median); pickle+unpickle of message and "
        f"reply alone {pickle_us:.0f} us")
    return row


# --------------------------------------------------------------------------- output
def format_table(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    lines = [
        (f"# tp channel round trip, {cfg['ranks']} ranks: {env['cpu_model']} "
         f"({env['cpu_count']} CPUs), python {env['python']}, corellm {env.get('corellm')}, "
         f"{env['date']}"),
        (f"# ring: {cfg['slots']} slots x {cfg['slot_bytes']} B; {cfg['steps']} timed steps "
         f"per cell in {cfg['rounds']} alternating rounds; load average "
         f"{results['loadavg_before']} -> {results['loadavg_after']}"),
        ("# bytes: the pickled (\"step\", plan, prev) message; us: per step, from sending it "
         "to rank 0's reply received"),
        ""]
    head = (f"{'message':<16} {'bytes':>8} {'shm med us':>11} {'shm p99 us':>11} "
            f"{'pipe med us':>12} {'pipe p99 us':>12} {'shm/pipe':>9}")
    lines += [head, "-" * len(head)]
    for r in results["rows"]:
        lines.append(f"{r['message']:<16} {r['bytes']:>8} {r['shm']['median_us']:>11.1f} "
                     f"{r['shm']['p99_us']:>11.1f} {r['pipe']['median_us']:>12.1f} "
                     f"{r['pipe']['p99_us']:>12.1f} {r['shm_over_pipe']:>9.2f}")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str, log) -> bool:
    from _common import pyplot
    plt = pyplot(path, log)
    if plt is None:
        return False
    rows = results["rows"]
    x = list(range(len(rows)))
    w = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows)), 4.5))
    for k, (name, color) in enumerate((("shm", "tab:blue"), ("pipe", "tab:orange"))):
        xs = [i + (k - 0.5) * w for i in x]
        med = [r[name]["median_us"] for r in rows]
        p99 = [r[name]["p99_us"] for r in rows]
        ax.bar(xs, med, w, color=color, label=f"{name} median")
        ax.scatter(xs, p99, marker="_", s=300, color="black", zorder=3,
                   label="p99" if k == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['message']}\n{r['bytes']} B" for r in rows], fontsize=8)
    ax.set_ylabel("round trip per step (us)")
    ax.set_yscale("log")
    env, cfg = results["environment"], results["config"]
    ax.set_title(f"TP plan broadcast + rank-0 reply, {cfg['ranks']} ranks, no model\n"
                 f"{env['cpu_model']} ({env['cpu_count']} CPUs)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main
def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import environment, loadavg, logger, parse_int_list, report, warn_if_busy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--batch", type=parse_int_list, default=[1, 16, 64, 256],
                   help="decode batch sizes (default 1,16,64,256)")
    p.add_argument("--steps", type=int, default=2000, help="timed steps per cell (default 2000)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per cell (default: steps/10, 5..200)")
    p.add_argument("--rounds", type=int, default=4,
                   help="alternating shm/pipe chunks the steps are split into (default 4)")
    p.add_argument("--slots", type=int, default=8, help="ring slots (executor default 8)")
    p.add_argument("--slot-bytes", type=int, default=1 << 20,
                   help="bytes per ring slot (executor default 1 MiB)")
    p.add_argument("--prefill", default="8x512", help="REQSxTOKENS of the prefill plan, "
                   "or 'none' (default 8x512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="bar chart (needs matplotlib)")
    args = p.parse_args()
    if args.ranks < 1 or args.steps < 1 or args.rounds < 1 or args.slots < 2 \
            or args.slot_bytes < 1:
        p.error("--ranks, --steps, --rounds, --slot-bytes must be >= 1 and --slots >= 2")
    args.rounds = min(args.rounds, args.steps)
    warmup = args.warmup if args.warmup is not None else max(5, min(200, args.steps // 10))
    log = logger("tp-channel")
    warn_if_busy(log)

    rng = random.Random(args.seed)
    random.seed(args.seed)
    sources: list[Any] = [Ping()] + [Decode(b, rng) for b in args.batch]
    if args.prefill != "none":
        reqs, _, tokens = args.prefill.partition("x")
        sources.append(Prefill(int(reqs), int(tokens), rng))

    env = environment()
    load_before = loadavg()
    ctx = mp.get_context("spawn")
    chans: dict[str, _Channel] = {}
    t_start = time.perf_counter()
    try:
        log(f"spawning {args.ranks} shm readers and {args.ranks} pipe readers")
        chans["shm"] = ShmChannel(ctx, args.ranks, args.slots, args.slot_bytes)
        chans["pipe"] = PipeChannel(ctx, args.ranks)
        rows = []
        for i, src in enumerate(sources, 1):
            log(f"[{i}/{len(sources)}] {src.name}: {warmup} warm-up + {args.steps} steps x "
                f"{len(chans)} channels")
            rows.append(measure(chans, src, args.steps, warmup, args.rounds, log))
    finally:
        for chan in chans.values():
            chan.close()
    log(f"done in {time.perf_counter() - t_start:.1f} s; readers stopped")

    results = {
        "benchmark": "tp_channel", "environment": env,
        "config": {"ranks": args.ranks, "steps": args.steps, "warmup": warmup,
                   "rounds": args.rounds, "slots": args.slots, "slot_bytes": args.slot_bytes,
                   "batch": args.batch, "prefill": args.prefill, "seed": args.seed},
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rows": rows,
    }
    report(results, args, format_table, lambda r, path: write_plot(r, path, log), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
