"""What the ray executor and the ray core launcher share: joining the cluster (and leaving a
local one started here once its last user is done), the driver's environment for the actors,
the actors' niceness, and reading Ray's errors."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from corellm.errors import ConfigError
from corellm.worker.ranks import describe
from corellm_plugins.executor_ray import INSTALL_HINT

logger = logging.getLogger("corellm_plugins.executor_ray")

# corellm's actors are named in this Ray namespace (``corellm-tp-<id>-bundle<i>`` for ranks,
# ``corellm-core-<id>`` for engine cores): ``ray list actors`` tells whose they are.
ACTOR_NAMESPACE = "corellm"

_lock = threading.Lock()
_users = 0              # engines of this process using the cluster it joined or started
_started_here = False   # the cluster is a local one this process started (and will stop)
_linger: threading.Timer | None = None
_generation = 0         # of the linger timers: only the newest may stop the cluster
# A local cluster started here outlives its last engine this long (a replica restarting after
# its back-off, or the next LLM, finds it up), then stops; at exit Ray stops it anyway.
LOCAL_LINGER_S = 60.0


def ray_module(key: str) -> Any:
    """``import ray``, or the config error naming ``key`` and the install hint."""
    try:
        import ray
    except ImportError:
        raise ConfigError([(key, f"'ray' needs Ray, which is not installed "
                            f"({INSTALL_HINT})")]) from None
    return ray


def join(address: str | None, key: str, log_to_driver: bool = False) -> Any:
    """Connect this process to the cluster at ``address``, else ``$RAY_ADDRESS``, else keep
    the one it is connected to, else start a local one; count one more user of it (``leave``
    when done). ``key``: the option that named the address, for errors. Returns ``ray``.
    A local cluster left lingering here with no user gives way to a named ``address``."""
    global _users, _started_here
    ray = ray_module(key.rsplit(".", 1)[0] + ".name")
    address = address or os.environ.get("RAY_ADDRESS")
    if (address or "").startswith("ray://"):
        raise ConfigError([(key, f"{address!r}: a Ray Client connection cannot reach the "
                            "engine's actors through shared memory and links; run corellm on "
                            "a node of the cluster (address 'auto' or HOST:PORT)")])
    with _lock:
        _cancel_linger()
        if address and _started_here and not _users and ray.is_initialized():
            ray.shutdown()                 # the lingering local one: not the cluster asked for
            _started_here = False
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, configure_logging=False,
                     log_to_driver=log_to_driver)
            _started_here = address is None and _users == 0
            logger.info("ray: %s", f"joined {address}" if address
                        else "started a local cluster")
        _users += 1
    return ray


def started_here() -> bool:
    """Whether the cluster this process uses is a local one it started (no autoscaler)."""
    return _started_here


def leave() -> None:
    """One user fewer; ``LOCAL_LINGER_S`` after the last one, a local cluster this process
    started stops (unless a new user came)."""
    global _users, _linger, _generation
    with _lock:
        _users = max(0, _users - 1)
        if _users or not _started_here:
            return
        _cancel_linger()
        _generation += 1
        _linger = threading.Timer(LOCAL_LINGER_S, _stop_if_unused, args=(_generation,))
        _linger.daemon = True
        _linger.start()


def _cancel_linger() -> None:
    global _linger, _generation
    if _linger is not None:
        _linger.cancel()
        _linger = None
    _generation += 1           # a timer that fired already and waits for the lock: stale


def _stop_if_unused(generation: int) -> None:
    global _started_here
    with _lock:
        if generation != _generation or _users or not _started_here:
            return
        _started_here = False
        try:
            import ray
            if ray.is_initialized():
                ray.shutdown()
                logger.info("ray: stopped the local cluster (no engine used it for %.0f s)",
                            LOCAL_LINGER_S)
        except Exception as exc:
            logger.warning("ray: stopping the local cluster failed: %s", exc)


def driver_env(prefixes: list[str]) -> dict[str, str]:
    """This process's environment variables an actor gets: those named with one of
    ``prefixes``."""
    prefixes_ = tuple(prefixes)
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes_)}


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def match_niceness(target: int, what: str) -> None:
    """Run this actor (``what``: "this rank", "this engine core") at the engine's scheduling
    priority. Ray starts its workers at niceness 15, so beside any busy process an actor gets a
    sliver of a core and, as ranks wait for each other in every collective, the whole step
    slows down (measured: 14 ms of executor overhead a step instead of 0.6 ms,
    docs/scaling.md). Every thread of the process is set (on Linux a thread's niceness is its
    own); raising the priority needs CAP_SYS_NICE (or RLIMIT_NICE), and without it this says so
    once."""
    if not hasattr(os, "setpriority"):
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return
    if current == target:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), target)
    except (PermissionError, FileNotFoundError, ProcessLookupError) as exc:
        logger.warning("%s runs at niceness %d (Ray's) and could not take the engine's %d (%s): "
                       "beside busy processes its steps will slow down", what, current, target,
                       exc)


def ray_cause(exc: BaseException) -> str:
    """Ray's error, its first line (the actor's death, or the call's own exception)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return describe(cause)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
