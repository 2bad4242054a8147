"""What a request costs before it reaches the engine: JSON bodies become token ids (chat
templates, tokenization) on worker threads shared by every client.

Two things keep one client's bodies from holding up everyone else's:

- **A bound on the text to tokenize** (``TextBound``): a text with more characters than
  ``max_model_len`` tokens can stand for is refused before it is tokenized. Tokenizing a long
  text is the costliest thing a request does here (figures: docs/server.md); refused by its
  length, it costs nothing.
- **A fair queue** (``FairExecutor``): the cheapest job first, with aging, and a worker kept for
  small jobs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[float, int, float, Future, Callable[[], Any]]    # key, order, cost, future, work


class FairExecutor:
    """Runs preprocessing jobs (parsing large bodies, chat templates, tokenizing) off the event
    loop, cheapest first, with aging.

    Each job comes with an estimate of its cost (about a microsecond a unit: a character to
    tokenize). It is queued under the key ``AGING * W + cost``, where ``W`` is the work clock:
    the total cost of the jobs started so far; the smallest key runs first. So a small job
    passes the large ones queued before it, which keeps a one-token completion from waiting
    behind twenty 1 MiB chat bodies; yet a large job is passed by a later, smaller one only
    while the work started since it arrived is less than ``1 / AGING`` times the difference in
    their costs, so it is never starved: it waits for at most about ``1 / AGING`` times its own
    cost in later clients' work.

    Neither FIFO nor a round-robin per connection or per client address would do: requests
    from one host each come on a connection of their own, and the victim of a FIFO waits for
    everything queued before it. Keys counted from the key of the last job started (the virtual
    time of start-time fair queueing) would not do either: when twenty jobs of equal cost
    arrive together, starting the first moves that clock to their common key, and a small job
    arriving next queues behind the other nineteen. The work clock moves by the work actually
    started, and only ``AGING`` of it counts against a newcomer.

    The jobs of one request (the prompts of a completions request) are chained: each one's key
    adds its cost to the previous one's, so a request of 128 prompts counts as one large job
    that other clients' small jobs pass, and not as 128 small ones.

    A job runs to its end once started. Two threads run them: one takes any job, the other only
    jobs of at most ``SMALL_COST`` (about 4 ms), so a small job never waits for a large one that
    is running (a 1 MiB prompt that fits the context of a large model, or a 1 MiB /tokenize
    prompt, keeps the tokenizer busy for many small jobs' worth). Not more threads, and no large
    jobs on the second: parsing JSON and rendering Jinja hold the GIL (only the Rust tokenizer's
    encode releases it), so two large jobs at once take no less time than one after the other,
    and each thread that holds the GIL delays every step of the event loop.
    """

    AGING = 1 / 8
    SMALL_COST = 4_096

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._small: list[_Job] = []
        self._large: list[_Job] = []
        self._work = 0.0                    # the work clock: the cost of every job started
        self._order = itertools.count()     # equal keys run in arrival order
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(small_only,), daemon=True,
                             name=f"{name}-{'small' if small_only else 'any'}")
            for small_only in (False, True)]
        for t in self._threads:
            t.start()

    def submit(self, jobs: Sequence[Callable[[], Any]], costs: Sequence[float]) -> list[Future]:
        """Queue one request's jobs, chained (see the class); a cost counts as at least 1."""
        futures: list[Future] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the preprocessing pool is shut down")
            key = self.AGING * self._work
            for job, cost in zip(jobs, costs, strict=True):
                cost = max(cost, 1.0)
                key += cost
                fut: Future = Future()
                heapq.heappush(self._small if cost <= self.SMALL_COST else self._large,
                               (key, next(self._order), cost, fut, job))
                futures.append(fut)
            self._wake.notify_all()
        return futures

    async def run(self, job: Callable[[], T], cost: float) -> T:
        fut, = self.submit([job], [cost])
        return await asyncio.wrap_future(fut)

    async def run_all(self, jobs: Sequence[Callable[[], T]], costs: Sequence[float]) -> list[T]:
        """The results of one request's jobs, in order; the first failure cancels the rest."""
        waits = [asyncio.wrap_future(f) for f in self.submit(jobs, costs)]
        try:
            return list(await asyncio.gather(*waits))
        finally:
            for w in waits:
                w.cancel()            # queued jobs of a failed or cancelled request never run

    def _next(self, small_only: bool) -> _Job | None:
        """The queued job of the smallest key this thread may run (under the lock)."""
        queues = [q for q in ((self._small,) if small_only else (self._small, self._large)) if q]
        if not queues:
            return None
        return heapq.heappop(min(queues, key=lambda q: q[0][:2]))

    def _serve(self, small_only: bool) -> None:
        while True:
            with self._lock:
                while not self._closed and (job := self._next(small_only)) is None:
                    self._wake.wait()
                if self._closed:
                    return
                _, _, cost, fut, work = job
                if not fut.set_running_or_notify_cancel():
                    continue
                self._work += cost
            try:
                result = work()
            except BaseException as exc:        # noqa: BLE001 - handed to the waiting request
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self) -> None:
        """Stop the threads once their running jobs end; queued jobs are cancelled."""
        with self._lock:
            self._closed = True
            queued = self._small + self._large
            self._small, self._large = [], []
            self._wake.notify_all()
        for *_, fut, _ in queued:
            fut.cancel()


# --------------------------------------------------------------------------- the text bound
# Pre-tokenizers that keep every character of their input (in some piece). Whitespace splitting
# (BERT's) drops the spaces: a text of a million spaces would be no tokens at all.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts",
                                     "Split", "Punctuation"})


def _keeps_every_character(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_every_character(p) for p in pre.get("pretokenizers", ()))
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of (normalized) text that one token of ``tokenizer`` stands for, or
    None where no such bound holds.

    It holds for a BPE tokenizer that turns every character into tokens: over bytes (GPT-2,
    Llama 3, Qwen, SmolLM), with byte fallback (Llama 2, Mistral, Gemma), or with one unknown
    token per unknown character; and whose pre-tokenizer and added tokens drop nothing (no
    whitespace splitting, no added token that strips the spaces around it). Then a token stands
    for at most as many characters as its string in the vocabulary has: a byte-level token's
    string has one character per byte and a character is at least one byte; a byte-fallback
    token (``<0xE2>``) stands for less than one character.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    model = backend.model
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else None
    over_bytes = '"ByteLevel"' in json.dumps(pre)
    if not (over_bytes or model.byte_fallback or (model.unk_token and not model.fuse_unk)):
        return None
    if not _keeps_every_character(pre):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    return max(map(len, tokenizer.get_vocab()), default=None)


class TextBound:
    """Whether a text can fit in ``max_tokens`` tokens, decided from its length: a text of more
    than ``max_chars_per_token x max_tokens`` characters (after the tokenizer's normalizer,
    which may compose or drop characters) cannot. Without a bound every text may fit."""

    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.per_token = max_chars_per_token(tokenizer)
        self.max_chars = None if self.per_token is None else self.per_token * max_tokens
        normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
        self._normalize = normalizer.normalize_str if normalizer is not None else None

    def excess(self, text: str) -> int:
        """0 when ``text`` may fit; else its length in characters, which cannot."""
        if self.max_chars is None or len(text) <= self.max_chars:
            return 0
        n = len(self._normalize(text)) if self._normalize is not None else len(text)
        return n if n > self.max_chars else 0
