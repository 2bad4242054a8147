"""Host memory for CPU workers: the allocator's thresholds, and zero-filled long-lived buffers.

glibc serves large allocations with mmap and returns freed memory to the OS (the mmap and trim
thresholds), so the big temporaries of every forward pass (activations, logits, gathered KV) are
page-faulted in afresh each step, and the kernel zeroes every such page again before the step
can use it: work that grows with the bytes, not the arithmetic, and that slows the matmuls
reading those buffers.
Raising both thresholds keeps freed memory in the heap for reuse, as the tcmalloc/jemalloc
preloads that CPU inference servers recommend do. Resident memory then stays at its peak.

The setting is process-wide, so a library must not impose it on the program that embeds it:
``CORELLM_MALLOC_TUNING=1`` turns it on, and the ``corellm`` command sets that default for the
processes it owns (``CORELLM_MALLOC_TUNING=0`` keeps it off there too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_applied = False


def tune_malloc() -> bool:
    """Keep freed large blocks in the glibc heap, if ``CORELLM_MALLOC_TUNING=1``. Returns whether
    the tuning was requested and is in effect."""
    global _applied
    if not sys.platform.startswith("linux") or os.environ.get("CORELLM_MALLOC_TUNING") != "1":
        return False
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):      # not glibc (e.g. musl): nothing to tune
        return False
    ok = (mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
          and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
          and mallopt(_M_TOP_PAD, 1 << 28) == 1)
    if not ok:
        logger.debug("mallopt rejected the CPU allocator tuning")
    _applied = ok
    return ok


_HUGE_PAGE = 2 << 20


def zeroed_cpu_tensor(shape: tuple[int, ...] | int, dtype: torch.dtype,
                      huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on its own anonymous memory mapping, for big long-lived buffers
    (the KV pool, packed weights). The kernel zero-fills pages on first touch, so a large pool
    costs nothing at start-up (torch.zeros writes every page up front, a cost that grows with
    the pool) and only the pages ever used take memory.

    ``huge_pages`` (Linux): the mapping is 2 MiB-aligned and asks for transparent huge pages
    (``MADV_HUGEPAGE``, honoured where THP is ``always`` or ``madvise``), for data streamed
    from memory in full at every step: packed weights. Their TLB misses drop 512-fold, which
    matters most to a GEMM over cold weights at few rows, where reading the weights is the
    whole cost (figures: docs/platform-cpu.md, "Huge pages"). The KV pool does not ask: a
    decode reads only its requests' blocks, and end to end huge pages showed no gain there."""
    import mmap

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    huge = huge_pages and nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    buf = mmap.mmap(-1, nbytes + (_HUGE_PAGE if huge else 0),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if huge:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        offset = -address % _HUGE_PAGE
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % _HUGE_PAGE)
        except OSError:                 # THP off in this kernel: 4 KiB pages, still zeroed
            pass
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
