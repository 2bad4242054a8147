"""Engine-client side output processing, shared by the offline ``LLM`` and the server's
``AsyncLLM``: fan a request out into ``n`` engine-core requests, detokenize incrementally, match
stop strings, and assemble ``RequestOutput``s (whole, or as deltas for streaming).

This runs where the text is needed (the API process when serving), so the engine core never
detokenizes and never waits for it. A stop string found here finishes the sample at once and
tells the caller which engine-core requests to abort, which frees their KV blocks.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corellm.engine.stop_strings import StopStringMatcher, stop_string_matcher
from corellm.errors import InvalidRequestError
from corellm.outputs import (CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics,
                             RequestOutput)
from corellm.request import EngineCoreRequest

_U63 = (1 << 63) - 1


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = 0      # everything so far, every time
    DELTA = 1           # only what is new since the last output (streaming)
    FINAL_ONLY = 2      # one output, when every sample has finished


_TOKENIZERS_BACKEND: list[Any] = []


def raw_decoder(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer, where
    calling it directly returns what ``tokenizer.decode`` would: transformers 5's
    ``TokenizersBackend``, whose ``decode`` and ``_decode`` neither the class nor the instance
    overrides (``_decode`` calls the Rust decode, then cleans up spaces only if asked to), and
    no clean-up asked for. Else None: decode through transformers. The wrapper first converts
    its input element by element (``to_py_obj``): for the two few-token decodes of each
    generated token that costs more than the decoding itself, a visible share of a
    decode-heavy run's time."""
    if not _TOKENIZERS_BACKEND:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:         # transformers 4: decode through it
            TokenizersBackend = None
        _TOKENIZERS_BACKEND.append(TokenizersBackend)
    base = _TOKENIZERS_BACKEND[0]
    if (base is None or not isinstance(tokenizer, base)
            or type(tokenizer)._decode is not base._decode
            or type(tokenizer).decode is not base.decode
            or {"decode", "_decode"} & vars(tokenizer).keys()
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    decode = getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)
    if decode is None:
        return None
    return lambda ids, skip_special_tokens: decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each step decodes a short window, ``ids[prefix:]``, and emits what it adds to
    ``ids[prefix:read]``; a window whose text ends in U+FFFD (a multi-byte character split
    across tokens) waits for the next token. Differencing two decodes of the same window keeps
    whatever the tokenizer does at a window's start (SentencePiece dropping a leading space)
    out of the delta, so the concatenated deltas equal ``tokenizer.decode(all ids)`` (tested
    against it on random token streams in tests/test_output_processor.py). Cost: two decodes of
    a few tokens per step, whatever the length of the output.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset",
                 "_raw_decode")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # No tokenizer (skip_tokenizer_init): the ids are kept, and no text is made.
        self._raw_decode = raw_decoder(tokenizer) if tokenizer is not None else None

    def _decode(self, ids: list[int]) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: Iterable[int], final: bool = False) -> str:
        """Append tokens and return the text they complete ("" while a character is split).
        ``final`` flushes whatever is held back."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        if self.read_offset == len(self.token_ids) and not final:
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (window_text.endswith("\ufffd") or len(window_text) <= len(prefix_text)):
            return ""
        delta = window_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta


@dataclass
class _Sample:
    """One of a request's ``n`` samples, as the client sees it."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0          # DELTA bookkeeping: what earlier outputs carried
    num_sent_chars: int = 0
    stop_state: int = StopStringMatcher.INITIAL   # the stop-string automaton's state after text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """A caller's request: its ``n`` samples, each one engine-core request."""

    def __init__(self, request_id: str, prompt: str | None, core_request: EngineCoreRequest,
                 tokenizer: Any, kind: RequestOutputKind, queue: Any = None,
                 token_texts: dict[int, str] | None = None) -> None:
        params = core_request.sampling_params
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = core_request.prompt_token_ids
        self.params = params
        self.kind = kind
        self.queue = queue              # AsyncLLM: where outputs go (None: returned to the caller)
        self.tokenizer = tokenizer
        # Token id -> tokenizer.decode([id]), for logprobs (the OutputProcessor shares one dict
        # among its requests: the vocabulary bounds it).
        self.token_texts: dict[int, str] = {} if token_texts is None else token_texts
        self.metrics = RequestMetrics(core_request.arrival_time)
        self.num_cached_tokens = 0
        self.abort_reason: str | None = None   # set when aborted (e.g. "client_disconnected")
        want_logprobs = params.logprobs is not None
        self.samples = [_Sample(i, IncrementalDetokenizer(tokenizer, params.skip_special_tokens),
                                logprobs=[] if want_logprobs else None,
                                cumulative_logprob=0.0 if want_logprobs else None)
                        for i in range(params.n)]
        self.num_unfinished = params.n
        # Stop strings: one automaton for every sample (each keeps its own state in
        # ``_Sample.stop_state``), shared with other requests sending the same list.
        self.stop_matcher = stop_string_matcher(params.stop) if params.stop else None
        # Hold back this many characters while streaming, so that text that may turn out to
        # begin a stop string is never sent and then retracted.
        self.stop_holdback = 0 if params.include_stop_str_in_output or not params.stop \
            else max(map(len, params.stop)) - 1
        self.child_ids = ([request_id] if params.n == 1
                          else [f"{request_id}#{j}" for j in range(params.n)])
        self.core_requests = [core_request] if params.n == 1 else [
            dataclasses.replace(
                core_request, request_id=cid, group_id=core_request.group_id or request_id,
                sampling_params=dataclasses.replace(
                    params, n=1,
                    # Sample 0 keeps the seed (same tokens as n=1); the others derive their own.
                    seed=params.seed if params.seed is None or j == 0
                    else hash((params.seed, j)) & _U63))
            for j, cid in enumerate(self.child_ids)]

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def abort(self, reason: str, now: float) -> None:
        """End the request unfinished: its unfinished samples get finish_reason "abort"."""
        self.abort_reason = reason
        for s in self.samples:
            if not s.finished:
                self._finish(s, "abort", reason, now)

    def unfinished_child_ids(self) -> list[str]:
        return [cid for cid, s in zip(self.child_ids, self.samples) if not s.finished]

    # ------------------------------------------------------------------ one delta
    def update(self, index: int, out: EngineCoreOutput, now: float) -> bool:
        """Apply one engine-core delta to sample ``index``. Returns True when it finishes the
        sample early on a stop string (the caller aborts it in the core)."""
        s = self.samples[index]
        if s.finished:
            return False               # e.g. the core's echo of a stop-string abort
        m = self.metrics
        if out.first_scheduled_time and (m.first_scheduled_time is None
                                         or out.first_scheduled_time < m.first_scheduled_time):
            m.first_scheduled_time = out.first_scheduled_time
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        stopped_here = False
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            elif now != m.last_token_time:    # n > 1: samples of one step arrive together
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
            s.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and s.logprobs is not None:
                self._add_logprobs(s, out)
            text_ids = out.new_token_ids
            if (out.finished and out.finish_reason == "stop"
                    and not self.params.include_stop_str_in_output):
                # The token that stopped the request (EOS, a stop_token_ids entry) is kept in
                # token_ids but not in the text, as vLLM does: with skip_special_tokens off, a
                # "</s>" would otherwise end the text (and a tool parser's output).
                text_ids = text_ids[:-1]
            delta = s.detokenizer.add_tokens(text_ids, final=out.finished)
            if delta:
                stopped_here = self._append_text(s, delta)
        elif out.finished:
            delta = s.detokenizer.add_tokens((), final=True)
            if delta:
                stopped_here = self._append_text(s, delta)
        if stopped_here:
            self._finish(s, "stop", s.stop_reason, now)
        elif out.finished:
            self._finish(s, out.finish_reason, out.stop_reason, now)
        return stopped_here

    def _append_text(self, s: _Sample, delta: str) -> bool:
        """Add detokenized text; on a stop string, cut the text there and return True.

        Only a match that ends in the new text is new: one wholly in older text came before
        ``min_tokens`` (text then still advances the automaton, so that a match spanning it and
        the new text is found, but its own matches are dropped). Of the new matches, the one that
        starts first wins, then the one listed first in ``params.stop``."""
        start = len(s.text)
        s.text += delta
        matcher = self.stop_matcher
        if matcher is None:
            return False
        if len(s.token_ids) < self.params.min_tokens:
            s.stop_state = matcher.advance(s.stop_state, delta)
            return False
        s.stop_state, match = matcher.feed(s.stop_state, delta)
        if match is None:
            return False
        rel, k = match
        i, stop = start + rel, matcher.stops[k]
        params = self.params
        s.text = s.text[:i + len(stop)] if params.include_stop_str_in_output else s.text[:i]
        s.stop_reason = stop
        return True

    def _add_logprobs(self, s: _Sample, out: EngineCoreOutput) -> None:
        # Without a tokenizer (skip_tokenizer_init) the tokens have no text.
        decode = self.tokenizer.decode if self.tokenizer is not None else lambda ids: None
        texts = self.token_texts
        lp = out.new_logprobs
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_ranks):
            t = ids[0]
            text = texts.get(t)
            if text is None:
                text = texts[t] = decode([t])
            entry = {t: Logprob(lps[0], rank, text)}
            for r, (t, v) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if t not in entry:
                    text = texts.get(t)
                    if text is None:
                        text = texts[t] = decode([t])
                    entry[t] = Logprob(v, r, text)
            s.logprobs.append(entry)
            s.cumulative_logprob += lps[0]

    def _finish(self, s: _Sample, reason: str | None, stop_reason: int | str | None,
                now: float) -> None:
        s.finish_reason = reason
        s.stop_reason = stop_reason
        self.num_unfinished -= 1
        if self.num_unfinished == 0:
            self.metrics.finished_time = now

    # ------------------------------------------------------------------ what the caller sees
    def make_output(self, changed: Iterable[int]) -> RequestOutput | None:
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            return self._output(range(len(self.samples)), delta=False)
        if self.kind is RequestOutputKind.CUMULATIVE:
            return self._output(range(len(self.samples)), delta=False)
        return self._output(changed, delta=True)

    def _output(self, indices: Iterable[int], delta: bool) -> RequestOutput | None:
        completions = []
        for i in indices:
            s = self.samples[i]
            if delta:
                # Text may lag tokens (a split character, a held-back possible stop string).
                upto = len(s.text) if s.finished else max(len(s.text) - self.stop_holdback,
                                                          s.num_sent_chars)
                text = s.text[s.num_sent_chars:upto]
                ids = s.token_ids[s.num_sent_tokens:]
                logprobs = None if s.logprobs is None else s.logprobs[s.num_sent_tokens:]
                if not text and not ids and not s.finished:
                    continue
                s.num_sent_chars, s.num_sent_tokens = upto, len(s.token_ids)
            else:
                text, ids = s.text, list(s.token_ids)
                logprobs = None if s.logprobs is None else list(s.logprobs)
            completions.append(CompletionOutput(
                index=s.index, text=text, token_ids=ids, cumulative_logprob=s.cumulative_logprob,
                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        if not completions:
            return None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                             metrics=self.metrics)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]          # for states without a queue
    reqs_to_abort: list[str]                      # engine-core ids finished here (stop strings)
    finished: list[RequestState]                  # requests that finished in this batch


class OutputProcessor:
    """Tracks every request a client has in flight, keyed by engine-core request id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}         # token id -> decode([id]), for logprobs
        self.requests: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, core_request: EngineCoreRequest,
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    queue: Any = None) -> RequestState:
        """Register a request; send ``state.core_requests`` to the engine core."""
        state = RequestState(request_id, prompt, core_request, self.tokenizer, kind, queue,
                             self._token_texts)
        if request_id in self.requests or any(c in self._children for c in state.child_ids):
            raise InvalidRequestError("request_id", f"{request_id!r} (or one of its samples' "
                                      "ids) is already in flight")
        self.requests[request_id] = state
        for j, cid in enumerate(state.child_ids):
            self._children[cid] = (state, j)
        return state

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests; returns their engine-core ids that have not finished."""
        child_ids: list[str] = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            child_ids.extend(state.unfinished_child_ids())
            for cid in state.child_ids:
                self._children.pop(cid, None)
        return child_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput],
                        now: float | None = None) -> ProcessedOutputs:
        outputs = outputs if isinstance(outputs, Sequence) else list(outputs)
        return self.process_outputs_for(outputs, 0, math.inf, now)[0]

    def process_outputs_for(self, outputs: Sequence[EngineCoreOutput], start: int,
                            budget_s: float, now: float | None = None,
                            ) -> tuple[ProcessedOutputs, int]:
        """Process ``outputs[start:]`` until ``budget_s`` seconds have passed (one output at
        least); return the result and the index to resume from (``len(outputs)`` when done).
        A caller on an event loop yields between slices, so one huge batch cannot hold it."""
        now = time.time() if now is None else now
        deadline = time.perf_counter() + budget_s
        touched: dict[str, tuple[RequestState, list[int]]] = {}
        to_abort: list[str] = []
        i = start
        while i < len(outputs):
            out = outputs[i]
            i += 1
            owner = self._children.get(out.request_id)
            if owner is not None:
                state, index = owner
                if not state.samples[index].finished:  # else e.g. a stop-string abort's echo
                    if state.update(index, out, now):
                        to_abort.append(out.request_id)
                    touched.setdefault(state.request_id, (state, []))[1].append(index)
            # (owner None: aborted by the caller meanwhile)
            if time.perf_counter() >= deadline:
                break
        result = ProcessedOutputs([], to_abort, [])
        for state, changed in touched.values():
            out = state.make_output(changed)
            if out is not None:
                if state.queue is None:
                    result.request_outputs.append(out)
                else:
                    state.queue.put_nowait(out)
            if state.finished:
                result.finished.append(state)
                del self.requests[state.request_id]
                for cid in state.child_ids:
                    self._children.pop(cid, None)
        return result, i
