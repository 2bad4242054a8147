"""What ``corellm serve`` reads from its command line beyond the engine flags: vLLM's
``--lora-modules``, and the arms of a live A/B split (``--config a=A.yaml --config b=B.yaml
--split a=50,b=50``)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from corellm.errors import ConfigError


def _lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's ``--lora-modules`` values: ``name=path``, or JSON ``{"name": ..., "path": ...}``."""
    import json

    modules: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError([("lora.modules", f"--lora-modules {item!r}: expected "
                                                    '{"name": ..., "path": ...}')]) from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError([("lora.modules", f"--lora-modules {item!r}: expected "
                                                    "NAME=PATH")])
        modules[name] = path
    return modules


def _serve_arms(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--config a=A.yaml --config b=B.yaml [--split a=50,b=50]``: the ``frontend.arms`` of a
    live A/B split (each arm's file, with this command's engine flags and --set over it), and
    ``args.config`` set to the first arm's file, the server's own config. None without arms."""
    given = args.config or []
    named = [c for c in given if re.match(r"[A-Za-z0-9_.-]+=", c)]
    if not named:
        if len(given) > 1:
            raise ConfigError([("--config", "given more than once: name each file as an arm "
                                "(--config a=A.yaml --config b=B.yaml) for an A/B split")])
        if args.split:
            raise ConfigError([("--split", "needs arms: --config a=A.yaml --config b=B.yaml")])
        args.config = given[0] if given else None
        return None
    if len(named) != len(given):
        raise ConfigError([("--config", "name every file as an arm (ARM=FILE), or give one "
                                        "file without a name")])
    arms: dict[str, Any] = {}
    for item in named:
        name, _, path = item.partition("=")
        if name in arms:
            raise ConfigError([("--config", f"arm {name!r} given twice")])
        arms[name] = {"config": path}
    if args.split:
        for part in args.split.split(","):
            name, sep, weight = part.partition("=")
            name = name.strip()
            if name not in arms or not sep:
                raise ConfigError([("--split", f"{part!r}: expected ARM=WEIGHT with ARM one of "
                                               f"{', '.join(arms)}")])
            if "weight" in arms[name]:
                raise ConfigError([("--split", f"arm {name!r} given twice")])
            try:
                arms[name]["weight"] = float(weight)
            except ValueError:
                raise ConfigError([("--split", f"{part!r}: the weight is not a number")]) \
                    from None
        missing = [name for name, arm in arms.items() if "weight" not in arm]
        if missing:
            raise ConfigError([("--split", f"gives no weight to {', '.join(missing)}: give "
                                           "every arm its weight")])
    args.config = next(iter(arms.values()))["config"]
    return arms
