"""The ``corellm`` command: generate, plugins, config validate / schema."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from corellm.errors import CorellmError


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML/TOML/JSON config file (default: the demo model)")


def cmd_generate(args: argparse.Namespace) -> int:
    from corellm.engine.llm import LLM
    from corellm.sampling_params import SamplingParams

    llm = LLM(args.config, model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["The meaning of life is"]
    show = not args.no_progress and (len(prompts) > 1 or sys.stderr.isatty())
    outputs = llm.generate(prompts, params, use_tqdm=show)
    for out in outputs:
        completion = out.outputs[0]
        if len(outputs) > 1:
            print(f"--- prompt: {out.prompt!r} (finish_reason={completion.finish_reason})")
        print(out.prompt + completion.text if args.echo else completion.text)
    if args.stats:
        print(llm.get_stats(), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from corellm.config import read_config_file
    from corellm.engine.llm import build_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    data = read_config_file(args.config) if args.config else {}
    frontend = dict(data.get("frontend") or {})
    for key in ("host", "port", "api_key", "served_model_name"):
        if getattr(args, key) is not None:
            frontend[key] = getattr(args, key)
    data["frontend"] = {"name": "openai", **frontend}
    config, registry = build_config(data, args.model, ())
    entry = registry.get("frontend", config.frontend.name)
    from corellm.components import BuildContext
    server = entry.spec.factory(config.frontend, BuildContext(config=config, registry=registry))
    server.run()
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from corellm.plugins import load_registry

    registry = load_registry()
    rows = []
    for section, table in sorted(registry.components.items()):
        for name, entry in sorted(table.items()):
            spec, info = entry.spec, entry.plugin
            options = [
                {"name": f, "type": _type_name(field.annotation),
                 "default": None if field.is_required() else field.get_default(call_default_factory=True),
                 "description": field.description or ""}
                for f, field in spec.options.model_fields.items() if f != "name"]
            row = {"kind": spec.kind, "name": name, "plugin": info.name,
                   "distribution": info.distribution, "version": info.version,
                   "summary": spec.summary, "options": options}
            if section == "model":
                row["architectures"] = list(spec.architectures)  # type: ignore[attr-defined]
            rows.append(row)
    broken = [{"plugin": b.info.name, "distribution": b.info.distribution,
               "version": b.info.version, "error": b.error} for b in registry.broken]
    if args.json:
        print(json.dumps({"components": rows, "broken": broken}, indent=2, default=str))
        return 0
    print(f"{'KIND':<18} {'NAME':<24} {'DISTRIBUTION':<24} SUMMARY (options indented)")
    for row in rows:
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else "in-process"
        print(f"{row['kind']:<18} {row['name']:<24} {dist:<24} {row['summary']}")
        if row.get("architectures"):
            print(f"{'':<20}architectures: {', '.join(row['architectures'])}")
        for opt in row["options"]:
            print(f"{'':<20}{opt['name']}: {opt['type']} = {opt['default']!r}"
                  + (f"  # {opt['description']}" if opt["description"] else ""))
    for b in registry.broken:
        print(f"BROKEN {b.describe()}")
    return 0


def _type_name(annotation: object) -> str:
    name = getattr(annotation, "__name__", None)
    return name if name and "[" not in str(annotation) else str(annotation).replace("typing.", "")


def cmd_config_validate(args: argparse.Namespace) -> int:
    from corellm.config import load_config

    config = load_config(args.file)
    print(f"{args.file}: OK")
    if args.show:
        import yaml
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from corellm.config import config_schema
    from corellm.plugins import load_registry

    print(json.dumps(config_schema(load_registry()), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corellm", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"corellm {__import__('corellm').__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline")
    _add_config_arg(gen)
    gen.add_argument("--model", "-m", help="checkpoint directory (overrides model.path)")
    gen.add_argument("--prompt", "-p", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.add_argument("--no-progress", action="store_true",
                     help="no progress bar (default: shown on a terminal or for several prompts)")
    gen.add_argument("--stats", action="store_true", help="print engine stats to stderr")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API (frontend section)")
    _add_config_arg(serve)
    serve.add_argument("--model", "-m", help="checkpoint directory (overrides model.path)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; frontend.host)")
    serve.add_argument("--port", type=int, help="port (default 8000, 0 = any free; frontend.port)")
    serve.add_argument("--api-key", dest="api_key",
                       help="require 'Authorization: Bearer KEY' on /v1 (also $CORELLM_API_KEY)")
    serve.add_argument("--served-model-name", dest="served_model_name",
                       help="model name clients use (default: the checkpoint directory's name)")
    serve.set_defaults(func=cmd_serve)

    from corellm.bench.cli import add_bench_subcommand
    add_bench_subcommand(sub)

    plugins = sub.add_parser("plugins", help="list discovered plugins and their options")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=cmd_plugins)

    config = sub.add_parser("config", help="validate a config file or print its schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    validate = config_sub.add_parser("validate", help="validate FILE against installed plugins")
    validate.add_argument("file")
    validate.add_argument("--show", action="store_true", help="print the resolved config")
    validate.set_defaults(func=cmd_config_validate)
    schema = config_sub.add_parser("schema", help="JSON schema for the installed plugin set")
    schema.set_defaults(func=cmd_config_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # This process is ours: let CPU workers tune the allocator (see corellm/worker/cpu.py).
    os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CorellmError as exc:
        print(f"corellm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
