"""Host-side mechanics of the CUDA platform, kept apart from the code that needs a GPU so that it
is tested on any machine: the KV-cache budget's arithmetic, and persistent staging buffers that
carry each step's host arrays to the device."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from corellm.errors import ConfigError

UTILIZATION_KEY = "platform.gpu_memory_utilization"


def kv_budget_bytes(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes left for the KV cache: ``utilization`` of the device's ``total`` memory, less the
    peak torch allocation of the profiling forward (weights and activations) and the memory used
    outside torch's allocator (the CUDA context, NCCL, other processes). None left is a
    ConfigError naming the option and the figures."""
    budget = int(total * utilization) - peak_torch - max(0, non_torch)
    if budget <= 0:
        gib = 1 << 30
        raise ConfigError([(UTILIZATION_KEY, (
            f"{utilization:g} of {total / gib:.2f} GiB leaves no room for the KV cache: the "
            f"weights and a forward at the largest step take {peak_torch / gib:.2f} GiB and "
            f"{non_torch / gib:.2f} GiB is used outside torch; raise it, or lower "
            f"scheduler.max_num_batched_tokens"))])
    return budget


class StagingBuffer:
    """A persistent device buffer that each step's 1-D numpy array is copied into, through a
    persistent host buffer (pinned where ``pin``), returned as a view of the buffer's start.

    The copy is non-blocking: nothing waits for the device before the forward is queued. Before
    the host buffer is written again, the previous copy out of it is waited for (``event``, an
    event recorded after the copy), so a step prepared while the last one still runs never
    overwrites what is being read. The buffers grow, doubling, when a step needs more."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device,
                 pin: bool = True, event: Any = None) -> None:
        self.dtype, self.device, self.pin = dtype, device, pin
        self._make_event = event
        self._event: Any = None
        self.capacity = 0
        self.grown = 0
        self._alloc(max(1, capacity))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.pin)
        self.host_np = self.host.numpy()
        self.device_buf = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self._event = None

    def put(self, values: np.ndarray) -> torch.Tensor:
        n = values.size
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))
            self.grown += 1
        if self._event is not None:
            self._event.synchronize()        # the last copy out of the host buffer is done
        self.host_np[:n] = values.reshape(-1)
        out = self.device_buf[:n]
        out.copy_(self.host[:n], non_blocking=True)
        if self._make_event is not None:
            self._event = self._make_event()
            self._event.record()
        return out
