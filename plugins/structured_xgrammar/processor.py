"""The worker side: each constrained request's grammar, compiled in the background against the
model's vocabulary, its matcher, and one token mask per step for all of them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from corellm.components import BuildContext
from corellm.interfaces import LogitsProcessor, RequestsFailed
from corellm.sampling_params import SamplingParams
from corellm_plugins.structured_xgrammar.grammars import (GRAMMAR, JSON_OBJECT, JSON_SCHEMA,
                                                          REGEX, source)

logger = logging.getLogger(__name__)

# Compiled grammars are kept (by xgrammar's compiler) up to this many bytes: a server that sees
# many schemas keeps the recent ones, never all of them.
CACHE_LIMIT_BYTES = 256 << 20
# A request whose grammar is not compiled this long after it reached the worker ends ("error")
# instead of holding its batch back.
COMPILE_TIMEOUT_S = 30.0


class _State:
    __slots__ = ("req_id", "compiled", "matcher", "replay", "deadline")

    def __init__(self, req_id: str, compiled: Future, replay: list[int], deadline: float,
                 ) -> None:
        self.req_id = req_id
        self.compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self.replay = replay            # output tokens kept through a preemption
        self.deadline = deadline


class XGrammarProcessor(LogitsProcessor):
    """``tokenizer_info``: xgrammar's view of the vocabulary, or a function making it, called
    (in the compile pool) by the first constrained request: an engine that never gets one never
    loads the tokenizer for it, and a checkpoint without a tokenizer fails only such requests."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo],
                 vocab_size: int, compile_timeout_s: float | None = None) -> None:
        self.vocab_size = vocab_size
        self._info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.compile_timeout_s = (COMPILE_TIMEOUT_S if compile_timeout_s is None
                                  else compile_timeout_s)
        # Compilations run off the step loop, two at a time: a pathological grammar (xgrammar
        # cannot stop one) ends its own request at the bound and holds one thread, not both.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="xgrammar-compile")
        self._bitmask: torch.Tensor | None = None

    @classmethod
    def for_engine(cls, ctx: BuildContext) -> XGrammarProcessor:
        from corellm.model_config import load_generation_eos_ids, model_path

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
        return cls(tokenizer_info, vocab)

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = self._info() if callable(self._info) else self._info
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiler = self.compiler
        if kind == JSON_SCHEMA:
            # Compact JSON (vLLM's disable_any_whitespace): a small model let free to put
            # whitespace anywhere may never stop putting it.
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == JSON_OBJECT:
            return compiler.compile_builtin_json_grammar()
        if kind == REGEX:
            return compiler.compile_regex(text)
        assert kind == GRAMMAR
        return compiler.compile_grammar(text)

    # ------------------------------------------------------------------ LogitsProcessor
    def new_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> _State | None:
        if params.structured_outputs is None:
            return None
        kind, text = source(params.structured_outputs)
        return _State(req_id, self.pool.submit(self._compile, kind, text),
                      list(output_token_ids), time.monotonic() + self.compile_timeout_s)

    def ready(self, state: Any) -> bool:
        # Past its bound, a state is "ready" to be failed by apply.
        return (state.matcher is not None or state.compiled.done()
                or time.monotonic() >= state.deadline)

    def _make_matcher(self, state: _State) -> str | None:
        """Make ``state``'s matcher from its compiled grammar; why not, or None."""
        if not state.compiled.done():
            return f"its grammar was not compiled within {self.compile_timeout_s:g} s"
        try:
            compiled = state.compiled.result()
        except Exception as exc:
            return f"its grammar did not compile: {exc}"
        matcher = xgr.GrammarMatcher(compiled)
        for token in state.replay:          # the tokens it kept through a preemption
            if not matcher.accept_token(token):
                return f"its grammar rejects token {token} it had generated before"
        state.matcher, state.replay = matcher, []
        return None

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> None:
        failed: dict[str, str] = {}
        masked_rows: list[int] = []
        masked: list[_State] = []
        for row, state in zip(rows, states):
            if state.matcher is None:
                why = self._make_matcher(state)
                if why is not None:
                    failed[state.req_id] = why
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
        if failed:
            raise RequestsFailed(failed)

    def accept(self, state: Any, token_id: int) -> bool:
        if state.matcher is None:
            return False
        return state.matcher.is_terminated() or state.matcher.accept_token(token_id)

    def free(self, state: Any) -> None:
        state.compiled.cancel()
