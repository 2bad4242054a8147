"""A worker: one device, one model replica (or shard), its KV cache and its model runner.

Executors create workers: in-process (``executor_uniproc``) or one per process.
"""

from __future__ import annotations

from corellm.config import EngineConfig
from corellm.block_pool import num_blocks_for_budget
from corellm.interfaces import ModelInfo
from corellm.model_config import model_path
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.plugins import Registry, load_registry
from corellm.worker.cpu import tune_malloc
from corellm.worker.model_runner import ModelRunner, resolve_model


class Worker:
    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        self.config = config
        registry = registry or load_registry(disable=config.plugins.disable)
        resolved = resolve_model(config, model_path(config), registry)
        if resolved.device.type == "cpu":
            tune_malloc()
        self.runner = ModelRunner(config, registry, resolved)

    @property
    def model_info(self) -> ModelInfo:
        return self.runner.model_info

    def determine_num_kv_blocks(self) -> int:
        kv = self.config.kv_cache
        return num_blocks_for_budget(kv.num_blocks, kv.memory_gib,
                                     self.runner.kv_cache_bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.sample_tokens(scheduler_output)
