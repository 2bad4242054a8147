"""The CPU platform's thread pool (plugins/platform_cpu/pool.c) and the thread budget it is
sized to: every item of a loop runs exactly once, on any thread count, nested, from several
threads at once and after a fork; the budget follows the affinity mask and cgroup quotas."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import threading

import pytest
import torch

from corellm_plugins.platform_cpu import native
from corellm_plugins.platform_cpu.native import NativeBuildError, cpu_budget, thread_pool
from tests.cpu_threads import cpu_threads

_SOURCE = r"""
#include <stdint.h>
#include "corellm_pool.h"

typedef struct { int32_t *count, *tid; int64_t inner; int32_t *max_tid; } args_t;

static void mark(void *ctx, int64_t b, int64_t e, int tid) {
    args_t *a = ctx;
    for (int64_t i = b; i < e; ++i) {
        __atomic_add_fetch(&a->count[i], 1, __ATOMIC_RELAXED);
        a->tid[i] = tid;
        int32_t m = __atomic_load_n(a->max_tid, __ATOMIC_RELAXED);
        while (tid > m && !__atomic_compare_exchange_n(a->max_tid, &m, tid, 0,
                                                       __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
}

/* each item of the outer loop runs an inner loop over its own slice */
static void outer(void *ctx, int64_t b, int64_t e, int tid) {
    args_t *a = ctx;
    (void)tid;
    for (int64_t i = b; i < e; ++i) {
        args_t in = {a->count + i * a->inner, a->tid + i * a->inner, 0, a->max_tid};
        corellm_parallel_for(a->inner, 1, mark, &in);
    }
}

int32_t fill(int64_t n, int64_t grain, int32_t *count, int32_t *tid) {
    int32_t max_tid = 0;
    args_t a = {count, tid, 0, &max_tid};
    corellm_parallel_for(n, grain, mark, &a);
    return max_tid;
}

int32_t fill_nested(int64_t outer_n, int64_t inner_n, int32_t *count, int32_t *tid) {
    int32_t max_tid = 0;
    args_t a = {count, tid, inner_n, &max_tid};
    corellm_parallel_for(outer_n, 1, outer, &a);
    return max_tid;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    src = tmp_path_factory.mktemp("pool") / "pool_test.c"
    src.write_text(_SOURCE)
    try:
        lib = native.load_library("corellm_pool_test", src)
    except NativeBuildError as exc:
        pytest.skip(f"no C compiler: {exc}")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.fill, lib.fill_nested):
        fn.argtypes = [i64, i64, ptr, ptr]
        fn.restype = ctypes.c_int32
    return lib


def _fill(lib, n: int, grain: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    count = torch.zeros(n, dtype=torch.int32)
    tid = torch.full((n,), -1, dtype=torch.int32)
    top = lib.fill(n, grain, count.data_ptr(), tid.data_ptr())
    return count, tid, top


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n,grain", [(1, 1), (7, 1), (1000, 1), (1000, 64), (100_000, 5),
                                     (50, 50), (51, 50)])
def test_every_item_runs_exactly_once(lib, threads, n, grain):
    with cpu_threads(threads):
        for _ in range(20):                       # many loops: generations turn over
            count, tid, top = _fill(lib, n, grain)
            assert torch.equal(count, torch.ones(n, dtype=torch.int32))
            assert 0 <= int(tid.min()) and int(tid.max()) < threads and top < threads
            if n <= grain:
                assert top == 0                   # one chunk: on the calling thread


def test_workers_take_chunks_and_then_sleep(lib):
    pool = thread_pool()
    with cpu_threads(2):
        before = pool.stats()
        for _ in range(200):
            _fill(lib, 4096, 1)
        after = pool.stats()
    assert after["loops"] - before["loops"] == 200
    assert after["worker_chunks"] > before["worker_chunks"]      # the worker did take part
    assert 0 < pool.spin_ns <= 200_000                            # a short, bounded spin


def test_workers_beyond_the_count_stay_parked(lib):
    """After the pool shrinks, the workers it no longer needs neither wake nor spin for loops:
    with a pause between loops (every awake worker goes to sleep in it), at most the one
    needed worker sleeps per loop."""
    import time

    pool = thread_pool()
    with cpu_threads(8):
        _fill(lib, 4096, 1)                       # 7 workers started
    with cpu_threads(2):
        before = pool.stats()
        for _ in range(30):
            time.sleep(0.002)
            _fill(lib, 4096, 1)
        after = pool.stats()
    assert after["worker_sleeps"] - before["worker_sleeps"] <= 30 + 1


@pytest.fixture
def long_spin():
    """Workers that spin for 200 ms before they sleep (a worker warms only while it spins)."""
    pool = thread_pool()
    old = pool.spin_ns
    pool.configure(pool.threads, 200_000_000)
    yield pool
    pool.configure(pool.threads, old)


def _wait_warmed(pool, target: int, timeout: float = 0.15) -> int:
    import time
    deadline = time.perf_counter() + timeout
    while pool.warmed_bytes < target and time.perf_counter() < deadline:
        pass
    return pool.warmed_bytes


def test_an_idle_worker_fetches_the_ranges_given(lib, long_spin):
    """corellm_pool_warm: between loops, worker 1 fetches every byte of the ranges, once."""
    pool = long_spin
    bufs = [torch.empty(n, dtype=torch.uint8) for n in (300_000, 4097, 1 << 20)]
    with cpu_threads(2):
        _fill(lib, 4096, 1)                       # a worker awake and spinning
        before = pool.warmed_bytes
        pool.warm([(b.data_ptr(), b.numel()) for b in bufs])
        total = sum(b.numel() for b in bufs)
        assert _wait_warmed(pool, before + total) == before + total
        # a loop meanwhile runs as ever, and a new range replaces what was left
        count, _, _ = _fill(lib, 1000, 1)
        assert torch.equal(count, torch.ones(1000, dtype=torch.int32))


def test_warming_memory_that_is_gone_does_not_fault(lib, long_spin):
    """The worker prefetches, never loads: a range unmapped since it was given costs
    nothing."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 1 << 20
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)          # PROT_READ|WRITE, PRIVATE|ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(addr, size) == 0
    pool = long_spin
    with cpu_threads(2):
        _fill(lib, 4096, 1)
        before = pool.warmed_bytes
        pool.warm([(addr, size), (0, 4096)])
        assert _wait_warmed(pool, before + size + 4096) == before + size + 4096
        count, _, _ = _fill(lib, 100, 1)           # still alive, still working
        assert torch.equal(count, torch.ones(100, dtype=torch.int32))


def test_one_thread_warms_nothing(lib, long_spin):
    pool = long_spin
    buf = torch.empty(65536, dtype=torch.uint8)
    with cpu_threads(1):
        before = pool.warmed_bytes
        pool.warm([(buf.data_ptr(), buf.numel())])
        _fill(lib, 4096, 1)
        assert _wait_warmed(pool, before + 1, timeout=0.005) == before


def test_a_loop_inside_a_loop_runs_on_its_thread(lib):
    with cpu_threads(4):
        count = torch.zeros(16 * 33, dtype=torch.int32)
        tid = torch.full((16 * 33,), -1, dtype=torch.int32)
        lib.fill_nested(16, 33, count.data_ptr(), tid.data_ptr())
    assert torch.equal(count, torch.ones_like(count))
    # an inner loop runs whole on the thread that runs its outer item
    assert all(len(set(row.tolist())) == 1 for row in tid.view(16, 33))


def test_callers_on_several_threads_take_turns(lib):
    """ctypes releases the GIL: loops from several Python threads at once each run whole."""
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(50):
            n = 1000 + 37 * ((seed * 50 + i) % 29)
            count, _, _ = _fill(lib, n, 3)
            if not torch.equal(count, torch.ones(n, dtype=torch.int32)):
                errors.append(f"thread {seed}, loop {i}: {count.unique().tolist()}")

    with cpu_threads(3):
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def _child(lib_path: str, q) -> None:
    lib = ctypes.CDLL(lib_path)
    lib.fill.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.fill.restype = ctypes.c_int32
    count = (ctypes.c_int32 * 5000)()
    tid = (ctypes.c_int32 * 5000)()
    top = 0
    for _ in range(20):
        count = (ctypes.c_int32 * 5000)()
        top = max(top, lib.fill(5000, 1, count, tid))
    q.put((sorted(set(count)), top))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_workers(lib):
    with cpu_threads(2):
        _fill(lib, 5000, 1)                        # the parent's worker exists
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        proc = ctx.Process(target=_child, args=(lib._name, q))
        proc.start()
        counts, top = q.get(timeout=60)
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert counts == [1]


# --------------------------------------------------------------------------- the budget
def _cgroup_v2(tmp_path, quotas: dict[str, str]):
    root = tmp_path / "cgroup"
    for rel, value in quotas.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/" + max(quotas, key=len) + "\n")
    return root, proc


def test_cgroup_v2_quota_of_the_tightest_ancestor(tmp_path):
    root, proc = _cgroup_v2(tmp_path, {"a": "150000 100000", "a/b": "max 100000",
                                       "a/b/c": "400000 100000"})
    threads, cpus, where = native._cgroup_quota(root, proc)
    assert (threads, cpus) == (2, 1.5) and where.endswith("a/cpu.max")


def test_no_quota(tmp_path):
    root, proc = _cgroup_v2(tmp_path, {"a": "max 100000"})
    assert native._cgroup_quota(root, proc) is None
    assert native._cgroup_quota(root, tmp_path / "missing") is None


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cgroup"
    d = root / "cpu,cpuacct" / "job"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("50000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("12:memory:/job\n4:cpu,cpuacct:/job\n")
    assert native._cgroup_quota(root, proc)[:2] == (1, 0.5)


def test_budget_takes_the_quota_under_the_affinity_mask(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(native, "_cgroup_quota", lambda: None)
    assert cpu_budget()[0] == cpus
    monkeypatch.setattr(native, "_cgroup_quota", lambda: (1, 0.5, "/x/cpu.max"))
    threads, how = cpu_budget()
    assert threads == 1 and "quota of 0.5" in how and "/x/cpu.max" in how
    monkeypatch.setattr(native, "_cgroup_quota", lambda: (cpus + 4, cpus + 3.5, "/x"))
    assert cpu_budget()[0] == cpus                # a quota above the mask changes nothing


def test_a_worker_gets_its_share_of_the_budget(monkeypatch):
    from corellm_plugins.platform_cpu import CpuOptions
    from corellm_plugins.platform_cpu.platform import CpuPlatform
    pool = thread_pool()
    old_pool, old_torch = pool.threads, torch.get_num_threads()
    monkeypatch.setattr(native, "cpu_budget", lambda: (8, "8 CPUs (test)"))
    try:
        CpuPlatform(CpuOptions()).prepare_process(local_world_size=2)
        assert pool.threads == 4 and torch.get_num_threads() == 1
        CpuPlatform(CpuOptions(weight_packing=False)).prepare_process(local_world_size=3)
        assert pool.threads == 2 and torch.get_num_threads() == 2
    finally:
        pool.configure(old_pool)
        torch.set_num_threads(old_torch)
