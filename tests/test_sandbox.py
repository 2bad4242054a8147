"""The core's mechanism for work one client must not be able to stretch:
``corellm.serving.sandbox`` (calls in child processes that a deadline kills),
``corellm.serving.fair`` (the queue they wait in) and ``corellm.serving.lru.ByteLRU`` (a cache
bounded by bytes). In process, with small child functions."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from corellm.errors import InvalidRequestError
from corellm.serving.lru import ByteLRU
from corellm.serving.sandbox import DeadlineExceeded, Sandbox, SandboxError

_state: dict = {}


# Child functions: module-level, so the children import them by name.
def _init(tag: str) -> None:
    _state["tag"] = tag


def _sleep(seconds: float) -> tuple[str, int]:
    time.sleep(seconds)
    return _state.get("tag", ""), os.getpid()


def _refuse(field: str) -> None:
    raise InvalidRequestError(field, "refused in the child")


def _die() -> None:
    os._exit(3)


_hoard: list = []


def _grow(mib: int) -> int:
    _hoard.append(bytearray(mib << 20))
    for block in _hoard:
        block[::4096] = b"x" * len(block[::4096])       # touch every page
    return os.getpid()


def _failing_init() -> None:
    raise RuntimeError("no vocabulary")


@pytest.fixture
def sandbox():
    sb = Sandbox("test-sandbox", timeout_s=1.0, initializer=_init, initargs=lambda: ("ready",))
    yield sb
    sb.shutdown()


def test_a_call_past_its_deadline_kills_its_process_and_the_next_call_runs(sandbox):
    large = 1e9                 # large jobs all run on the one worker that takes them

    async def go():
        tag, pid = await sandbox.run_isolated(_sleep, 0, cost=large)
        assert tag == "ready" and pid != os.getpid()
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await sandbox.run_isolated(_sleep, 30, cost=large)
        assert time.perf_counter() - t0 < 5
        tag, pid2 = await sandbox.run_isolated(_sleep, 0, cost=large)
        assert tag == "ready" and pid2 != pid
        return pid
    pid = asyncio.run(go())
    assert sandbox.killed == 1 and sandbox.started == 2
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                                 # gone, not left running


def test_a_cancelled_caller_kills_its_call(sandbox):
    async def go():
        await sandbox.run_isolated(_sleep, 0, cost=1)
        task = asyncio.ensure_future(sandbox.run_isolated(_sleep, 30, cost=1, timeout_s=60))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if sandbox.killed:
                break
            await asyncio.sleep(0.05)
    asyncio.run(go())
    assert sandbox.killed == 1


def test_errors_come_back_whole_and_a_crash_is_a_sandbox_error(sandbox):
    async def go():
        with pytest.raises(InvalidRequestError) as info:
            await sandbox.run_isolated(_refuse, "structured_outputs.json", cost=1)
        assert info.value.field == "structured_outputs.json"
        with pytest.raises(SandboxError, match="died during a call"):
            await sandbox.run_isolated(_die, cost=1)
        return await sandbox.run_isolated(_sleep, 0, cost=1)
    assert asyncio.run(go())[0] == "ready"


def test_a_child_that_grew_is_replaced():
    sb = Sandbox("test-grow", timeout_s=10.0, max_growth_bytes=16 << 20)
    try:
        async def go():
            first = await sb.run_isolated(_grow, 32, cost=1)
            second = await sb.run_isolated(_grow, 1, cost=1)
            return first, second
        first, second = asyncio.run(go())
        assert first != second and sb.recycled == 1
    finally:
        sb.shutdown()


def test_an_initializer_that_fails_fails_the_call():
    sb = Sandbox("test-init", timeout_s=5.0, initializer=_failing_init)
    try:
        with pytest.raises(SandboxError, match="no vocabulary"):
            asyncio.run(sb.run_isolated(_sleep, 0, cost=1))
    finally:
        sb.shutdown()


def test_small_calls_pass_a_large_one_that_holds_its_worker(sandbox):
    """One worker takes any job, the other only small ones: while a large call runs to its
    deadline, small calls keep being answered."""
    async def go():
        await asyncio.gather(sandbox.run_isolated(_sleep, 0, cost=1),
                             sandbox.run_isolated(_sleep, 0, cost=1))
        large = asyncio.ensure_future(sandbox.run_isolated(_sleep, 30, cost=1e9))
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        for _ in range(3):
            await sandbox.run_isolated(_sleep, 0, cost=1)
        small_s = time.perf_counter() - t0
        with pytest.raises(DeadlineExceeded):
            await large
        return small_s
    assert asyncio.run(go()) < 0.9


def test_byte_lru_counts_keys_and_values():
    lru: ByteLRU[bytes, str] = ByteLRU(4096)
    lru.put(b"a" * 16, "x", 1000)
    lru.put(b"b" * 16, "y", 1000)
    assert lru.get(b"a" * 16) == "x"                 # now the most recently used
    lru.put(b"c" * 16, "z", 2000)                    # over the limit: b leaves, not a
    assert b"b" * 16 not in lru and b"a" * 16 in lru and b"c" * 16 in lru
    assert lru.nbytes <= 4096
    lru.put(b"d", "too big", 5000)                   # larger than the limit: not kept
    assert b"d" not in lru and len(lru) == 2
    big_key = "k" * 3000                  # a key counts as well as its value: it takes the
    lru.put(big_key, "v", 0)              # room of the other two
    assert big_key in lru and lru.nbytes <= 4096 and len(lru) == 1


def test_byte_lru_is_safe_across_threads():
    lru: ByteLRU[int, int] = ByteLRU(64 << 10)

    def hammer(base: int) -> None:
        for i in range(2000):
            lru.put(base + i, i, 100)
            lru.get(base + i // 2)

    threads = [threading.Thread(target=hammer, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < lru.nbytes <= 64 << 10
