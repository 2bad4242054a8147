"""The host and its devices: the one device-type test of the core, and the host's free memory.

Everything else in the core asks these or the selected platform (``corellm.platforms``); it
lives below every other module so the attention data, the platform interface and the
platforms themselves can all use it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HOST_DEVICE_TYPE = "cpu"


def host_visible(device: torch.device) -> bool:
    """Whether tensors on ``device`` live in the host's memory (the CPU), so host arrays reach
    them without a copy. The one device-type test of the core: every other module asks this or
    the platform."""
    return device.type == HOST_DEVICE_TYPE


def host_memory_available() -> int | None:
    """The host's memory available to new allocations, in bytes: MemAvailable of /proc/meminfo
    (free memory plus what the kernel can reclaim), else the free pages, else None. For
    platforms whose devices use the host's memory (the CPU's, the reference)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
