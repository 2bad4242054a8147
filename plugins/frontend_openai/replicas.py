"""The server's engine replicas: ``parallel.data_parallel_size`` copies of its engine, or the
arms of a live A/B split (``frontend.arms``), as ``corellm.engine.replicas.Arm``s. Each arm's
config is read and validated here, before anything starts: a problem is a ``ConfigError`` at
``frontend.arms.<name>``."""

from __future__ import annotations

import os
import re
from typing import Any

from corellm.engine.replicas import Arm
from corellm.errors import ConfigError, CorellmError

ARM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# What the server itself applies to a request before any arm sees it (its tokenizer, the
# context bound, the adapters it knows, the checks of the enabled logits processors).
SHARED = (("model", "tokenizer"), ("model", "max_model_len"), ("lora", None),
          ("logits_processors", None))


def check_replicas(config: Any, key: str, replicas: int) -> None:
    """What replicas of ``config`` cannot share: a fixed rendezvous port, a launcher's ranks, a
    Ray executor each replica's process would start a cluster of its own for (a core on the
    ray launcher runs in the cluster its server joined)."""
    if replicas <= 1:
        return
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 and parallel.init_method != "env://" \
            and not parallel.init_method.endswith(":0"):
        raise ConfigError([(f"{key}: parallel.init_method", f"{parallel.init_method}: "
                            f"{replicas} replicas would all take this port; leave the port 0 "
                            "(a free one each)")])
    if parallel.external_launcher:
        raise ConfigError([(f"{key}: parallel.init_method", "env:// (ranks a launcher such as "
                            "torchrun started) serves one engine; data-parallel replicas start "
                            "their own ranks")])
    if config.executor.name == "ray" and config.core_launcher.name != "ray" \
            and not getattr(config.executor, "address", None) \
            and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError([(f"{key}: executor.address", f"{replicas} replicas on the ray "
                            "executor need a running cluster to share (executor.address or "
                            "RAY_ADDRESS) or the ray core launcher "
                            "(--data-parallel-backend ray); each would start one of its own")])


def server_arms(options: Any, config: Any) -> list[Arm] | None:
    """The replicas to run, or None for one engine (no arms, ``data_parallel_size`` 1)."""
    if not options.arms:
        n = config.parallel.data_parallel_size
        check_replicas(config, "parallel.data_parallel_size", n)
        return [Arm("", config, n)] if n > 1 else None
    from corellm.config.schema import apply_overrides, read_config_file
    from corellm.engine.llm import build_config
    arms = []
    for name, arm in options.arms.items():
        key = f"frontend.arms.{name}"
        if not ARM_NAME.fullmatch(name):
            raise ConfigError([(key, "an arm's name is 1-64 letters, digits, '_', '.' or '-' "
                                     "(it goes into a response header and metric labels)")])
        try:
            data = read_config_file(arm.config) if arm.config else config.to_dict()
            data = apply_overrides(data, list(arm.set.items()))
            data.pop("frontend", None)     # the server's own frontend serves every arm
            arm_config, _ = build_config(data, None, ())
        except ConfigError as exc:
            raise ConfigError([(f"{key}.{'config' if arm.config else 'set'}: {path}", msg)
                               for path, msg in exc.problems]) from None
        except (CorellmError, OSError) as exc:
            raise ConfigError([(f"{key}.config", str(exc))]) from None
        if arm_config.model.path != config.model.path:
            raise ConfigError([(f"{key}.config", f"serves model {arm_config.model.path!r}, not "
                                f"the server's {config.model.path!r}: the arms of one server "
                                "answer for one model")])
        # The server tokenizes, bounds and checks each request once, for every arm.
        for section, field in SHARED:
            mine = getattr(getattr(arm_config, section), field) if field \
                else getattr(arm_config, section)
            theirs = getattr(getattr(config, section), field) if field \
                else getattr(config, section)
            if mine != theirs:
                where = f"{section}.{field}" if field else section
                raise ConfigError([(f"{key}: {where}", f"{mine!r} differs from the server's "
                                    f"{theirs!r}: the server reads every request once for all "
                                    "arms, so the arms must agree on it")])
        n = arm.replicas or arm_config.parallel.data_parallel_size
        check_replicas(arm_config, key, n)
        arms.append(Arm(name, arm_config, n, arm.weight))
    return arms
