"""How a step's host arrays reach the GPU and its sampled ids come back: persistent buffers,
one copy each way. Device-agnostic: the CUDA stepper gives them pinned memory and
``torch.cuda.Event`` as ``event`` (required: with None nothing waits for the copies, which is
right only where copies are synchronous, as on the CPU), tests plain memory and stand-in
events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class _CopyFence:
    """The last copy out of (or into) a host buffer, as an event recorded after it: waited for
    before the host touches the buffer again."""

    def __init__(self, make_event: Callable[[], Any] | None) -> None:
        self._event = make_event() if make_event is not None else None
        self._recorded = False

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
            self._recorded = True

    def wait(self) -> None:
        if self._recorded:
            self._event.synchronize()
            self._recorded = False


class StepStaging:
    """A step's ``input_ids``, ``positions`` and ``logits_indices`` (int64) packed in one
    persistent host buffer (pinned where ``pin``) and copied to one persistent device buffer
    with a single non-blocking copy: nothing waits for the device before the forward is queued.

    Layout of a step of ``m`` tokens (its own count, or the captured graph's batch size it is
    padded to, the padding being token 0 at position 0): ids at ``[0, m)``, positions at
    ``[m, 2m)``, logits indices right after. For a given ``m`` the ids and positions are always
    at the same device addresses, which is what a CUDA graph captured at ``m`` reads. The
    buffers are sized from the scheduler's limits; a step beyond them reallocates, which moves
    the device buffer (``moves`` counts it: graphs captured before no longer see the inputs).

    Before the host buffer is rewritten, the previous copy out of it is waited for (``event``:
    a factory of events recorded on the copy's stream), so a step prepared while the last one
    is still being copied never overwrites what is being read.
    """

    def __init__(self, max_tokens: int, max_rows: int, device: torch.device, *,
                 event: Callable[[], Any] | None, pin: bool = True) -> None:
        self.device, self.pin = device, pin
        self._fence = _CopyFence(event)
        self.moves = 0
        self._alloc(2 * max(1, max_tokens) + max(1, max_rows))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=self.pin)
        self.host_np = self.host.numpy()
        self.device_buf = torch.zeros(capacity, dtype=torch.int64, device=self.device)

    @staticmethod
    def layout(padded_tokens: int, num_rows: int) -> tuple[slice, slice, slice]:
        """Where the ids, positions and logits indices of a step of ``padded_tokens`` tokens
        (after padding) and ``num_rows`` sampled rows sit in the buffers."""
        m = padded_tokens
        return slice(0, m), slice(m, 2 * m), slice(2 * m, 2 * m + num_rows)

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, logits_indices: np.ndarray,
              padded_tokens: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's arrays on the device: (ids [m], positions [m], logits indices [S]), views
        of the device buffer, with ``m = padded_tokens`` (at least the step's token count) or
        the token count."""
        n, s = len(input_ids), len(logits_indices)
        m = n if padded_tokens is None else padded_tokens
        if m < n:
            raise ValueError(f"cannot pad {n} tokens to {m}")
        ids, pos, rows = self.layout(m, s)
        end = rows.stop
        if end > self.capacity:
            self._fence.wait()
            self._alloc(max(end, 2 * self.capacity))
            self.moves += 1
        self._fence.wait()                   # the last copy out of the host buffer is done
        h = self.host_np
        h[ids.start:ids.start + n] = input_ids
        h[ids.start + n:ids.stop] = 0
        h[pos.start:pos.start + n] = positions
        h[pos.start + n:pos.stop] = 0
        h[rows] = logits_indices
        self.device_buf[:end].copy_(self.host[:end], non_blocking=True)
        self._fence.record()
        d = self.device_buf
        return d[ids], d[pos], d[rows]


class HostIds:
    """The landing buffer of the step's sampled ids: one device-to-host copy into persistent
    host memory (pinned where ``pin``, so the copy is a DMA the event can wait for), then one
    wait for that copy, the step's only synchronisation with the device."""

    def __init__(self, capacity: int, *, event: Callable[[], Any] | None,
                 pin: bool = True) -> None:
        self.pin = pin
        self._fence = _CopyFence(event)
        self.buf = torch.zeros(max(1, capacity), dtype=torch.int64, pin_memory=pin)

    def fetch(self, token_ids: torch.Tensor) -> list[int]:
        n = token_ids.numel()
        if n > self.buf.numel() or token_ids.dtype != self.buf.dtype:
            self.buf = torch.zeros(max(n, self.buf.numel()), dtype=token_ids.dtype,
                                   pin_memory=self.pin)
        out = self.buf[:n]
        out.copy_(token_ids.reshape(-1), non_blocking=True)
        self._fence.record()
        self._fence.wait()
        return out.tolist()
