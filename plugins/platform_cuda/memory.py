"""The KV-cache budget of ``gpu_memory_utilization``: the arithmetic, apart from the calls that
measure a GPU, so that it is tested on any machine."""

from __future__ import annotations

from dataclasses import dataclass

from corellm.errors import ConfigError

UTILIZATION_KEY = "platform.gpu_memory_utilization"
GIB = 1 << 30


@dataclass(frozen=True)
class MemorySnapshot:
    """One device's memory at one moment (bytes): ``total`` and ``free`` as the driver reports
    them (``torch.cuda.mem_get_info``), and what torch's caching allocator holds
    (``reserved``) and has handed out of it (``allocated``)."""

    total: int
    free: int
    reserved: int
    allocated: int

    @property
    def non_torch(self) -> int:
        """Used on the device outside torch's allocator: CUDA contexts, loaded kernels, NCCL
        and cuBLAS buffers, and other processes."""
        return max(0, self.total - self.free - self.reserved)

    @property
    def allocatable(self) -> int:
        """What this process can still allocate: the free memory plus what torch holds
        reserved but unused."""
        return self.free + max(0, self.reserved - self.allocated)


def kv_budget_bytes(utilization: float, after: MemorySnapshot, torch_peak: int,
                    start: MemorySnapshot | None = None) -> int:
    """Bytes of KV cache: ``utilization`` of the device's total memory, less the peak torch
    allocation of the profiling forward (``torch_peak``: weights and the activations of the
    largest step) and the memory this process came to use outside torch (the non-torch memory
    now, less the non-torch memory at ``start``, taken before the model was built: memory
    other processes held then is theirs, not this engine's share).

    The KV cache and the activations' headroom above what is allocated now must also fit in
    what is still allocatable. Either failing is a ConfigError naming
    ``platform.gpu_memory_utilization`` with the figures."""
    total = after.total
    requested = int(total * utilization)
    non_torch = max(0, after.non_torch - (start.non_torch if start is not None else 0))
    budget = requested - torch_peak - non_torch
    if budget <= 0:
        raise ConfigError([(UTILIZATION_KEY, (
            f"{utilization:g} of the device's {total / GIB:.2f} GiB is {requested / GIB:.2f} "
            f"GiB, and the weights and a forward of the largest step peak at "
            f"{torch_peak / GIB:.2f} GiB, with {non_torch / GIB:.2f} GiB used outside torch: "
            f"nothing is left for the KV cache (raise it, lower "
            f"scheduler.max_num_batched_tokens, or set kv_cache.memory_gib)"))])
    headroom = max(0, torch_peak - after.allocated)
    if budget + headroom > after.allocatable:
        others = start.non_torch if start is not None else after.non_torch
        raise ConfigError([(UTILIZATION_KEY, (
            f"{utilization:g} leaves {budget / GIB:.2f} GiB for the KV cache, but only "
            f"{after.allocatable / GIB:.2f} GiB of the device is free, of which the "
            f"activations need {headroom / GIB:.2f} GiB ({others / GIB:.2f} GiB was in use "
            f"before the engine started, by other processes or this one's CUDA context): "
            f"lower it"))])
    return budget
