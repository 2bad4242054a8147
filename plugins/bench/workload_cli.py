"""``corellm bench workload``: write a commented workload file from a short description, or
summarize one (``--describe``).

A workload file (YAML) says which requests ``corellm bench --workload FILE`` sends and when:
lengths, prompts, shared prefixes, multi-turn sessions, tenants, priority classes and arrivals.
Writing one by hand is easy once there is one to start from; this command writes that start
from a kind (``backlog``, ``chat``, ``mixed``) and a few overrides, checks it by loading it back,
and explains every key in comments.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

KINDS: dict[str, dict[str, Any]] = {
    # A backlog: every request waits at t=0, so the scheduler's admission order decides who
    # waits; 20% interactive (priority 0) among 80% batch (priority 1).
    "backlog": {
        "name": "backlog",
        "num_requests": 48,
        "requests": {"input_len": {"dist": "uniform", "low": 64, "high": 256},
                     "output_len": 32},
        "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 4}],
        "arrivals": {"pattern": "all_at_once"},
    },
    # Multi-turn chat: sessions resend their history, so the prefix cache matters; think time
    # between turns; two tenants.
    "chat": {
        "name": "chat",
        "requests": {"input_len": {"dist": "uniform", "low": 64, "high": 192},
                     "output_len": {"dist": "uniform", "low": 16, "high": 48}},
        "sessions": {"num_sessions": 8, "turns": 4,
                     "message_len": {"dist": "uniform", "low": 16, "high": 64},
                     "think_time_s": {"dist": "exponential", "mean": 1.0}},
        "tenants": [{"name": "team-a", "weight": 2}, {"name": "team-b", "weight": 1}],
        "arrivals": {"pattern": "poisson", "rate": 1.0},
    },
    # Short and long prompts mixed (bimodal), bursty arrivals: long prefills hold up short
    # requests unless the scheduler chunks or reorders them.
    "mixed": {
        "name": "mixed",
        "num_requests": 48,
        "requests": {"input_len": {"dist": "mixture", "components": [
                         {"weight": 3, "dist": "uniform", "low": 16, "high": 64},
                         {"weight": 1, "dist": "uniform", "low": 384, "high": 512}]},
                     "output_len": {"dist": "uniform", "low": 16, "high": 48}},
        "arrivals": {"pattern": "gamma", "rate": 4.0, "burstiness": 0.5},
    },
}

EPILOG = """\
lengths (--input-len, --output-len, --message-len): N (fixed) or LO:HI (uniform, inclusive);
edit the file for normal, file or mixture distributions (the header comment shows how).

examples:
  corellm bench workload --kind backlog -o backlog.yaml
  corellm bench workload --kind backlog --num-requests 100 --priorities 0:1,1:1,2:2
  corellm bench workload --kind chat --sessions 16 --turns 6 --think-time 2 --tenants a:3,b:1
  corellm bench workload --kind mixed --rate 8 --burstiness 0.25 --seed 7 -o bursty.yaml
  corellm bench workload --describe bursty.yaml
  corellm bench --workload bursty.yaml --config fcfs.yaml --config priority.yaml
"""

DIST_HELP = [
    "Lengths are token counts: N (fixed), {dist: uniform, low: A, high: B} (inclusive),",
    "{dist: normal, mean: M, std: S, min: A, max: B} (rounded, clipped), {dist: file, path: F}",
    "(draws from a list of lengths), or {dist: mixture, components: [{weight: W, dist: ...},",
    "...]}. Seconds (think_time_s): a number, or uniform/normal/{dist: exponential, mean: S}.",
]


# ----------------------------------------------------------------------------- parsing flags
def parse_range(text: str) -> tuple[int, int]:
    """``N`` or ``LO:HI`` (inclusive, 1 <= LO <= HI), as an argparse type."""
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def _length(text: str) -> int | dict[str, Any]:
    """``N`` -> fixed, ``LO:HI`` -> uniform."""
    a, b = parse_range(text)
    return a if a == b else {"dist": "uniform", "low": a, "high": b}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _shares(kind: str):
    """``NAME:WEIGHT[,NAME:WEIGHT...]`` (weight default 1); priorities' names are integers."""

    def parse(text: str) -> list[tuple[Any, float]]:
        out: list[tuple[Any, float]] = []
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            name, sep, weight = item.rpartition(":") if ":" in item else (item, "", "1")
            try:
                w = float(weight)
                key: Any = int(name) if kind == "priority" else name
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected {'PRIORITY' if kind == 'priority' else 'NAME'}:WEIGHT[,...], "
                    f"got {item!r}") from None
            if not name or not w > 0 or not math.isfinite(w):
                raise argparse.ArgumentTypeError(f"expected a name and a weight > 0, got "
                                                 f"{item!r}")
            out.append((key, w))
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {kind}, got {text!r}")
        return out

    return parse


def _prefix(text: str) -> tuple[int, int]:
    groups, sep, length = text.partition(":")
    try:
        g, n = int(groups), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GROUPS:TOKENS, got {text!r}") from None
    if g < 1 or n < 1 or not sep:
        raise argparse.ArgumentTypeError(f"expected GROUPS:TOKENS, both >= 1, got {text!r}")
    return g, n


def _number(value: float) -> int | float:
    """3.0 -> 3, for tidy YAML."""
    return int(value) if float(value).is_integer() else value


# ----------------------------------------------------------------------------- the command
class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def add_workload_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``workload`` on ``subparsers`` (``corellm bench``'s). Its options use dests
    prefixed ``wl_`` so they cannot clash with ``corellm bench``'s own (``--seed``, ...)."""
    from .cli_common import plain
    p = subparsers.add_parser(
        "workload", help="write a workload file (--kind ...) or summarize one (--describe)",
        description=plain(__doc__), epilog=EPILOG, formatter_class=_Help)
    g = p.add_argument_group("generate (the file goes to stdout unless -o)")
    g.add_argument("--kind", dest="wl_kind", choices=sorted(KINDS), default="backlog",
                   help="backlog: all at once, 20%% priority 0 / 80%% priority 1; chat: "
                        "multi-turn sessions with think time and two tenants; mixed: short and "
                        "long prompts, bursty arrivals")
    g.add_argument("--name", dest="wl_name", metavar="NAME",
                   help="the workload's name (default: the kind)")
    g.add_argument("--num-requests", dest="wl_num_requests", type=_positive_int, metavar="N",
                   help="requests (not with sessions: they have --sessions x --turns)")
    g.add_argument("--input-len", dest="wl_input_len", type=_length, metavar="N|LO:HI",
                   help="prompt tokens of first turns (after a shared prefix)")
    g.add_argument("--output-len", dest="wl_output_len", type=_length, metavar="N|LO:HI",
                   help="output tokens per request")
    g.add_argument("--rate", dest="wl_rate", type=_positive_float, metavar="R|inf",
                   help="arrivals (of first turns) per second, Poisson; inf: all at once")
    g.add_argument("--burstiness", dest="wl_burstiness", type=_positive_float, metavar="B",
                   help="gamma arrivals as vLLM's --burstiness: 1 Poisson, < 1 burstier "
                        "(needs a finite rate)")
    g.add_argument("--tenants", dest="wl_tenants", type=_shares("tenant"),
                   metavar="NAME:W,...", help="tenants (the request's user) and their shares, "
                                              "e.g. a:3,b:1")
    g.add_argument("--priorities", dest="wl_priorities", type=_shares("priority"),
                   metavar="P:W,...", help="priority classes and their shares, e.g. 0:1,1:4 "
                                           "(lower runs first)")
    g.add_argument("--no-tenants", dest="wl_no_tenants", action="store_true",
                   help="drop the kind's tenants")
    g.add_argument("--no-priorities", dest="wl_no_priorities", action="store_true",
                   help="drop the kind's priority classes")
    g.add_argument("--sessions", dest="wl_sessions", type=_positive_int, metavar="N",
                   help="multi-turn sessions (any kind; replaces --num-requests)")
    g.add_argument("--turns", dest="wl_turns", type=_length, metavar="N|LO:HI",
                   help="turns per session (default 4)")
    g.add_argument("--message-len", dest="wl_message_len", type=_length, metavar="N|LO:HI",
                   help="tokens of a follow-up turn's new user message")
    g.add_argument("--think-time", dest="wl_think_time", type=_seconds, metavar="S",
                   help="mean seconds between a turn's end and the next turn (exponential; "
                        "0: none)")
    g.add_argument("--shared-prefix", dest="wl_shared_prefix", type=_prefix,
                   metavar="GROUPS:TOKENS", help="prompts start with one of GROUPS random "
                                                 "prefixes of TOKENS tokens")
    g.add_argument("--seed", dest="wl_seed", type=int, metavar="N",
                   help="the workload's seed (default 0); with --describe, the seed to build")
    g.add_argument("-o", "--output", dest="wl_output", metavar="FILE",
                   help="write the workload here (default: stdout)")
    d = p.add_argument_group("describe")
    d.add_argument("--describe", dest="wl_describe", metavar="FILE",
                   help="instead of generating: build FILE's workload and print its counts, "
                        "lengths, arrival span, tenants and priority classes")
    d.add_argument("--tokenizer", dest="wl_tokenizer", metavar="DIR",
                   help="tokenizer for text prompts in FILE (default: the default model's)")
    d.add_argument("--json", dest="wl_json", action="store_true",
                   help="print the summary as JSON")
    p.set_defaults(func=cmd_workload)
    return p


def cmd_workload(args: argparse.Namespace) -> int:
    """Handler of ``corellm bench workload``: describe, or generate and write."""
    from .workload_spec import WorkloadError

    try:
        if args.wl_describe:
            return _describe(args)
        text = generate_yaml(args, command=_command_line())
    except WorkloadError as exc:
        print(f"corellm bench workload: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:     # contradictory flags
        print(f"corellm bench workload: error: {exc}", file=sys.stderr)
        return 2
    if args.wl_output:
        Path(args.wl_output).write_text(text)
        print(f"wrote {args.wl_output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _command_line() -> str:
    argv = sys.argv[1:]
    return "corellm " + " ".join(shlex.quote(a) for a in argv) if argv else "corellm bench workload"


# ----------------------------------------------------------------------------- generating
def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The kind's preset with the flags applied. Raises ValueError for contradictory flags."""
    spec = json.loads(json.dumps(KINDS[args.wl_kind]))       # a deep copy
    req = spec["requests"]
    if args.wl_name:
        spec["name"] = args.wl_name
    if args.wl_seed is not None:
        spec["seed"] = args.wl_seed
    sessions = spec.get("sessions")
    if args.wl_sessions is not None:
        if args.wl_num_requests is not None:
            raise ValueError("--num-requests and --sessions exclude each other (a session "
                             "workload has sessions x turns requests)")
        sessions = spec["sessions"] = {**(sessions or {}), "num_sessions": args.wl_sessions}
        sessions.setdefault("turns", 4)
        spec.pop("num_requests", None)
    elif args.wl_num_requests is not None:
        if sessions is not None:
            raise ValueError(f"--kind {args.wl_kind} has sessions: set --sessions and --turns "
                             "instead of --num-requests")
        spec["num_requests"] = args.wl_num_requests
    session_flags = [f for f, v in (("--turns", args.wl_turns),
                                    ("--message-len", args.wl_message_len),
                                    ("--think-time", args.wl_think_time)) if v is not None]
    if session_flags and sessions is None:
        raise ValueError(f"{', '.join(session_flags)} need sessions: add --sessions N")
    if sessions is not None:
        if args.wl_turns is not None:
            sessions["turns"] = args.wl_turns
        if args.wl_message_len is not None:
            sessions["message_len"] = args.wl_message_len
        if args.wl_think_time is not None:
            sessions["think_time_s"] = ({"dist": "exponential", "mean": args.wl_think_time}
                                        if args.wl_think_time > 0 else 0)
    if args.wl_input_len is not None:
        req["input_len"] = args.wl_input_len
    if args.wl_output_len is not None:
        req["output_len"] = args.wl_output_len
    if args.wl_shared_prefix is not None:
        groups, length = args.wl_shared_prefix
        req["shared_prefix"] = {"num_groups": groups, "length": length}

    rate, burst = args.wl_rate, args.wl_burstiness
    if rate is not None and math.isinf(rate):
        if burst is not None:
            raise ValueError("--burstiness needs a finite --rate (inf sends everything at once)")
        spec["arrivals"] = {"pattern": "all_at_once"}
    elif rate is not None or burst is not None:
        current = spec["arrivals"]
        rate = rate if rate is not None else current.get("rate")
        if rate is None:
            raise ValueError(f"--burstiness needs --rate (--kind {args.wl_kind} sends "
                             "everything at once)")
        if burst is None:
            burst = current.get("burstiness", 1.0)
        spec["arrivals"] = ({"pattern": "poisson", "rate": _number(rate)} if burst == 1.0 else
                            {"pattern": "gamma", "rate": _number(rate),
                             "burstiness": _number(burst)})

    if args.wl_no_tenants:
        spec.pop("tenants", None)
    if args.wl_tenants:
        spec["tenants"] = [{"name": n, "weight": _number(w)} for n, w in args.wl_tenants]
    if args.wl_no_priorities:
        spec.pop("priorities", None)
    if args.wl_priorities:
        spec["priorities"] = [{"priority": p, "weight": _number(w)}
                              for p, w in args.wl_priorities]
    spec.setdefault("seed", 0)
    order = ["name", "seed", "num_requests", "requests", "sessions", "tenants", "priorities",
             "arrivals"]
    return {k: spec[k] for k in order if k in spec}


def _flow(value: Any) -> str:
    """One value as inline YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2 ** 31)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _comment(text: str | None, indent: int) -> list[str]:
    if not text:
        return []
    pad = " " * indent
    return textwrap.wrap(text, width=96 - indent, initial_indent=pad + "# ",
                         subsequent_indent=pad + "# ")


def render_yaml(spec: dict[str, Any], header: list[str]) -> str:
    """The spec as YAML, each key preceded by its field description as a comment (so the
    comments are the schema's own documentation and cannot drift from it)."""
    from .workload_spec import RequestsSpec, SessionsSpec, WorkloadSpec

    nested = {"requests": RequestsSpec, "sessions": SessionsSpec}
    lines = [f"# {h}" if h else "#" for h in header]
    for key, value in spec.items():
        lines.append("")
        lines += _comment(WorkloadSpec.model_fields[key].description, 0)
        if key in nested and isinstance(value, dict):
            lines.append(f"{key}:")
            for sub, sub_value in value.items():
                lines += _comment(nested[key].model_fields[sub].description, 2)
                lines.append(f"  {sub}: {_flow(sub_value)}")
        else:
            lines.append(f"{key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def generate_yaml(args: argparse.Namespace, *, command: str = "corellm bench workload") -> str:
    """The commented YAML file for the flags, validated by loading and building it back."""
    from .workload import build_workload
    from .workload_spec import load_workload_spec

    spec = spec_dict_from_args(args)
    loaded = load_workload_spec(spec)
    target = args.wl_output or "FILE.yaml"
    header = [f"corellm bench workload (kind {args.wl_kind}), written by: {command}",
              f"summary: {build_workload(loaded, vocab_size=32000).description}",
              f"run it:  corellm bench --workload {target} --config A.yaml --config B.yaml",
              f"inspect: corellm bench workload --describe {target}",
              "", *DIST_HELP]
    text = render_yaml(spec, header)
    # The file must mean what was asked: load it back and compare with the spec it came from.
    again = load_workload_spec(yaml.safe_load(text))
    if again.model_dump() != loaded.model_dump():      # pragma: no cover - a bug here
        raise RuntimeError("the generated workload file does not load back to its spec")
    return text


# ----------------------------------------------------------------------------- describing
def _fmt_stats(stats: dict[str, float] | None, unit: str = "") -> str:
    if stats is None:
        return "-"

    def f(v: float) -> str:
        return f"{v:.3g}{unit}" if unit else (f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}")

    return (f"mean {f(stats['mean'])}  min {f(stats['min'])}  p50 {f(stats['p50'])}  "
            f"p90 {f(stats['p90'])}  max {f(stats['max'])}")


def _fmt_counts(counts: dict[Any, int], total: int) -> str:
    return ", ".join(f"{k}: {n} ({n / total:.0%})" for k, n in counts.items())


def describe_text(path: str, stats: dict[str, Any], description: str) -> str:
    """The ``--describe`` summary as aligned lines."""
    n = stats["requests"]
    rows = [("workload", f"{path}"), ("summary", description)]
    if stats["sessions"]:
        rows.append(("requests", f"{n} in {stats['sessions']} sessions ({stats['first_turns']} "
                                 f"first turns, {stats['follow_ups']} follow-ups)"))
    else:
        rows.append(("requests", str(n)))
    rows.append(("prompt tokens", _fmt_stats(stats["first_turn_prompt_tokens"])
                 + ("  (first turns)" if stats["follow_ups"] else "")))
    if stats["follow_ups"]:
        rows.append(("sent with history", _fmt_stats(stats["sent_prompt_tokens"])))
    rows.append(("output tokens", _fmt_stats(stats["output_tokens"])))
    rows.append(("tokens in total", f"{stats['sent_prompt_tokens']['sum']:.0f} prompt + "
                                    f"{stats['output_tokens']['sum']:.0f} output; longest "
                                    f"context {stats['max_context_tokens']}"))
    if stats["arrival_span_s"] > 0:
        arr = (f"{stats['first_turns']} first turns over {stats['arrival_span_s']:.2f} s "
               f"(mean gap {stats['mean_interarrival_s']:.3g} s, CV "
               f"{stats['interarrival_cv']:.2f})")
    else:
        arr = f"all {stats['first_turns']} first turns at once"
    rows.append(("arrivals", arr))
    if stats["think_time_s"]:
        rows.append(("think time", _fmt_stats(stats["think_time_s"], "s")))
    if stats["shared_prefix_groups"]:
        rows.append(("shared prefixes", _fmt_counts(stats["shared_prefix_groups"], n)))
    if stats["tenants"]:
        rows.append(("tenants", _fmt_counts(stats["tenants"], n)))
    rows.append(("priorities", _fmt_counts(stats["priorities"], n)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n"


def _describe(args: argparse.Namespace) -> int:
    from .workload import build_workload, workload_stats
    from .workload_spec import FilePrompts, load_workload_spec

    spec = load_workload_spec(args.wl_describe)
    # Which ids a prompt holds changes no statistic, so any vocabulary that admits the file's
    # own ids will do.
    vocab = 1 << 16
    prompts = spec.requests.prompts
    if isinstance(prompts, FilePrompts):
        vocab = max([vocab, *(max(line.ids) + 1 for line in prompts._lines if line.ids)])
    tokenizer = None
    if spec.needs_tokenizer:
        from corellm.engine.llm import load_tokenizer
        if args.wl_tokenizer:
            tokenizer = load_tokenizer(args.wl_tokenizer)
        else:
            from corellm.checkpoint.demo import default_model
            tokenizer = load_tokenizer(str(default_model()[0]))
        vocab = max(vocab, len(tokenizer))
    workload = build_workload(spec, vocab_size=vocab, seed=args.wl_seed, tokenizer=tokenizer)
    stats = workload_stats(workload)
    if args.wl_json:
        print(json.dumps({"workload": args.wl_describe, "description": workload.description,
                          **stats}, indent=2, default=str))
    else:
        sys.stdout.write(describe_text(args.wl_describe, stats, workload.description))
    return 0
