"""Running a test's CPU kernels on a given number of the CPU platform's pool threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """The CPU platform's thread pool (which runs every native kernel's loops) and torch on
    ``n`` threads, restored after."""
    from corellm_plugins.platform_cpu.native import thread_pool
    pool = thread_pool()
    old_pool, old_torch = pool.threads, torch.get_num_threads()
    pool.configure(n)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        pool.configure(old_pool)
        torch.set_num_threads(old_torch)
