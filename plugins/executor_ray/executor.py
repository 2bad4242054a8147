"""The Ray executor: tensor-parallel ranks as Ray actors, one per bundle of a placement group.

Start-up (``_RayBackend.start``):

1. Join the Ray cluster: ``options.address``, else ``$RAY_ADDRESS``, else the one this process
   is connected to, else a local one (stopped 60 s after its last engine: cluster.py).
2. Reserve one bundle per rank (``cpus_per_rank`` CPUs, ``gpus_per_rank`` GPUs) in a placement
   group, ``PACK`` by default; a placement group named by ``placement_group``, or the one this
   process already runs in (a Ray task's or actor's), is used instead, and left as it was.
3. Start one ``RankActor`` per bundle, with the driver's environment variables
   (``env_prefixes``). Ranks are numbered driver's node first, then by node, so rank 0 sits
   beside the engine whenever a bundle does; the ``torch.distributed`` rendezvous is a free port
   on rank 0's node, each actor's device is the one Ray gave its bundle.
4. Each rank connects back to a TCP listener of the driver: one message link per rank, plus a
   doorbell link for a rank on the driver's node. Plans go to the driver's node through the
   shared-memory ring of the ``multiproc`` executor (one pickle, one copy whatever the ranks),
   its doorbell byte down the doorbell link; to other nodes over the message link. Rank 0's
   output comes back the same way. No step passes through Ray's object store: Ray places and
   watches the ranks, the links carry the steps.

Faults: the driver waits on rank 0's output, every message link and, each second, every
actor's ``serve`` call together. A rank that raises reports it on its link; a rank whose actor
or node dies closes its links and ends its call with Ray's error; either way the executor names
the rank, its node and the cause in an ``ExecutorError``, stops the other ranks and the engine
ends every unfinished request with the error (as the ``multiproc`` executor does). Stopping
kills every actor and removes the placement group it made: nothing is left in the cluster.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import threading
import time
import uuid
from typing import Any

from corellm.components import BuildContext
from corellm.config.setup import EngineSetup, resolve_setup
from corellm.errors import ConfigError
from corellm.interfaces import ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, build_platform
from corellm.platforms.distributed import check_tensor_parallel
from corellm.platforms.shm_ring import (RingClosed, RingReader, RingWriter, create_ring,
                                        unlink_ring)
from corellm.worker.ranks import RankBackend, RanksExecutor, describe
from corellm_plugins.executor_ray import channel, cluster
from corellm_plugins.executor_ray.cluster import ACTOR_NAMESPACE, ray_cause
from corellm_plugins.executor_ray.rank import RankActor

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0
# The ranks' actors are named ``corellm-tp-<id>-bundle<i>`` in cluster.ACTOR_NAMESPACE (and
# their placement group ``corellm-tp-<id>``).


def _ray() -> Any:
    return cluster.ray_module("executor.name")


class RayExecutor(RanksExecutor):
    """The step protocol is ``RanksExecutor``'s (corellm/worker/ranks.py); the ranks are Ray
    actors (``_RayBackend``)."""

    name = "ray"

    def __init__(self, options: Any, ctx: BuildContext) -> None:
        config = ctx.config
        self.config = config
        self.options = options
        self.tp_size = config.parallel.tensor_parallel_size
        if config.parallel.external_launcher:
            raise ConfigError([("parallel.init_method", "env:// is for ranks a launcher such as "
                                "torchrun starts; the ray executor starts its own (leave "
                                "init_method at its default)")])
        setup = ctx.setup or resolve_setup(config, ctx.registry)
        platform = build_platform(config.platform, ctx.registry)
        # The ranks' devices are the cluster's, not this machine's: only the model is checked
        # here; Ray refuses bundles the cluster cannot hold.
        check_tensor_parallel(setup.arch, self.tp_size, None, setup.source)
        wanted = config.scheduler.async_scheduling
        super().__init__(_RayBackend(config, options, setup, platform),
                         platform.async_scheduling if wanted is None else wanted)

    @property
    def actors(self) -> list[Any]:
        """The ranks' actor handles, in rank order."""
        return list(self._impl.actors)


class _RayBackend(RankBackend):
    def __init__(self, config: Any, options: Any, setup: EngineSetup,
                 platform: Platform) -> None:
        super().__init__(config, options, setup, platform)
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.refs: list[Any] = []              # each rank's serve() call
        self.links: list[socket.socket | None] = []
        self.bells: list[socket.socket | None] = []
        self.local: list[int] = []             # ranks on the driver's node
        self.pg: Any = None
        self._own_pg = False
        self._joined = False
        self.plan_spec = self.out_spec = None
        self.writer: RingWriter | None = None
        self.reader: RingReader | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self.token = b""

    # ---------------------------------------------------------------- start-up
    def _init_ray(self) -> Any:
        ray = cluster.join(self.options.address, "executor.address", self.options.log_to_driver)
        self._joined = True
        return ray

    def _bundle(self, ray: Any) -> dict[str, float]:
        gpus = self.options.gpus_per_rank
        if gpus is None:
            # A rank per GPU where the engine's platform has a device per worker, or where the
            # cluster has GPUs and the config does not ask for the CPU (a CPU-only head node).
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            gpus = 1.0 if not self.platform.shares_devices or (
                has_gpus and self.config.platform.name != "cpu") else 0.0
        bundle = {"CPU": float(self.options.cpus_per_rank)}
        if gpus:
            bundle["GPU"] = float(gpus)
        return bundle

    def _placement_group(self, ray: Any, bundle: dict[str, float]) -> Any:
        from ray.util.placement_group import (get_current_placement_group,
                                              placement_group)
        current = get_current_placement_group()
        if self.options.placement_group is not None:
            from ray.util import get_placement_group
            try:
                current = get_placement_group(self.options.placement_group)
            except ValueError:
                raise ConfigError([("executor.placement_group", f"no placement group named "
                                    f"{self.options.placement_group!r} in the Ray cluster")]) \
                    from None
        if current is not None:
            if len(current.bundle_specs) < self.tp:
                raise ExecutorError(f"this process's placement group has "
                                    f"{len(current.bundle_specs)} bundle(s), fewer than the "
                                    f"{self.tp} tensor-parallel ranks")
            for i, spec in enumerate(current.bundle_specs[:self.tp]):
                short = {k: v for k, v in bundle.items() if spec.get(k, 0.0) < v}
                if short:       # the rank's actor would wait for them until start_timeout_s
                    raise ExecutorError(
                        f"bundle {i} of the placement group ({spec}) cannot hold a rank, which "
                        f"needs {bundle} (executor.cpus_per_rank, executor.gpus_per_rank)")
            return current
        pg = placement_group([dict(bundle) for _ in range(self.tp)],
                             strategy=self.options.placement_strategy,
                             name=self.name)
        self._own_pg = True
        self.pg = pg
        ready, _ = ray.wait([pg.ready()], timeout=self.options.start_timeout_s)
        if not ready:
            raise ExecutorError(
                f"Ray could not place {self.tp} bundle(s) of {bundle} "
                f"({self.options.placement_strategy}) within {self.options.start_timeout_s:g} "
                f"s; the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free")
        return pg

    def start(self) -> ModelInfo:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        opts = self.options
        ray = self._init_ray()
        bundle = self._bundle(ray)
        self.name = f"corellm-tp-{uuid.uuid4().hex[:8]}"
        pg = self.pg = self._placement_group(ray, bundle)
        remote = ray.remote(RankActor)
        env = cluster.driver_env(self.options.env_prefixes)
        actors = [remote.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            name=f"{self.name}-bundle{i}", namespace=ACTOR_NAMESPACE,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i,
                placement_group_capture_child_tasks=True)).remote() for i in range(self.tp)]
        self.actors = actors
        infos = self._get([a.node_info.remote() for a in actors], "report its node")
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(self.tp), key=lambda i: (infos[i]["node_id"] != here,
                                                      infos[i]["node_id"], i))
        self.actors = [actors[i] for i in order]
        self.nodes = [{**infos[i], "actor": f"{self.name}-bundle{i}"} for i in order]
        self.local = [r for r in range(self.tp) if self.nodes[r]["node_id"] == here]
        ip0 = self.nodes[0]["ip"]
        init = f"tcp://{ip0}:{self._get([self.actors[0].free_port.remote(ip0)], 'rendezvous')[0]}"
        # The channel: a listener the ranks connect back to.
        driver_ip = ray.util.get_node_ip_address()
        listener = socket.create_server((driver_ip, 0), backlog=2 * self.tp)
        self.token = secrets.token_bytes(channel.TOKEN_BYTES)     # only our ranks get in
        try:
            if self.local:
                self.plan_spec = create_ring(len(self.local), opts.ring_slots,
                                             opts.ring_slot_bytes)
                if 0 in self.local:
                    self.out_spec = create_ring(1, opts.ring_slots, opts.ring_slot_bytes)
            shares = self.platform.shares_devices
            niceness = cluster.niceness()
            for rank, actor in enumerate(self.actors):
                node = self.nodes[rank]["node_id"]
                peers = [r for r in range(self.tp) if self.nodes[r]["node_id"] == node]
                ring = None
                if rank in self.local:
                    ring = {"plan": self.plan_spec, "reader": self.local.index(rank),
                            "out": self.out_spec}
                threads = max(1, int(bundle["CPU"])) if shares else 1
                # A rank with a device of its own sees just that one (Ray sets
                # CUDA_VISIBLE_DEVICES for its bundle): its index there is 0.
                local_rank = peers.index(rank) if shares or not bundle.get("GPU") else 0
                self.refs.append(actor.serve.remote(
                    rank, self.config, self.setup, init, listener.getsockname()[:2], ring,
                    threads, local_rank, len(peers), opts.start_timeout_s, niceness,
                    self.token))
            self._accept(listener)
            if self.local:
                self.writer = RingWriter(self.plan_spec, [self.bells[r] for r in self.local],
                                         alive=self._alive)
                for r in self.local:
                    self.bells[r].setblocking(False)
                if self.out_spec is not None:
                    self.reader = RingReader(self.out_spec, 0, self.bells[0])
            infos = self._gather(opts.start_timeout_s, "start")
        finally:
            listener.close()
            for spec in (self.plan_spec, self.out_spec):
                if spec is not None:     # mapped by every rank that will (or failed): unlink
                    unlink_ring(spec)
        logger.info("ray executor: %d rank(s) on node(s) %s", self.tp,
                    ", ".join(f"{n['ip']}" for n in self.nodes))
        return infos[0]

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        ray = _ray()
        try:
            return ray.get(refs, timeout=self.options.start_timeout_s)
        except Exception as exc:
            raise ExecutorError(f"a tensor-parallel rank's Ray actor failed to {what}: "
                                f"{describe(exc)}") from None

    def _accept(self, listener: socket.socket) -> None:
        """The ranks' links, as they connect (watching their calls for an early failure)."""
        self.links = [None] * self.tp
        self.bells = [None] * self.tp
        want = self.tp + len(self.local)
        deadline = time.monotonic() + self.options.start_timeout_s
        got = 0
        while got < want:
            ready, _, _ = select.select([listener], [], [], 1.0)
            if not ready:
                self._alive()
                if time.monotonic() > deadline:
                    raise ExecutorError(f"tensor-parallel ranks did not connect within "
                                        f"{self.options.start_timeout_s:g} s")
                continue
            sock, peer = listener.accept()
            hello = channel.hello(sock, self.token, self.tp)
            if hello is None:
                logger.warning("ray executor: refused a connection from %s that is not one of "
                               "its ranks", peer)
                sock.close()
                continue
            kind, rank = hello
            table = self.links if kind == "link" else self.bells
            if table[rank] is not None:
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            table[rank] = sock
            got += 1

    # ---------------------------------------------------------------- watching
    def _where(self, rank: int) -> str:
        node = self.nodes[rank] if rank < len(self.nodes) else {}
        return (f"tensor-parallel rank {rank} (Ray actor {node.get('actor')}, pid "
                f"{node.get('pid')} on node {node.get('ip')})")

    def _death(self, rank: int, wait: float = 5.0) -> ExecutorError:
        """Why rank ``rank``'s call ended (or its link closed)."""
        link = self.links[rank] if rank < len(self.links) else None
        try:                                        # it may have said why before going
            if link is not None and select.select([link], [], [], 0)[0]:
                msg = channel.recv(link)
                if msg[0] == "error":
                    if msg[3] is not None:
                        raise msg[3]
                    return ExecutorError(f"{self._where(rank)} failed: {msg[1]}\n{msg[2]}")
        except (ConnectionError, OSError, EOFError):
            pass
        ended = self._call_end(rank, wait)
        if ended is None:
            return ExecutorError(f"{self._where(rank)} closed its link to the engine")
        return ended or ExecutorError(f"{self._where(rank)} stopped unasked")

    def _call_end(self, rank: int, wait: float) -> ExecutorError | bool | None:
        """How rank ``rank``'s actor call ended within ``wait`` seconds: Ray's error as an
        ``ExecutorError`` (the actor or its node died), False (it returned), None (it runs)."""
        ray = _ray()
        ready, _ = ray.wait([self.refs[rank]], timeout=wait)
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except Exception as exc:
            return ExecutorError(f"{self._where(rank)} died: {ray_cause(exc)}")
        return False

    def _alive(self) -> None:
        """Raise the failure of any rank whose call has ended."""
        if not self.refs:
            return
        ray = _ray()
        done, _ = ray.wait(list(self.refs), num_returns=1, timeout=0)
        if done:
            raise self._death(self.refs.index(done[0]), wait=0)

    def _message(self, rank: int) -> tuple:
        link = self.links[rank]
        assert link is not None
        try:
            msg = channel.recv(link)
        except (ConnectionError, OSError, EOFError):
            raise self._death(rank) from None
        if msg[0] == "error":
            if msg[3] is not None:          # a config or checkpoint problem: the user's to fix
                raise msg[3]
            # A rank's collective fails when a peer dies: the death, if one follows, is the
            # cause to report.
            ray = _ray()
            others = [ref for r, ref in enumerate(self.refs) if r != rank]
            done, _ = ray.wait(others, num_returns=1, timeout=0.5) if others else ([], [])
            if done:
                ended = self._call_end(self.refs.index(done[0]), 0)
                if ended:
                    raise ended
            raise ExecutorError(f"{self._where(rank)} failed: {msg[1]}\n{msg[2]}")
        return msg

    def _gather(self, timeout: float | None, what: str) -> list[Any]:
        """One reply from each rank's link, in rank order, watching every rank."""
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(results) < self.tp:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = [r for r in range(self.tp) if r not in results]
                raise ExecutorError(f"tensor-parallel rank(s) {missing} did not answer {what} "
                                    f"within {timeout:.0f} s")
            waiting = {self.links[r]: r for r in range(self.tp) if r not in results}
            ready, _, _ = select.select(list(waiting), [], [], min(1.0, left or 1.0))
            if not ready:
                self._alive()
            for sock in ready:
                rank = waiting[sock]
                results[rank] = self._message(rank)[1]
        return [results[r] for r in range(self.tp)]

    # ---------------------------------------------------------------- calls
    def _send(self, msg: tuple) -> None:
        if self._stopped:
            raise ExecutorError("the ray executor's ranks are stopped")
        remote = [r for r in range(self.tp) if r not in self.local]
        try:
            if self.writer is not None:
                self.writer.write(msg)
            if remote:
                import pickle
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
                for r in remote:
                    channel.send_bytes(self.links[r], data)
        except (RingClosed, ConnectionError, OSError) as exc:
            self._alive()
            raise ExecutorError(f"a tensor-parallel rank is gone ({describe(exc)})") from None

    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list:
        with self._lock:
            self._send(("rpc", method, args, kwargs, None))
            return self._gather(timeout, f"{method}()")

    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None:
        self._send(("step", plan, prev))

    def recv_output(self) -> ModelRunnerOutput:
        reader = self.reader
        links = {self.links[r]: r for r in range(self.tp)}
        if reader is not None:
            bell = reader.doorbell
            while not reader.poll():
                ready, _, _ = select.select([bell, *links], [], [], 1.0)
                if not ready:
                    self._alive()
                for sock in ready:
                    if sock is not bell:
                        self._message(links[sock])         # only failures come unasked
                if bell in ready:
                    try:
                        reader.wait(0)                     # drains the doorbell
                    except RingClosed:
                        raise self._death(0) from None
            # The first chunk is there; a message of several slots follows as rank 0 writes.
            return reader.read(idle=self._alive)
        while True:                    # rank 0 on another node: its output on its link
            ready, _, _ = select.select(list(links), [], [], 1.0)
            if not ready:
                self._alive()
            for sock in ready:
                msg = self._message(links[sock])
                if msg[0] == "out":
                    return msg[1]

    # ---------------------------------------------------------------- stop
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            import ray
        except ImportError:
            return
        if self.refs:
            try:
                self._stopped = False
                self._send(("stop",))
            except Exception:
                pass
            self._stopped = True
            try:
                ray.wait(list(self.refs), num_returns=len(self.refs), timeout=_STOP_GRACE_S)
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for sock in [*self.links, *self.bells]:
            if sock is not None:
                sock.close()
        for end in (self.writer, self.reader):
            if end is not None:
                end.close()
        for spec in (self.plan_spec, self.out_spec):
            if spec is not None:
                unlink_ring(spec)
        if self.pg is not None and self._own_pg:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:
                pass
        if self._joined:
            self._joined = False
            cluster.leave()
