"""The worker side: each constrained request's grammar, compiled in the background against the
model's vocabulary, its matcher, and one token mask per step for all of them.

A compile runs first in a compile process (``grammars.probe``), where
``logits_processors.compile_timeout_s`` can kill it, then, once it is known to finish in time,
in the worker, whose matchers need the compiled grammar (xgrammar's serialization of a large
compiled grammar costs more than compiling it again). Compiles are queued cheapest first,
costed by the constraint's shape (``corellm.serving.constraint_shape``), with one of the two compile
workers kept for small constraints (``corellm.serving.fair.FairExecutor``'s rules), so constraints
costed as expensive hold at most one worker, each for at most twice the deadline. A
constraint past the deadline twice is remembered and refused at once when it comes back. Compiled
grammars are kept by digest, up to ``logits_processors.cache_bytes``."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr

from corellm.components import BuildContext
from corellm.interfaces import LogitsProcessor, RequestsFailed
from corellm.serving.lru import ByteLRU
from corellm.sampling_params import SamplingParams
from corellm.serving.constraint_shape import constraint_shape, digest
from corellm.serving.sandbox import ChildDied, DeadlineExceeded, Sandbox
from corellm_plugins.structured_xgrammar.grammars import (GrammarRefused, compile_with,
                                                          init_compiler, probe, source)

logger = logging.getLogger(__name__)

# Defaults of logits_processors.compile_timeout_s and .cache_bytes, for a processor built
# without a config.
COMPILE_TIMEOUT_S = 10.0
CACHE_BYTES = 64 << 20
# A request also ends when its grammar's compile has not started this many times the compile
# deadline after it reached the worker (queued behind others: the deadline counts from a
# compile's start).
QUEUE_FACTOR = 3
# A constraint whose compile ran past the deadline this many times within STRIKE_TTL_S is
# refused at once (twice: one slow compile on a loaded machine does not refuse it for good).
STRIKES = 2
STRIKE_TTL_S = 600.0


class _State:
    __slots__ = ("req_id", "field", "key", "compiled", "matcher", "replay", "deadline",
                 "start", "seen")

    def __init__(self, req_id: str, field: str, key: bytes, compiled: Future, replay: list[int],
                 deadline: float, start: list[int] | None = None,
                 seen: list[int] | None = None) -> None:
        self.req_id = req_id
        self.field = field              # the request field of the constraint
        self.key = key                  # its digest
        self.compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self.replay = replay            # output tokens kept through a preemption
        self.deadline = deadline
        # start_after: the tokens still awaited before the constraint applies (None: it
        # applies), and the last tokens generated while waiting for them.
        self.start = start
        self.seen = seen or []


def _split_at(tokens: Sequence[int], marker: Sequence[int]) -> int | None:
    """The index just past the first occurrence of ``marker`` in ``tokens``, or None."""
    m = len(marker)
    for i in range(len(tokens) - m + 1):
        if list(tokens[i:i + m]) == list(marker):
            return i + m
    return None


class XGrammarProcessor(LogitsProcessor):
    """``tokenizer_info``: xgrammar's view of the vocabulary, or a function making it, called
    (in a compile worker) by the first constrained request: an engine that never gets one never
    loads the tokenizer for it, and a checkpoint without a tokenizer fails only such requests."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo],
                 vocab_size: int, compile_timeout_s: float | None = None,
                 cache_bytes: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.compile_timeout_s = (COMPILE_TIMEOUT_S if compile_timeout_s is None
                                  else compile_timeout_s)
        self.cache = ByteLRU[bytes, xgr.CompiledGrammar](
            CACHE_BYTES if cache_bytes is None else cache_bytes)
        # Constraints whose compile ran past the deadline (or ended its process): refused at
        # once when they come back, after STRIKES failures within STRIKE_TTL_S.
        self.too_slow = ByteLRU[bytes, tuple[int, float]](1 << 20)
        self._inflight: dict[bytes, list[Any]] = {}     # digest -> [future, waiters]
        self._inflight_lock = threading.Lock()
        self._info_json: str | None = None
        # The compile queue and its two workers, each driving a compile process; shut down with
        # the processor.
        # Its initargs reach this processor through a weak reference only, so the processor
        # can be collected, and the pool then shut down.
        method = weakref.WeakMethod(self._compile_process_args)
        self.pool = Sandbox("xgrammar-compile", timeout_s=self.compile_timeout_s,
                            preload=["corellm_plugins.structured_xgrammar.grammars"],
                            initializer=init_compiler, initargs=lambda: method()())
        weakref.finalize(self, self.pool.shutdown)
        self._bitmask: torch.Tensor | None = None

    @classmethod
    def for_engine(cls, ctx: BuildContext) -> XGrammarProcessor:
        from corellm.checkpoint.reader import load_generation_eos_ids, model_path

        vocab = ctx.setup.arch.vocab_size

        def tokenizer_info() -> xgr.TokenizerInfo:
            path = model_path(ctx.config)
            tokenizer = ctx.tokenizer()
            # The ids that end a request here: a finished grammar allows only these.
            stops = list(dict.fromkeys(
                [i for i in [tokenizer.eos_token_id, *load_generation_eos_ids(path)]
                 if i is not None and i < vocab]))
            return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                      stop_token_ids=stops or None)
        section = ctx.config.logits_processors
        return cls(tokenizer_info, vocab, section.compile_timeout_s, section.cache_bytes)

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                if callable(self._info):
                    self._info = self._info()
                # No cache of xgrammar's own: it counts the compiled grammars, not their keys
                # (a schema's whole text); self.cache counts both.
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2,
                                                     cache_enabled=False)
            return self._compiler

    def _compile_process_args(self) -> tuple[str]:
        """``init_compiler``'s arguments, for each compile process that starts (the vocabulary,
        serialized once)."""
        if self._info_json is None:
            self.compiler                   # noqa: B018 - makes the tokenizer info
            assert isinstance(self._info, xgr.TokenizerInfo)
            self._info_json = self._info.serialize_json()
        return (self._info_json,)

    def _compile(self, kind: str, text: str, key: bytes) -> xgr.CompiledGrammar:
        """A compile job (on a compile worker): probed in its compile process, then compiled
        here and kept. A probe past the deadline, or one that killed its process, is
        remembered."""
        compiled = self.cache.get(key)
        if compiled is None:
            try:
                self.pool.call(probe, kind, text)
            except (DeadlineExceeded, ChildDied):
                self.too_slow.put(key, (self._failures(key) + 1, time.monotonic()), 0)
                raise
            compiled = compile_with(self.compiler, kind, text)
            self.cache.put(key, compiled, compiled.memory_size_bytes)
        return compiled

    def _submit(self, so: SamplingParams, kind: str, text: str, key: bytes) -> Future:
        """The compiled grammar of (kind, text): from the cache, a compile in progress (shared
        by the requests that wait for it), or a new compile job, costed by the constraint's
        shape (``corellm.serving.constraint_shape``)."""
        fut: Future = Future()
        if self._failures(key) >= STRIKES:
            fut.set_exception(DeadlineExceeded(self.compile_timeout_s))
            return fut
        done = self.cache.get(key)
        if done is not None:
            fut.set_result(done)
            return fut
        cost = constraint_shape(so).cost + 1
        with self._inflight_lock:
            entry = self._inflight.get(key)
            new = entry is None
            if new:
                fut, = self.pool.submit([lambda: self._compile(kind, text, key)], [cost])
                entry = self._inflight[key] = [fut, 0]
            entry[1] += 1
            fut = entry[0]
        if new:
            # Outside the lock: a future already done runs the callback in this thread.
            fut.add_done_callback(lambda _: self._forget(key, fut))
        return fut

    def _failures(self, key: bytes) -> int:
        """How many times the compile of ``key`` ran past the deadline (or ended its process)
        within the last ``STRIKE_TTL_S``."""
        entry = self.too_slow.get(key)
        if entry is None or time.monotonic() - entry[1] > STRIKE_TTL_S:
            return 0
        return entry[0]

    def _forget(self, key: bytes, fut: Future) -> None:
        with self._inflight_lock:
            if self._inflight.get(key, [None])[0] is fut:
                del self._inflight[key]

    # ------------------------------------------------------------------ LogitsProcessor
    def new_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> _State | None:
        if params.structured_outputs is None:
            return None
        so = params.structured_outputs
        kind, text = source(so)
        key = digest(kind, text)
        replay, start, seen = list(output_token_ids), None, None
        if so.start_after:
            cut = _split_at(replay, so.start_after)
            if cut is None:         # still before the constrained part
                start, seen = so.start_after, replay[-len(so.start_after):]
                replay = []
            else:
                replay = replay[cut:]
        return _State(req_id, f"structured_outputs.{so.kind}", key,
                      self._submit(so, kind, text, key), replay,
                      time.monotonic() + QUEUE_FACTOR * self.compile_timeout_s, start, seen)

    def ready(self, state: Any) -> bool:
        if state.start is not None:
            return True                 # free until start_after: nothing to wait for yet
        # Still queued past its bound, a state is "ready" to be failed by apply; a compile that
        # has started ends by its own deadline (the compile process is killed at it).
        return (state.matcher is not None or state.compiled.done()
                or (not state.compiled.running() and time.monotonic() >= state.deadline))

    def _make_matcher(self, state: _State) -> tuple[str, str] | None:
        """Make ``state``'s matcher from its compiled grammar; else why not, and whose fault:
        "invalid" (its constraint takes too long to compile), "busy" (others' compiles ahead
        of it) or "failed"."""
        if not state.compiled.done():
            return (f"the compiles of other constraints kept its own from starting for "
                    f"{QUEUE_FACTOR * self.compile_timeout_s:g} s; retry", "busy")
        try:
            compiled = state.compiled.result()
        except DeadlineExceeded:
            return (f"{state.field}: its grammar was not compiled against the model's "
                    f"vocabulary within {self.compile_timeout_s:g} s "
                    "(logits_processors.compile_timeout_s); simplify it", "invalid")
        except ChildDied:
            return (f"{state.field}: compiling its grammar against the model's vocabulary "
                    "ended the compile process (out of memory, or a crash in xgrammar); "
                    "simplify it", "invalid")
        except GrammarRefused as exc:
            return f"{state.field}: xgrammar cannot compile it: {exc}", "invalid"
        except Exception as exc:
            return f"its grammar did not compile: {exc!r}", "failed"
        matcher = xgr.GrammarMatcher(compiled)
        for token in state.replay:          # the tokens it kept through a preemption
            if not matcher.accept_token(token):
                return f"its grammar rejects token {token} it had generated before", "failed"
        state.matcher, state.replay = matcher, []
        return None

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> None:
        ended: dict[str, dict[str, str]] = {"failed": {}, "invalid": {}, "busy": {}}
        masked_rows: list[int] = []
        masked: list[_State] = []
        for row, state in zip(rows, states):
            if state.start is not None:
                continue                # before start_after: the output is free
            if state.matcher is None:
                why = self._make_matcher(state)
                if why is not None:
                    ended[why[1]][state.req_id] = why[0]
                    continue
            # A finished grammar (its end accepted, the request going on: ignore_eos) leaves
            # the rest of the output free.
            if not state.matcher.is_terminated():
                masked_rows.append(row)
                masked.append(state)
        if masked:
            # xgrammar's mask has one row per logits row; only the constrained ones are filled
            # and applied (indices), the others keep their logits.
            n = logits.shape[0]
            if self._bitmask is None or self._bitmask.shape[0] < n:
                self._bitmask = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
            bitmask = self._bitmask[:n]
            for row, state in zip(masked_rows, masked):
                state.matcher.fill_next_token_bitmask(bitmask, row)
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size,
                indices=masked_rows)
        if any(ended.values()):
            raise RequestsFailed(ended["failed"], ended["invalid"], ended["busy"])

    def accept(self, state: Any, token_id: int) -> bool:
        if state.start is not None:
            state.seen = (state.seen + [token_id])[-len(state.start):]
            if state.seen == state.start:
                state.start = None      # the constraint applies from the next token
            return True
        if state.matcher is None:
            return False
        return state.matcher.is_terminated() or state.matcher.accept_token(token_id)

    def free(self, state: Any) -> None:
        # A compile that no other request waits for, and that has not started, leaves the queue.
        with self._inflight_lock:
            entry = self._inflight.get(state.key)
            if entry is None or entry[0] is not state.compiled:
                return
            entry[1] -= 1
            if entry[1]:
                return
        # Outside the lock: a cancelled future runs its callbacks (_forget) in this thread.
        state.compiled.cancel()

    def shutdown(self) -> None:
        self.pool.shutdown()
