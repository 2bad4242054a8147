"""A tensor-parallel rank as a Ray actor (``RankActor``, made remote by the executor).

``serve`` is the rank's life: connect to the driver (a message link, plus a doorbell link on the
driver's node), join the ``torch.distributed`` group, load the shard, report ready, then run
the plans until told to stop or the driver is gone. On the driver's node the plans come through
the shared-memory ring (``corellm.platforms.shm_ring``, the ``multiproc`` executor's channel)
with the doorbell link as its doorbell; on another node they come over the message link. Rank 0
returns its outputs the same way. A failure is reported on the message link (a corellm error
travels whole) and raised, so the actor's call ends with it too.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from typing import Any

from corellm.errors import CorellmError
from corellm.worker.ranks import build_rank_worker, describe, serve_rank
from corellm_plugins.executor_ray import channel
from corellm_plugins.executor_ray.cluster import match_niceness

logger = logging.getLogger("corellm_plugins.executor_ray.executor")


class RankActor:
    """One rank. Created by the executor with its bundle of the placement group."""

    def node_info(self) -> dict[str, Any]:
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self, host: str) -> int:
        from corellm.platforms.distributed import free_port
        return free_port(host)

    def serve(self, rank: int, config: Any, setup: Any, init_method: str,
              driver: tuple[str, int], ring: dict[str, Any] | None, threads: int,
              local_rank: int, local_world: int, start_timeout: float,
              niceness: int, token: bytes) -> int:
        from corellm.engine.logs import configure_logging
        configure_logging()
        match_niceness(niceness, "this rank")
        os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
        link = channel.connect(driver, start_timeout)
        channel.greet(link, token, "link", rank)
        bell = None
        if ring is not None:
            bell = channel.connect(driver, start_timeout)
            channel.greet(bell, token, "bell", rank)
        parallel = worker = reader = writer = None
        try:
            from corellm.platforms.shm_ring import RingReader, RingWriter
            worker, parallel = build_rank_worker(config, setup, rank, init_method, threads,
                                                 local_rank, local_world)
            if ring is not None:
                reader = RingReader(ring["plan"], ring["reader"], bell)
                if rank == 0:
                    writer = RingWriter(ring["out"], [bell])
            channel.send(link, ("ready", worker.model_info))
            serve_rank(rank, worker,
                       reader.read if reader is not None else lambda: channel.recv(link),
                       writer.write if writer is not None
                       else lambda out: channel.send(link, ("out", out)),
                       lambda result: channel.send(link, ("ok", result)))
        except BaseException as exc:
            _report(link, rank, exc)
            raise
        finally:
            for end in (reader, writer):
                if end is not None:
                    end.close()
            for sock in (link, bell):
                if sock is not None:
                    sock.close()
        try:
            from corellm.platforms.distributed import destroy_parallel
            destroy_parallel(parallel)
            worker.shutdown()
        except Exception:
            pass
        return 0


def _report(link: socket.socket, rank: int, exc: BaseException) -> None:
    """Tell the driver why this rank stops: corellm's own errors travel whole."""
    logger.error("tensor-parallel rank %d failed: %s", rank, describe(exc))
    tb = "".join(traceback.format_exception(exc)[-6:])
    own = exc if isinstance(exc, CorellmError) else None
    for payload in (("error", describe(exc), tb, own), ("error", describe(exc), tb, None)):
        try:
            channel.send(link, payload)
            return
        except Exception:
            continue
