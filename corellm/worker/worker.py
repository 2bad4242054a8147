"""A worker: one device, one model replica or tensor-parallel shard, its KV cache and its model
runner.

Executors create workers: in-process (``executor_uniproc``) or one per process and rank
(``executor_multiproc``). Everything an executor asks of a worker besides the step goes through
``Executor.collective_rpc`` by method name, so a method added here is reachable from every
executor.
"""

from __future__ import annotations

import gc
import logging

from corellm.kv.block_pool import num_blocks_for_budget
from corellm.config.compose import EngineConfig
from corellm.platforms.distributed import SINGLE, ParallelContext
from corellm.errors import ConfigError
from corellm.interfaces import ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms.interface import Platform, build_platform
from corellm.plugins.discovery import Registry, load_registry
from corellm.config.setup import EngineSetup, resolve_setup
from corellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """``parallel`` is this worker's rank (``SINGLE`` without tensor parallelism);
    ``local_world_size`` how many workers share this machine's memory (and ``local_rank`` which
    device is this one's). ``setup``: the engine's resolved setup (resolved here when not
    given, for a worker made on its own); ``platform``: its platform, built from
    ``config.platform`` when not given."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None,
                 parallel: ParallelContext = SINGLE, local_rank: int = 0,
                 local_world_size: int = 1, setup: EngineSetup | None = None,
                 platform: Platform | None = None) -> None:
        self.config = config
        self.parallel = parallel
        self.local_world_size = local_world_size
        registry = registry or load_registry(disable=config.plugins.disable)
        self.platform = platform or build_platform(config.platform, registry)
        self.setup = setup or resolve_setup(config, registry, self.platform)
        self.platform.prepare_process(local_world_size)
        self.runner = ModelRunner(config, registry, self.setup, self.platform, parallel,
                                  local_rank)

    @property
    def model_info(self) -> ModelInfo:
        return self.runner.model_info

    def determine_num_kv_blocks(self) -> int:
        """The blocks this worker can hold: ``kv_cache.num_blocks``, or as many of its own
        (its heads' share) as ``kv_cache.memory_gib`` holds, or, with neither set, as the
        platform's budget holds (``Platform.kv_cache_budget``: 1 GiB on the CPU, what
        ``gpu_memory_utilization`` leaves on CUDA); refused when more than the memory this
        worker measures free (its share of the host's, or its device's)."""
        kv = self.config.kv_cache
        per_block = self.runner.kv_cache_bytes_per_block()
        budget = None
        if kv.num_blocks is None and kv.memory_gib is None:
            budget = self.platform.kv_cache_budget(self.runner.device, self.local_world_size,
                                                   self.runner.profile_run)
        num = num_blocks_for_budget(kv.num_blocks, kv.memory_gib, per_block, budget)
        available = self.measure_free_memory()
        need = per_block * num
        if available is not None and need > available:
            key = "kv_cache.num_blocks" if kv.num_blocks is not None else "kv_cache.memory_gib"
            where = (f" (rank {self.parallel.tp_rank} of {self.parallel.tp_size})"
                     if self.parallel.tp_size > 1 else "")
            raise ConfigError([(key, f"the KV cache needs {need / 2**30:.2f} GiB but only "
                                     f"{available / 2**30:.2f} GiB of memory is available"
                                     f"{where}")])
        return num

    def measure_free_memory(self) -> int | None:
        """Bytes this worker may still allocate (the platform's measure: the device's free
        memory, or on the CPU its share of the host's available memory; None where
        unknown)."""
        return self.platform.free_memory(self.runner.device, self.local_world_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step: forward on every rank, sampling on rank 0, which alone returns tokens."""
        self.runner.execute_model(scheduler_output)
        if not self.parallel.is_driver:
            self.runner.discard_pending()
            return None
        return self.runner.sample_tokens(scheduler_output)

    def add_sampled_tokens(self, output: ModelRunnerOutput) -> None:
        """On ranks > 0: record the tokens rank 0 sampled last step, so the next step's inputs
        are the same on every rank."""
        self.runner.add_sampled_tokens(output.req_ids, output.sampled_token_ids)

    def shutdown(self) -> None:
        """Release the model, the KV cache and the platform's per-process state, so that the
        device memory they took is free for the next engine of this process. Idempotent."""
        if self.runner.model is None:
            return
        self.runner.release()
        gc.collect()                # reference cycles of the model's modules hold tensors
        self.platform.shutdown()

    def memory_usage(self) -> dict[str, int]:
        """This worker process's memory (bytes, from /proc/self/status): ``peak_rss`` (VmHWM,
        the high-water mark, mapped checkpoint pages included) and ``rss_anon`` (its own
        allocations now); plus what the platform reports of its device (on CUDA the peak
        allocation)."""
        out: dict[str, int] = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmHWM", "RssAnon", "VmRSS"):
                        out[{"VmHWM": "peak_rss", "RssAnon": "rss_anon",
                             "VmRSS": "rss"}[key]] = int(value.split()[0]) * 1024
        except OSError:
            pass
        out.update(self.platform.memory_usage(self.runner.device))
        return out

    def describe(self) -> dict:
        """This worker's rank, its platform, its attention backend, its KV heads and the shape
        of each of its parameters."""
        model = self.runner.model
        return {"rank": self.parallel.tp_rank, "tp_size": self.parallel.tp_size,
                "platform": self.platform.name,
                "attention": self.runner.attn_entry.spec.name,
                "num_kv_heads": model.num_kv_heads,
                "params": {n: list(p.shape) for n, p in model.named_parameters()}}
