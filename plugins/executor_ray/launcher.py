"""The ray core launcher: each engine core (a data-parallel replica, or the one engine of a
server or ``AsyncLLM``) as a Ray actor, anywhere in a Ray cluster. vLLM's
``--data-parallel-backend ray``.

Start-up:

1. ``bind`` (on the client's thread): the client's two sockets are bound on this node's address,
   at free ports, as CURVE servers that admit one key: the one made for this core (ZeroMQ's
   authentication, with a ZAP domain, so that without the authenticator nobody gets in; the
   traffic is encrypted too). The core's keys travel in the actor call, through Ray.
   Before that, the first ``bind`` joins the cluster (``core_launcher.address``, else
   ``$RAY_ADDRESS``, else the one this process is connected to, else a local one, stopped a
   while after its last engine is), whose address for this node is the one to bind.
2. ``start``: refuse at once what a local cluster cannot hold (a joined one may grow: an
   autoscaler; it is told in the log and waited for, up to ``start_timeout_s``).
3. Create a ``CoreActor`` (``corellm-core-<id>`` in the ``corellm`` namespace) with
   ``cpus_per_replica`` CPUs and ``gpus_per_replica`` GPUs (Ray gives it its own GPUs:
   ``CUDA_VISIBLE_DEVICES``), ``SPREAD`` over the nodes by default, with the driver's
   environment variables (``env_prefixes``); it builds the engine there and connects back.
4. Call its ``run`` (the engine's loop) and keep the call: its end, a return or Ray's error
   for a dead actor or node, is the core's end (``watch``).

A start that fails or is cancelled (``kill`` from another thread) gives back all it took: the
actor, the authenticator, its use of the cluster.

Stop: SHUTDOWN through the socket, the ``run`` call waited for, then the actor killed. The
actor is owned by this process: if the process dies, Ray kills it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from corellm.engine.core_process import STOP_TIMEOUT_S, CoreLauncher
from corellm.engine.ipc import EngineStartupError
from corellm.interfaces import ModelInfo
from corellm_plugins.executor_ray import cluster
from corellm_plugins.executor_ray.cluster import ACTOR_NAMESPACE, ray_cause
from corellm_plugins.executor_ray.core_actor import CoreActor

logger = logging.getLogger(__name__)

# The ZeroMQ authentication domain of the client sockets.
ZAP_DOMAIN = "corellm"

_MODEL_INFO = ("vocab_size", "max_model_len", "architecture", "lora_targets")


class _OneKey:
    """ZeroMQ's authentication callback: only the core's public key gets in."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class RayCoreLauncher(CoreLauncher):
    def __init__(self, options: Any, config: Any) -> None:
        self.options = options
        self.config = config
        self.ctx = zmq.Context()
        self.name = f"corellm-core-{uuid.uuid4().hex[:8]}"
        self.actor: Any = None
        self.info: dict[str, Any] = {}
        self.addrs: dict[str, str] = {}
        self._run: Any = None
        self._auth: Any = None
        self._joined = False
        self._killed = False
        self._lock = threading.Lock()
        # The client sockets' keys (CURVE) and the one client key they admit: the core's.
        self.server_key, self._server_secret = zmq.curve_keypair()
        self._core_public, self._core_secret = zmq.curve_keypair()

    @property
    def where(self) -> str:
        info = self.info
        if not info:
            return f"Ray actor {self.name}"
        return (f"Ray actor {self.name}, pid {info['pid']}, node {info['ip']} "
                f"({info['node_id'][:8]})")

    def bind(self, sock: zmq.Socket, which: str) -> None:
        """On the caller's thread, before ``start``: join the cluster (the first time), then a
        CURVE server admitting only the core's key, bound on this node's address in the
        cluster (Ray's, once joined) at a free port."""
        if not self._joined:
            opts = self.options
            cluster.join(opts.address, "core_launcher.address", opts.log_to_driver)
            with self._lock:
                self._joined = True
                self._check_cancelled()
        import ray
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self.ctx, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                                credentials_provider=_OneKey(self._core_public))
        sock.curve_server = True
        sock.curve_publickey = self.server_key
        sock.curve_secretkey = self._server_secret
        # Enforced: the handshake needs the authenticator's yes; without it (stopped, say)
        # nobody gets in, rather than anyone with the server's key.
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.bind(f"tcp://{ray.util.get_node_ip_address()}:*")
        self.addrs[which] = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---------------------------------------------------------------- start-up
    def _resources(self) -> tuple[float, float, int]:
        """(CPUs, GPUs) the actor reserves, and CPUs it claims on its node (0: none)."""
        from corellm.platforms import build_platform
        from corellm.plugins import load_registry
        opts, config = self.options, self.config
        platform = build_platform(config.platform, load_registry(disable=config.plugins.disable))
        gpus = opts.gpus_per_replica
        if gpus is None:
            # The core's own devices, where its executor runs its ranks in its process tree
            # (a ray executor's ranks reserve theirs).
            gpus = 0.0 if platform.shares_devices or config.executor.name == "ray" \
                else float(config.parallel.tensor_parallel_size)
        claim = max(1, int(opts.cpus_per_replica)) \
            if platform.shares_devices and opts.pin_cpus else 0
        return float(opts.cpus_per_replica), float(gpus), claim

    def _check_cancelled(self) -> None:
        if self._killed:
            raise EngineStartupError("engine core start-up was cancelled")

    def start(self, config: Any, max_outputs_ahead: int | None = None) -> ModelInfo:
        try:
            return self._start(config, max_outputs_ahead)
        except BaseException:
            self.kill()          # whatever it had: the actor, the authenticator, the cluster
            raise

    def _start(self, config: Any, max_outputs_ahead: int | None) -> ModelInfo:
        import ray
        opts = self.options
        self._check_cancelled()
        cpus, gpus, claim = self._resources()
        have = ray.cluster_resources()
        wants = {"CPU": cpus, "GPU": gpus, **opts.resources}
        short = {k: v for k, v in wants.items() if v and have.get(k, 0.0) < v}
        if short:
            why = (f"the Ray cluster cannot hold an engine core: it needs {short} "
                   f"(core_launcher.cpus_per_replica, gpus_per_replica, resources) and the "
                   f"cluster has {have} in all")
            if cluster.started_here():         # a local cluster: nothing will be added
                raise EngineStartupError(why)
            logger.warning("%s; waiting up to %g s (core_launcher.start_timeout_s) for it to "
                           "grow (an autoscaler)", why, opts.start_timeout_s)
        env = cluster.driver_env(opts.env_prefixes)
        with self._lock:
            self._check_cancelled()
            actor = self.actor = ray.remote(CoreActor).options(
                name=self.name, namespace=ACTOR_NAMESPACE, num_cpus=cpus, num_gpus=gpus,
                resources=dict(opts.resources) or None, max_restarts=0,
                scheduling_strategy=opts.scheduling_strategy,
                runtime_env={"env_vars": env} if env else None).remote()
        call = actor.start.remote(
            config, self.addrs["input"], self.addrs["output"],
            (self.server_key, self._core_public, self._core_secret), max_outputs_ahead,
            cluster.niceness(), logging.getLogger("corellm").getEffectiveLevel(), claim)
        deadline = time.monotonic() + opts.start_timeout_s
        while not ray.wait([call], timeout=0.2)[0]:
            self._check_cancelled()
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"engine core ({self.where}) not ready after {opts.start_timeout_s:g} s "
                    f"(core_launcher.start_timeout_s); the cluster has "
                    f"{ray.cluster_resources()} in all, {ray.available_resources()} free, and "
                    f"it asked for {cpus:g} CPU(s), {gpus:g} GPU(s)")
        try:
            self.info = ray.get(call)
        except Exception as exc:
            raise EngineStartupError(f"engine core ({self.where}) failed to start: "
                                     f"{ray_cause(exc)}") from None
        with self._lock:
            self._check_cancelled()
            self.pid = self.info["pid"]
            self._run = actor.run.remote()
        logger.info("engine core started: %s%s", self.where,
                    f", CPUs {self.info['cpus']}" if self.info.get("cpus") else "")
        return ModelInfo(**{k: self.info[k] for k in _MODEL_INFO})

    # ---------------------------------------------------------------- life
    def _end(self, wait: float | None) -> str | None:
        """How the ``run`` call ended, in words, once it has (None while it runs)."""
        import ray
        try:
            if not ray.wait([self._run], timeout=wait)[0]:
                return None
            code = ray.get(self._run)
            return f"engine core ({self.where}) exited with code {code}"
        except Exception as exc:
            return f"engine core ({self.where}) died: {ray_cause(exc)}"

    def watch(self, on_death: Callable[[str], None]) -> None:
        def wait_for_end() -> None:
            why = None
            while why is None and not self._killed:
                why = self._end(1.0)
            if not self.closing:
                reason = self.dead_reason or why or f"engine core ({self.where}) was killed"
                logger.error("%s", reason)
                on_death(reason)
        threading.Thread(target=wait_for_end, daemon=True, name="corellm-core-watch").start()

    def stop(self, send_shutdown: Callable[[float], None] | None,
             timeout: float = STOP_TIMEOUT_S) -> None:
        t0 = time.monotonic()
        self.closing = True
        if self._run is not None and self._end(0) is None:
            if send_shutdown is not None and self.dead_reason is None:
                try:
                    send_shutdown(max(0.0, timeout))
                except Exception as exc:
                    logger.warning("could not send the shutdown request to the engine core "
                                   "(%s): %s", self.where, exc)
            if self._end(max(0.0, timeout - (time.monotonic() - t0))) is None:
                logger.warning("engine core (%s) did not stop within %.1f s of the shutdown "
                               "request; killing its actor", self.where, timeout)
            else:
                logger.info("engine core (%s) stopped in %.1f s", self.where,
                            time.monotonic() - t0)
        self.kill()

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            actor, self.actor = self.actor, None
            joined, self._joined = self._joined, False
            auth, self._auth = self._auth, None
        try:
            if actor is not None:
                try:
                    import ray
                    ray.kill(actor, no_restart=True)
                except Exception as exc:
                    logger.warning("could not kill the engine core's actor %s: %s", self.name,
                                   exc)
            if auth is not None:
                auth.stop()
        finally:
            if joined:
                cluster.leave()
