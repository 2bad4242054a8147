"""An engine core as a Ray actor (``CoreActor``, made remote by the ray core launcher).

``start`` builds the engine where Ray placed the actor (the plugins load there), connects its
loop to the client's two sockets (ZeroMQ over TCP, CURVE-authenticated with the keys the
launcher gave it: the client takes no other peer) and reports its model; ``run`` is the loop,
until the client's SHUTDOWN. The loop is ``corellm.engine.core_proc``'s, as in the ``mp``
launcher's process. The actor dies with its owner (Ray's fate sharing): a core never outlives
the server that started it.

On the CPU the core takes CPUs of its node to itself (``claim_cpus``): as many as its Ray
reservation, not claimed by another engine core on the node, so that two replicas on one node
do not fight over the same cores (the ``mp`` launcher's replicas get slices of the server's
CPUs for the same reason).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("corellm_plugins.executor_ray.launcher")

# Lock files of the CPUs engine cores claimed, one per CPU, on each node (flock: a claim ends
# with the process that holds it, however it ends).
CLAIMS_DIR = Path(tempfile.gettempdir()) / f"corellm-cpu-claims-{os.getuid()}"


def claim_cpus(count: int, claims_dir: Path = CLAIMS_DIR) -> tuple[list[int], list[int]]:
    """Claim ``count`` CPUs of this process's affinity mask that no other process holds:
    (the CPUs, the open lock files that hold them). Fewer than ``count`` free: none."""
    claims_dir.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    fds: list[int] = []
    for cpu in sorted(os.sched_getaffinity(0)):
        if len(got) == count:
            break
        fd = os.open(claims_dir / f"cpu{cpu}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        got.append(cpu)
        fds.append(fd)
    if len(got) < count:
        for fd in fds:
            os.close(fd)
        return [], []
    return got, fds


def _pin_all_threads(cpus: list[int]) -> bool:
    """This process's threads (Ray's own included) and those started later, on ``cpus``;
    False (and nothing changed) when this thread cannot be (CPUs this node does not have)."""
    try:
        os.sched_setaffinity(0, cpus)        # the engine's threads start from this one
    except OSError as exc:
        logger.warning("engine core: cannot run on CPUs %s of this node (%s); running on all "
                       "of its CPUs", cpus, exc)
        return False
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:                      # a thread that ended meanwhile
            pass
    return True


class CoreActor:
    """One engine core. Created by the ray core launcher."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.proc: Any = None
        self._claims: list[int] = []

    def node_info(self) -> dict[str, Any]:
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def start(self, config: Any, input_addr: str, output_addr: str, keys: tuple[bytes, ...],
              max_outputs_ahead: int | None, niceness: int, log_level: int,
              claim: int) -> dict[str, Any]:
        """Build the engine and connect it; ``claim``: CPUs to take on this node (0: none)."""
        import zmq

        from corellm.engine.core_proc import build_engine_core, ready_info
        from corellm.engine.logs import configure_logging
        from corellm_plugins.executor_ray.cluster import match_niceness
        configure_logging(level=log_level)
        match_niceness(niceness, "this engine core")
        cpus = list(config.parallel.cpu_affinity or [])
        if claim and not cpus:
            cpus, self._claims = claim_cpus(claim)
            if not cpus:
                logger.warning("engine core: fewer than %d CPU(s) of this node are free of "
                               "other engine cores; running on all of its CPUs", claim)
        if cpus and not _pin_all_threads(cpus):
            cpus = []
        server_key, public, secret = keys

        def secure(sock: zmq.Socket) -> None:
            sock.curve_serverkey = server_key
            sock.curve_publickey = public
            sock.curve_secretkey = secret

        self.engine, self.proc = build_engine_core(config, input_addr, output_addr,
                                                   max_outputs_ahead, secure)
        return {**ready_info(self.engine), **self.node_info(), "cpus": cpus}

    def run(self) -> int:
        """The loop, until the client's SHUTDOWN; the engine's stop hooks run at its end.
        Returns the exit status (1: a step failed, reported to the client first)."""
        from corellm.engine.core_proc import serve_engine_core
        try:
            return serve_engine_core(self.engine, self.proc)
        finally:
            for fd in self._claims:
                os.close(fd)
            self._claims = []
