"""Engine replicas behind one server: data parallelism, and A/B arms on live traffic.

``EngineGroup`` holds N ``AsyncLLM`` replicas, each an engine core of its own (its own process,
itself tensor-parallel if its config says so), grouped in arms (``arms``: name -> config,
replicas, weight; one arm without an A/B split). It offers what a server uses of an
``AsyncLLM``, so a frontend serves a group as it serves one engine:

* ``add_request`` asks the ``Router`` (corellm/serving/router.py) for the arm and the replica,
  submits there and returns that replica's stream, marked with ``stream.arm`` and
  ``stream.replica``; aborts go to the replica that holds the request;
* a replica that dies is routed around at once; the requests it held end with its error
  (``EngineDeadError``, as on one engine), and it is started again after a back-off
  (``restart``, at most ``max_restarts`` times in a row before it is given up); the group is
  dead (``wait_dead``) once no replica is up or starting;
* ``check_health`` answers while any replica does; ``replica_health`` tells each one's state;
* stats listeners and finished callbacks are attached to every replica (those given with
  ``add_replica_stats_listener`` / ``replica_finished_callbacks`` also learn which replica),
  restarted ones included.

Replicas on the CPU share the machine's cores: each gets its own slice of this process's
affinity mask (``parallel.cpu_affinity``) unless its config sets one, or its core launcher
places it elsewhere (``core_launcher: ray``: its actor claims CPUs of its own node). Replicas
on a platform with a device per rank get devices of their own (``parallel.device_ids``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corellm.engine.async_llm import AsyncLLM, RequestStream
from corellm.engine.ipc import EngineDeadError
from corellm.engine.output_processor import RequestOutputKind, RequestState
from corellm.outputs import StepStats
from corellm.serving.router import NoReplicaError, Router

logger = logging.getLogger("corellm.replicas")

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)

# Where the request being submitted was routed: a caller (a server's route) sets a dict here
# before it submits; ``EngineGroup`` fills in "arm" and "replica" as soon as it decides, so the
# answer names them even when the replica then refuses the request.
ROUTED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "corellm_routed", default=None)


class ReplicaUnavailableError(EngineDeadError):
    """No replica of the request's arm is up now (others may be): a server answers 503."""


@dataclass
class Arm:
    """An arm: its replicas' config, how many, and its share of the traffic."""

    name: str
    config: Any
    replicas: int = 1
    weight: float = 1.0


@dataclass(eq=False)
class Replica:
    index: int                 # across the whole group
    arm: str
    rank: int                  # within its arm
    config: Any
    engine: AsyncLLM | None = None
    state: str = "starting"    # starting | up | dead | failed (given up)
    outstanding: int = 0
    restarts: int = 0          # in a row, since it last served
    last_error: str | None = None
    requests: set[str] = field(default_factory=set)

    @property
    def up(self) -> bool:
        return self.state == "up" and self.engine is not None and not self.engine.is_dead

    @property
    def where(self) -> str | None:
        """Where its engine core runs (its pid; a Ray actor's node), once started."""
        return None if self.engine is None else self.engine.where

    @property
    def label(self) -> str:
        return f"replica {self.index} ({self.arm})" if self.arm else f"replica {self.index}"


def cpu_slices(arms: Sequence[Arm]) -> list[list[int] | None]:
    """Each replica's CPUs: this process's affinity mask cut in equal slices, for replicas whose
    platform shares its device between workers (the CPU), whose core runs on this machine and
    whose config sets none (else None)."""
    n = sum(a.replicas for a in arms)
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [None] * n
    per = max(1, len(cpus) // n)
    out: list[list[int] | None] = []
    i = 0
    for arm in arms:
        for _ in range(arm.replicas):
            if _placement(arm.config) == "cpus" and not arm.config.parallel.cpu_affinity \
                    and len(cpus) >= n:
                out.append(cpus[(i * per) % len(cpus):(i * per) % len(cpus) + per])
            else:
                out.append(None)
            i += 1
    return out


def device_slices(arms: Sequence[Arm]) -> list[list[int] | None]:
    """Each replica's devices (``parallel.device_ids``), for replicas on a platform with a
    device per rank whose core (and ranks) run on this machine: blocks of
    ``tensor_parallel_size`` of the devices this process sees, in order (replica 0 on the
    first ones), skipping those a config sets by hand (its replicas keep theirs). When they do
    not fit, none is given any (they share the devices, as before: the log says so). None for
    the others."""
    wanted: list[int | None] = []
    taken: set[int] = set()
    probe = None
    for arm in arms:
        for _ in range(arm.replicas):
            if _placement(arm.config) != "devices":
                wanted.append(None)
                continue
            probe = arm.config
            ids = arm.config.parallel.device_ids
            taken.update(ids or ())
            wanted.append(None if ids is not None else arm.config.parallel.tensor_parallel_size)
    need = sum(w or 0 for w in wanted)
    if not need:
        return [None] * len(wanted)
    count = _visible_devices(probe)
    free = [d for d in range(count if count is not None else need + len(taken))
            if d not in taken]
    if len(free) < need:
        logger.warning("the replicas need %d devices of their own and %d of the %s this process "
                       "sees are free (%d set by parallel.device_ids): they share the devices; "
                       "set parallel.device_ids per arm to place them", need, len(free),
                       count, len(taken))
        return [None] * len(wanted)
    out: list[list[int] | None] = []
    it = iter(free)
    for w in wanted:
        out.append(None if w is None else [next(it) for _ in range(w)])
    return out


def _visible_devices(config: Any) -> int | None:
    """How many devices of ``config``'s platform this process sees: its visible-devices
    variable's list when set, else the platform's count (None if it cannot say)."""
    from corellm.platforms import build_platform
    from corellm.plugins import load_registry
    try:
        registry = load_registry(disable=config.plugins.disable)
        var = registry.get("platform", config.platform.name).spec.visible_devices_env
        if var and var in os.environ:
            return len([d for d in os.environ[var].split(",") if d.strip()])
        return int(build_platform(config.platform, registry).device_count())
    except Exception:
        return None


def _placement(config: Any) -> str | None:
    """What replicas of ``config`` on this machine split between them: "cpus" (a platform that
    shares its device, the CPU's cores, between workers), "devices" (a device per rank, which
    the platform can hide from a process), or None (nothing: the core or its ranks run
    elsewhere, placed by a launcher or executor of their own, or the config is broken, which
    the replica's own start-up reports)."""
    from corellm.platforms import build_platform
    from corellm.plugins import load_registry
    try:
        registry = load_registry(disable=config.plugins.disable)
        launcher = registry.get("core_launcher", config.core_launcher.name).spec
        if not launcher.on_this_machine:
            return None
        if registry.get("platform", config.platform.name).spec.visible_devices_env:
            return None if config.executor.name == "ray" else "devices"
        platform = build_platform(config.platform, registry)
    except Exception:
        return None
    return "cpus" if platform.shares_devices else None


class _Outputs:
    """``output_processor`` as a server asks it: whether any replica has requests in flight."""

    def __init__(self, group: EngineGroup) -> None:
        self.group = group

    def has_unfinished_requests(self) -> bool:
        return any(r.engine is not None and r.engine.output_processor.has_unfinished_requests()
                   for r in self.group.replicas)


class EngineGroup:
    def __init__(self, arms: Sequence[Arm], *, affinity: bool = True, affinity_slack: int = 4,
                 restart: bool = True, max_restarts: int = 5,
                 start: Callable[[Any], Any] | None = None) -> None:
        self.arms = list(arms)
        self.router = Router({a.name: a.weight for a in self.arms}, affinity=affinity,
                             affinity_slack=affinity_slack)
        self.restart = restart
        self.max_restarts = max_restarts
        self._start = start or AsyncLLM.create
        slices, devices = cpu_slices(self.arms), device_slices(self.arms)
        self.replicas: list[Replica] = []
        for arm in self.arms:
            for rank in range(arm.replicas):
                config, i = arm.config, len(self.replicas)
                mine = {k: v for k, v in (("cpu_affinity", slices[i]),
                                          ("device_ids", devices[i])) if v is not None}
                if mine:
                    config = config.model_copy(update={
                        "parallel": config.parallel.model_copy(update=mine)})
                self.replicas.append(Replica(i, arm.name, rank, config))
        self.by_arm = {a.name: [r for r in self.replicas if r.arm == a.name] for a in self.arms}
        self.finished_callbacks: list[Callable[[list[RequestState]], None]] = []
        self.replica_finished_callbacks: list[Callable[[Replica, list[RequestState]], None]] = []
        self._stats_listeners: list[Callable[[StepStats], None]] = []
        self._replica_listeners: list[Callable[[Replica, StepStats], None]] = []
        self._where: dict[str, Replica] = {}
        self._ids = itertools.count()
        self._watchers: set[asyncio.Task] = set()
        self._closed = False
        self._rejecting: BaseException | None = None
        self.dead_error: EngineDeadError | None = None
        self._death: asyncio.Future[EngineDeadError] = asyncio.get_running_loop().create_future()
        self.output_processor = _Outputs(self)

    # ------------------------------------------------------------------ start and stop
    @classmethod
    async def create(cls, arms: Sequence[Arm], **kwargs: Any) -> EngineGroup:
        """Start every replica (together); any failing to start stops the others and raises."""
        self = cls(arms, **kwargs)
        results = await asyncio.gather(*(self._start(r.config) for r in self.replicas),
                                       return_exceptions=True)
        failed = [(r, e) for r, e in zip(self.replicas, results) if isinstance(e, BaseException)]
        for rep, engine in zip(self.replicas, results):
            if not isinstance(engine, BaseException):
                self._attach(rep, engine)
        if failed:
            await self.shutdown()
            rep, exc = failed[0]
            raise exc
        logger.info("%d engine replica(s) up: %s", len(self.replicas), ", ".join(
            f"{r.label} {r.where}" for r in self.replicas))
        return self

    def _attach(self, rep: Replica, engine: AsyncLLM) -> None:
        rep.engine, rep.state = engine, "up"
        for listener in self._stats_listeners:
            engine.add_stats_listener(listener)
        for listener in self._replica_listeners:
            engine.add_stats_listener(lambda stats, rep=rep, fn=listener: fn(rep, stats))
        engine.finished_callbacks.append(lambda states, rep=rep: self._finished(rep, states))
        task = asyncio.get_running_loop().create_task(self._watch(rep, engine),
                                                      name=f"corellm-{rep.label}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        watchers = list(self._watchers)
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*(r.engine.shutdown(timeout) for r in self.replicas
                               if r.engine is not None), return_exceptions=True)

    # ------------------------------------------------------------------ deaths and restarts
    async def _watch(self, rep: Replica, engine: AsyncLLM) -> None:
        err = await engine.wait_dead()
        if self._closed:
            return
        rep.state, rep.last_error = "dead", str(err)
        for rid in rep.requests:
            self._where.pop(rid, None)
        rep.requests.clear()
        rep.outstanding = 0
        logger.error("%s died (%s); its requests ended with the error, new ones go to the "
                     "other replicas", rep.label, err)
        with contextlib.suppress(Exception):
            await engine.shutdown(timeout=5.0)
        while self.restart and not self._closed and rep.restarts < self.max_restarts:
            delay = RESTART_BACKOFF_S[min(rep.restarts, len(RESTART_BACKOFF_S) - 1)]
            rep.state = "starting"
            await asyncio.sleep(delay)
            rep.restarts += 1
            try:
                new = await self._start(rep.config)
            except Exception as exc:
                rep.last_error = f"restart failed ({rep.restarts} in a row): {exc}"
                logger.error("%s: %s", rep.label, rep.last_error)
                continue
            if self._closed:
                await new.shutdown()
                return
            self._attach(rep, new)
            rep.restarts = 0            # failures in a row: it serves again
            logger.info("%s restarted (engine core %s)", rep.label, rep.where)
            return
        rep.state = "failed" if self.restart else "dead"
        if not any(r.state in ("up", "starting") for r in self.replicas):
            self.dead_error = EngineDeadError(f"every replica is dead; the last: {err}")
            if not self._death.done():
                self._death.set_result(self.dead_error)

    async def wait_dead(self) -> EngineDeadError:
        """Return once no replica is up or starting (never after a shutdown)."""
        return await asyncio.shield(self._death)

    # ------------------------------------------------------------------ AsyncLLM's face
    def _any(self) -> AsyncLLM:
        """The first replica's engine that is up, else the first there is."""
        for rep in self.replicas:
            if rep.up:
                return rep.engine
        for rep in self.replicas:
            if rep.engine is not None:
                return rep.engine
        raise EngineDeadError("no replica has started")

    @property
    def config(self) -> Any:
        return self.replicas[0].config

    @property
    def tokenizer(self) -> Any:
        return self._any().tokenizer

    @property
    def processor(self) -> Any:
        return self._any().processor

    @property
    def model_info(self) -> Any:
        return self._any().model_info

    @property
    def engine_pid(self) -> int:
        return self._any().engine_pid

    @property
    def is_dead(self) -> bool:
        return not any(r.up for r in self.replicas)

    @property
    def latest_stats(self) -> StepStats | None:
        return self._any().latest_stats

    def _route(self, rid: str, user: str | None, session_id: str | None) -> Replica:
        arm = self.router.arm_for(user, session_id, rid)      # rid: the client call's id
        routed = ROUTED.get()
        if routed is not None:
            routed.setdefault("arm", arm or None)
        reps = self.by_arm[arm]
        try:
            i = self.router.pick(arm, [r.outstanding for r in reps], [r.up for r in reps],
                                 session_id)
        except NoReplicaError as exc:
            states = ", ".join(f"{r.label}: {r.state}" for r in reps)
            raise ReplicaUnavailableError(f"{exc} ({states})") from None
        if routed is not None:
            routed.setdefault("replica", reps[i].index)
        return reps[i]

    async def add_request(self, prompt: Any, sampling_params: Any,
                          request_id: str | None = None, *, priority: int = 0,
                          user: str | None = None, session_id: str | None = None,
                          group_id: str | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                          params_checked: bool = False, lora_request: Any = None
                          ) -> RequestStream:
        """``AsyncLLM.add_request`` on the replica the router picks."""
        if self._rejecting is not None:
            raise self._rejecting
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        rep = self._route(group_id or rid, user, session_id)
        assert rep.engine is not None
        stream = await rep.engine.add_request(
            prompt, sampling_params, rid, priority=priority, user=user, session_id=session_id,
            group_id=group_id, output_kind=output_kind, params_checked=params_checked,
            lora_request=lora_request)
        rep.outstanding += 1
        rep.requests.add(rid)
        self._where[rid] = rep
        stream.arm, stream.replica = rep.arm, rep.index
        return stream

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str | None = None,
                       **kwargs: Any) -> AsyncIterator[Any]:
        stream = await self.add_request(prompt, sampling_params, request_id, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _finished(self, rep: Replica, states: list[RequestState]) -> None:
        for st in states:
            if self._where.get(st.request_id) is rep:
                del self._where[st.request_id]
                rep.requests.discard(st.request_id)
                rep.outstanding -= 1
        for callback in self.finished_callbacks:
            callback(states)
        for callback in self.replica_finished_callbacks:
            callback(rep, states)

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        rep = self._where.get(request_id)
        if rep is not None and rep.engine is not None:
            rep.engine.abort(request_id, reason)

    def abort_all(self, error: BaseException, reason: str) -> int:
        self._rejecting = error
        return sum(r.engine.abort_all(error, reason) for r in self.replicas
                   if r.engine is not None and not r.engine.is_dead)

    # ------------------------------------------------------------------ observability
    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """``listener`` gets every replica's records (restarted ones' too)."""
        self._stats_listeners.append(listener)
        for rep in self.replicas:
            if rep.engine is not None:
                rep.engine.add_stats_listener(listener)

    def add_replica_stats_listener(self, listener: Callable[[Replica, StepStats], None]) -> None:
        """``listener(replica, stats)`` for every replica's records."""
        self._replica_listeners.append(listener)
        for rep in self.replicas:
            if rep.engine is not None:
                rep.engine.add_stats_listener(lambda stats, rep=rep: listener(rep, stats))

    async def check_health(self, timeout: float = 5.0) -> None:
        """Return while any replica answers; else raise ``EngineDeadError`` naming each."""
        health = await self.replica_health(timeout)
        if not any(ok for _, ok, _ in health):
            raise EngineDeadError("no replica answers: " + "; ".join(
                f"{rep.label}: {why}" for rep, _, why in health))

    async def replica_health(self, timeout: float = 5.0) -> list[tuple[Replica, bool, str]]:
        """(replica, answers, why not) for each replica, pinged together."""
        async def one(rep: Replica) -> tuple[Replica, bool, str]:
            if not rep.up:
                return rep, False, f"{rep.state}" + (f" ({rep.last_error})"
                                                      if rep.last_error else "")
            try:
                await rep.engine.check_health(timeout)
            except Exception as exc:
                return rep, False, str(exc) or "its loop did not answer"
            return rep, True, ""
        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    async def get_stats(self, timeout: float = 10.0) -> Any:
        return await self._any().get_stats(timeout)

    async def reset_prefix_cache(self) -> bool:
        results = await asyncio.gather(*(r.engine.reset_prefix_cache() for r in self.replicas
                                         if r.up), return_exceptions=True)
        return all(r is True for r in results)
