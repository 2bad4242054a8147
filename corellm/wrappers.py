"""Base classes for components that wrap another of their kind.

A wrapper adds to a component without replacing it: a timing executor, a logging KV-cache
manager, a sampler that bans tokens and hands off to ``default``. Its options declare the
wrapped component as a ``delegate`` sub-section (``corellm.components.delegate_field``), which
the config loader validates against that component's own options; its factory builds the
delegate with ``ctx.build_delegate(options)`` and passes it here. Each class forwards every
method and attribute of its interface to ``self.inner``; a wrapper overrides what it adds to and
calls ``super()`` (or ``self.inner``) for the rest. Attributes outside the interface (a built-in
executor's own methods, a manager's ``check_invariants``) are forwarded too, so tools that look
for them find the delegate's.

    class TimingExecutor(ExecutorWrapper):
        def execute_model(self, plan):
            t0 = time.perf_counter()
            try:
                return super().execute_model(plan)
            finally:
                self.seconds += time.perf_counter() - t0

docs/plugins.md, "Wrapping a component", has the whole pattern.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from corellm.interfaces import (AttentionBackend, CachedPrefix, Executor, Frontend,
                                KVCacheManager, ModelInfo, Sampler, Scheduler)
from corellm.platforms.interface import ModelStepper, Platform
from corellm.request import Request, RequestStatus


class _Forwarding:
    """Attribute lookups the wrapper does not answer go to the wrapped component."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally; "inner" itself missing means __init__ has
        # not run (copy, pickle), and must not recurse.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _attribute(name: str) -> property:
    """An attribute of the interface read from and written to ``inner``: the interfaces
    declare these as plain attributes, which a wrapper subclass may assign."""
    return property(lambda self: getattr(self.inner, name),
                    lambda self, value: setattr(self.inner, name, value))


class SchedulerWrapper(_Forwarding, Scheduler):
    """A ``Scheduler`` that forwards to ``inner``; the engine's clock reaches ``inner`` too."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner

    clock = _attribute("clock")                     # type: ignore[assignment]
    # Overlapped steps as ``inner`` allows; a wrapper that needs each step updated before the
    # next is planned sets it False.
    supports_async_scheduling = _attribute("supports_async_scheduling")

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list:
        return self.inner.abort_requests(request_ids, status)

    def schedule(self) -> Any:
        return self.inner.schedule()

    def update_from_output(self, scheduler_output: Any, runner_output: Any) -> list:
        return self.inner.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.inner.has_unfinished_requests()

    def get_request_ids(self) -> list[str]:
        return self.inner.get_request_ids()

    def get_stats(self) -> Any:
        return self.inner.get_stats()


class KVCacheManagerWrapper(_Forwarding, KVCacheManager):
    """A ``KVCacheManager`` that forwards to ``inner`` (block counts and prefix-cache counters
    included)."""

    def __init__(self, inner: KVCacheManager) -> None:
        self.inner = inner

    block_size = _attribute("block_size")
    num_blocks = _attribute("num_blocks")
    # A wrapper sees every step's calls unless it says otherwise (True: it changes nothing
    # between block boundaries either, as ``inner`` may).
    block_calls_only = False
    prefix_cache_queries = _attribute("prefix_cache_queries")
    prefix_cache_hits = _attribute("prefix_cache_hits")

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.inner.num_cached_blocks

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        return self.inner.find_cached_prefix(request)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> list[int] | None:
        return self.inner.allocate_slots(request, num_new_tokens, prefix)

    def cache_computed_blocks(self, request: Request) -> None:
        self.inner.cache_computed_blocks(request)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()

    def free(self, request: Request) -> None:
        self.inner.free(request)

    def get_block_ids(self, request: Request) -> list[int]:
        return self.inner.get_block_ids(request)


class AttentionBackendWrapper(_Forwarding, AttentionBackend):
    """An ``AttentionBackend`` that forwards to ``inner``."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def supports(self, layer: Any, dtype: Any, device: Any) -> str | None:
        return self.inner.supports(layer, dtype, device)

    def kv_cache_spec(self, layer: Any, num_blocks: int, block_size: int, dtype: Any) -> Any:
        return self.inner.kv_cache_spec(layer, num_blocks, block_size, dtype)

    def make_metadata_builder(self, limits: Any) -> Any:
        return self.inner.make_metadata_builder(limits)

    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                metadata: Any) -> Any:
        return self.inner.forward(layer, query, key, value, kv_cache, metadata)


class ExecutorWrapper(_Forwarding, Executor):
    """An ``Executor`` that forwards to ``inner``: its workers, its clock (a simulated
    executor's virtual time stays the engine's), its model facts, its overlapped steps
    (``max_concurrent_batches``: a wrapper that needs each step's output before the next plan
    returns 1), its shutdown."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    clock = _attribute("clock")                     # type: ignore[assignment]

    @property
    def max_concurrent_batches(self) -> int:
        return self.inner.max_concurrent_batches

    @property
    def model_info(self) -> ModelInfo:
        return self.inner.model_info

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        return self.inner.collective_rpc(method, args, kwargs, timeout)

    def determine_num_kv_blocks(self) -> int:
        return self.inner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.inner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: Any) -> Any | Future:
        return self.inner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.inner.shutdown()


class SamplerWrapper(_Forwarding, Sampler):
    """A ``Sampler`` that forwards to ``inner``."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def __call__(self, logits: Any, metadata: Any) -> Any:
        return self.inner(logits, metadata)


class FrontendWrapper(_Forwarding, Frontend):
    """A ``Frontend`` that forwards to ``inner``."""

    def __init__(self, inner: Frontend) -> None:
        self.inner = inner

    def run(self) -> int | None:
        return self.inner.run()


__all__ = ["AttentionBackendWrapper", "ExecutorWrapper", "FrontendWrapper",
           "KVCacheManagerWrapper", "SamplerWrapper", "SchedulerWrapper"]


class PlatformWrapper(_Forwarding, Platform):
    """A ``Platform`` that forwards to ``inner``, the platform its ``delegate`` section names
    (``delegate: PlatformOptions = delegate_field("platform", default="cpu")``): a tracing or
    measuring platform keeps the built-in's kernels, memory and graphs. Its factory is
    ``factory(options, inner)``; the class attributes (``device_type``, ``dist_backend``,
    ``default_block_size``, ``supported_dtypes``, ``async_scheduling``, ``shares_devices``) are
    the inner platform's."""

    def __init__(self, options: Any, inner: Platform) -> None:
        super().__init__(options)
        self.inner = inner

    device_type = property(lambda self: self.inner.device_type)          # type: ignore
    dist_backend = property(lambda self: self.inner.dist_backend)        # type: ignore
    default_block_size = property(lambda self: self.inner.default_block_size)  # type: ignore
    supported_dtypes = property(lambda self: self.inner.supported_dtypes)  # type: ignore
    async_scheduling = property(lambda self: self.inner.async_scheduling)  # type: ignore
    shares_devices = property(lambda self: self.inner.shares_devices)    # type: ignore

    def device(self, local_rank: int = 0) -> Any:
        return self.inner.device(local_rank)

    def device_count(self) -> int:
        return self.inner.device_count()

    def device_names(self) -> list[str]:
        return self.inner.device_names()

    def prepare_process(self, local_world_size: int = 1) -> None:
        self.inner.prepare_process(local_world_size)

    def free_memory(self, device: Any, local_world_size: int = 1) -> int | None:
        return self.inner.free_memory(device, local_world_size)

    def kv_cache_budget(self, device: Any, local_world_size: int, profile: Any) -> int:
        return self.inner.kv_cache_budget(device, local_world_size, profile)

    def memory_usage(self, device: Any) -> dict[str, int]:
        return self.inner.memory_usage(device)

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        return self.inner.zeros(shape, dtype, device)

    def resolve_dtype(self, requested: str, checkpoint_dtype: str) -> str:
        return self.inner.resolve_dtype(requested, checkpoint_dtype)

    @property
    def ops(self) -> Any:
        return self.inner.ops

    def prepare_model(self, model: Any) -> None:
        self.inner.prepare_model(model)

    def make_stepper(self, model: Any, device: Any, limits: Any) -> ModelStepper:
        return self.inner.make_stepper(model, device, limits)

    def warm_up(self, stepper: ModelStepper) -> None:
        self.inner.warm_up(stepper)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def native_library(self, name: str, source: Any, flags: tuple[str, ...] = ()) -> Any:
        return self.inner.native_library(name, source, flags)

    def describe(self) -> str:
        return f"{self.name} over {self.inner.describe()}"

