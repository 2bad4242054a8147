"""Seeded workloads: what requests a benchmark sends, and when.

CONTRACT (shared by the workload generator and the runner; keep these two dataclasses stable):

* ``BenchRequest`` is one request of a workload, fully determined by the workload spec and its
  seed, so two runs against two configs see the same requests at the same times.
* A first turn (``follows is None``) is sent ``delay_s`` seconds after the run starts, with
  ``prompt_token_ids`` as its whole prompt.
* A follow-up turn of a multi-turn session (``follows = i``) is sent ``delay_s`` seconds (think
  time) after request ``i`` finished; its prompt is request ``i``'s whole prompt + request ``i``'s
  output token ids + this request's ``prompt_token_ids`` (the new user message).
* A request asks for ``output_len`` tokens (``max_tokens``). With ``ignore_eos`` (the default)
  it must return exactly that many; without it (ShareGPT, as ``vllm bench serve`` sends it
  unless ``--ignore-eos``) it may stop earlier at EOS, and a follow-up's history then holds the
  shorter output.

Below the contract: ``build_workload`` (spec + seed -> ``Workload``), ``context_lengths`` (the
context each request occupies) and ``workload_stats`` (what ``--describe`` prints). The spec they
are built from is ``workload_spec.WorkloadSpec`` (read from YAML by ``load_workload_spec``; every
field is described in the models, and ``corellm bench workload`` writes commented examples), its
distributions are in ``distributions``, and the workload of ``vllm bench serve``'s flags is
``workload_args.spec_from_vllm_args``. A spec in brief::

    name: chat                    # optional
    seed: 0
    num_requests: 64              # without sessions
    requests:
      input_len: {dist: uniform, low: 64, high: 256}    # or 128, normal, file, mixture
      output_len: 32
      prompts: random             # or {source: file, path: prompts.jsonl}
      shared_prefix: {num_groups: 4, length: 128}
    sessions: {num_sessions: 8, turns: 4, message_len: 32,
               think_time_s: {dist: exponential, mean: 2}}
    tenants: [{name: a, weight: 3}, {name: b, weight: 1}]
    priorities: [{priority: 0, weight: 1}, {priority: 1, weight: 4}]
    arrivals: {pattern: gamma, rate: 4, burstiness: 0.5}   # or poisson, all_at_once
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .distributions import arrival_times, assign_classes
from .env import gc_paused
from .workload_spec import (FilePrompts, RandomPrompts, WorkloadError, WorkloadSpec,
                            describe_spec, load_workload_spec)


@dataclass(frozen=True)
class BenchRequest:
    index: int                          # position in the workload; stable across runs
    prompt_token_ids: list[int]         # whole prompt (first turn) or the new message (follow-up)
    output_len: int                     # max_tokens; with ignore_eos exactly this many
    delay_s: float = 0.0                # arrival offset from the run start, or think time
    follows: int | None = None          # index of the previous turn of the same session
    priority: int = 0                   # lower runs first (vLLM's convention)
    user: str | None = None             # tenant (OpenAI's `user` field)
    session_id: str | None = None       # multi-turn session
    shared_prefix_group: int | None = None   # which shared-prefix group the prompt starts with
    ignore_eos: bool = True             # False: may stop at EOS before output_len (ShareGPT)
    lora_name: str | None = None        # the LoRA adapter it runs (None: the base model)
    lora_path: str | None = None        # that adapter's PEFT directory, when the spec gives it


@dataclass
class Workload:
    requests: list[BenchRequest]
    description: str                     # one line for tables and plot titles
    spec: dict[str, Any] = field(default_factory=dict)   # the spec it was built from (for JSON)


# ============================================================================ building
# Everything random is drawn from numpy generators seeded by (seed, stream): each aspect
# (lengths, tokens, arrivals, tenants, ...) has its own stream, so changing one part of a spec
# (say the tenant mix) leaves the others' draws unchanged and two workloads that differ in one
# knob are comparable request by request. These are the stream ids. Never renumber them: a
# renumbering changes every workload drawn from an existing spec and seed.
_STREAM = {"turns": 1, "arrivals": 2, "tenants": 3, "priorities": 4, "groups": 5,
           "prefixes": 6, "input_len": 7, "message_len": 8, "output_len": 9, "think": 10,
           "tokens": 11, "prompt_order": 12, "trace_sample": 13, "trace_blocks": 14,
           "adapters": 15}


def _rng(seed: int, stream: str) -> np.random.Generator:
    return np.random.default_rng([seed, _STREAM[stream]])


def draw_tokens(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    """``n`` ids drawn uniformly from ``allowed``: what ``rng.choice(allowed, size=n)`` draws
    (the same integers from the same stream; tests/test_bench_workload.py checks both
    identities relied on here), without its per-call checks, which cost more than the draw
    for one prompt."""
    return allowed[rng.integers(0, len(allowed), size=n)].tolist()


def allowed_token_ids(vocab_size: int, exclude_ids: Iterable[int] = frozenset()) -> np.ndarray:
    """Ids random prompts are drawn from: [0, vocab_size) minus ``exclude_ids``."""
    excluded = np.fromiter((int(i) for i in exclude_ids), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
    if allowed.size == 0:
        raise WorkloadError([("", f"no token ids to draw prompts from (vocab_size "
                                  f"{vocab_size}, {excluded.size} excluded)")])
    return allowed


class _FileFeed:
    """Hands out the prompts of a JSONL file in the spec's order, tokenizing text."""

    def __init__(self, prompts: FilePrompts, rng: np.random.Generator, tokenizer: Any,
                 vocab_size: int) -> None:
        self.lines = prompts._lines
        self.order = prompts.order
        self.rng = rng
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.path = prompts.path
        self.queue: list[int] = []

    def _next_index(self) -> int:
        n = len(self.lines)
        if self.order == "sample":
            return int(self.rng.integers(n))
        if not self.queue:
            self.queue = (list(range(n)) if self.order == "sequential"
                          else self.rng.permutation(n).tolist())
        return self.queue.pop(0)

    def next(self, first_turn: bool) -> tuple[list[int], int | None]:
        line = self.lines[self._next_index()]
        if line.text is not None:
            # A first turn is tokenized as a server tokenizes a text prompt (with the
            # tokenizer's special tokens, e.g. BOS); a follow-up message continues a
            # conversation, so it gets none.
            ids = list(self.tokenizer.encode(line.text, add_special_tokens=first_turn))
            if not ids:
                raise WorkloadError([("requests.prompts.path", f"{self.path}:{line.lineno}: "
                                                               "the prompt tokenizes to nothing")])
        else:
            ids = list(line.ids or [])
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise WorkloadError([("requests.prompts.path",
                                  f"{self.path}:{line.lineno}: token id {bad[0]} is outside the "
                                  f"vocabulary (size {self.vocab_size})")])
        return ids, line.output_len


def build_workload(spec: WorkloadSpec | Mapping[str, Any] | str | Path, *, vocab_size: int,
                   exclude_ids: Iterable[int] = frozenset(), seed: int | None = None,
                   tokenizer: Any = None, max_model_len: int | None = None) -> Workload:
    """Draw the requests of a workload: the same spec and seed give the same requests.

    ``vocab_size`` and ``exclude_ids`` say which token ids random prompts use (the runner passes
    what both the model and its tokenizer know, minus special tokens). ``seed`` overrides the
    spec's (``--repeats`` runs seed, seed+1, ...). ``tokenizer`` (anything with
    ``encode(text, add_special_tokens=...)``) is needed only for text prompts from a file.
    ``max_model_len``, when given, rejects a workload in which some request's context (its
    whole prompt, history included, plus its output) would not fit the model: sessions resend
    their history and outputs have exact lengths, so this is known before anything runs.

    Requests come session by session (single-turn requests are one-turn sessions), in arrival
    order; a session's turns are consecutive.
    """
    with gc_paused():           # (hundreds of thousands of new lists: no cycle among them)
        return _build_workload(spec, vocab_size=vocab_size, exclude_ids=exclude_ids, seed=seed,
                               tokenizer=tokenizer, max_model_len=max_model_len)


def _build_workload(spec: WorkloadSpec | Mapping[str, Any] | str | Path, *, vocab_size: int,
                    exclude_ids: Iterable[int], seed: int | None, tokenizer: Any,
                    max_model_len: int | None) -> Workload:
    spec = load_workload_spec(spec)
    seed = spec.seed if seed is None else int(seed)
    req = spec.requests
    prompts = req.prompts
    if isinstance(prompts, FilePrompts) and prompts.needs_tokenizer and tokenizer is None:
        raise WorkloadError([("requests.prompts.path",
                              f"{prompts.path} has text prompts (\"prompt\"), which need the "
                              "model's tokenizer: pass tokenizer= (corellm bench does)")])

    # --- the conversations (single-turn requests are one-turn conversations)
    if spec.sessions is not None:
        n_conv = spec.sessions.num_sessions
        turns = spec.sessions.turns.sample(_rng(seed, "turns"), n_conv)
    else:
        n_conv = int(spec.num_requests or 0)
        turns = np.ones(n_conv, dtype=np.int64)
    n_follow = int(turns.sum()) - n_conv
    starts = arrival_times(spec.arrivals, n_conv, _rng(seed, "arrivals"))

    def labels(items: list[Any] | None, stream: str) -> list[Any]:
        if not items:
            return [None] * n_conv
        which = assign_classes([it.weight for it in items], n_conv, _rng(seed, stream))
        return [items[int(k)] for k in which]

    tenants = [t.name if t else None for t in labels(spec.tenants, "tenants")]
    priorities = [p.priority if p else 0 for p in labels(spec.priorities, "priorities")]
    adapters = labels(spec.lora_adapters, "adapters")

    allowed = allowed_token_ids(vocab_size, exclude_ids) if isinstance(
        prompts, RandomPrompts) or req.shared_prefix else None
    groups: list[int | None] = [None] * n_conv
    prefixes: list[list[int]] = []
    if req.shared_prefix is not None:
        sp = req.shared_prefix
        groups = [int(g) for g in assign_classes([1.0] * sp.num_groups, n_conv,
                                                 _rng(seed, "groups"))]
        prefix_rng = _rng(seed, "prefixes")
        prefixes = [draw_tokens(prefix_rng, allowed, sp.length)
                    for _ in range(sp.num_groups)]

    # --- lengths and tokens, conversation by conversation
    outputs = req.output_len.sample(_rng(seed, "output_len"), n_conv + n_follow)
    think = (spec.sessions.think_time_s.sample(_rng(seed, "think"), n_follow)
             if spec.sessions is not None else np.zeros(0))
    token_rng = _rng(seed, "tokens")
    if isinstance(prompts, RandomPrompts):
        assert req.input_len is not None and allowed is not None
        first_lens = req.input_len.sample(_rng(seed, "input_len"), n_conv)
        msg_dist = (spec.sessions.message_len if spec.sessions is not None
                    and spec.sessions.message_len is not None else req.input_len)
        msg_lens = msg_dist.sample(_rng(seed, "message_len"), n_follow)
        feed = None
    else:
        feed = _FileFeed(prompts, _rng(seed, "prompt_order"), tokenizer, vocab_size)

    if feed is None:
        # Every random prompt's ids in one draw, sliced in request order: the same ids as one
        # draw per prompt (a generator's consecutive integer draws concatenate), at a fraction
        # of the cost for many short prompts.
        sizes, k = [], 0
        for c in range(n_conv):
            for t in range(int(turns[c])):
                sizes.append(int(first_lens[c]) if t == 0 else int(msg_lens[k]))
                k += t > 0
        drawn = draw_tokens(token_rng, allowed, sum(sizes))
        size_iter = iter(sizes)
        offset = 0
    requests: list[BenchRequest] = []
    k_follow = 0
    for c in range(n_conv):
        session_id = f"session-{c}" if spec.sessions is not None else None
        prev: int | None = None
        for t in range(int(turns[c])):
            index = len(requests)
            if feed is not None:
                ids, line_out = feed.next(first_turn=t == 0)
            else:
                n_tokens = next(size_iter)
                ids, line_out = drawn[offset:offset + n_tokens], None
                offset += n_tokens
            if t == 0 and groups[c] is not None:
                ids = prefixes[groups[c]] + ids
            out_len = line_out if line_out is not None else int(outputs[index])
            delay = float(starts[c]) if t == 0 else float(think[k_follow])
            if t > 0:
                k_follow += 1
            requests.append(BenchRequest(
                index=index, prompt_token_ids=ids, output_len=out_len, delay_s=delay,
                follows=prev, priority=priorities[c], user=tenants[c], session_id=session_id,
                shared_prefix_group=groups[c],
                lora_name=adapters[c].name if adapters[c] else None,
                lora_path=adapters[c].path if adapters[c] else None))
            prev = index

    if max_model_len is not None:
        ctx = context_lengths(requests)
        over = [(i, n) for i, n in enumerate(ctx) if n > max_model_len]
        if over:
            worst = max(over, key=lambda x: x[1])
            raise WorkloadError([("", f"{len(over)} request(s) need more context than "
                                      f"max_model_len {max_model_len} (request {worst[0]}: "
                                      f"{worst[1]} tokens of prompt, history and output)")])

    spec_dict = _jsonable(spec.model_dump(mode="python", exclude_none=True))
    spec_dict["seed"] = seed
    return Workload(requests, describe_spec(spec, seed=seed), spec_dict)


def _jsonable(value: Any) -> Any:
    """The spec as plain JSON: infinities become the string "inf" (which the spec accepts)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def context_lengths(requests: Sequence[BenchRequest]) -> list[int]:
    """Per request, the tokens it occupies at its end: its whole prompt (a follow-up's includes
    the session's history, each earlier output counted at its exact ``output_len``) plus its own
    output."""
    by_index = {r.index: r for r in requests}
    full_prompt: dict[int, int] = {}

    def prompt_len(r: BenchRequest) -> int:
        if r.index not in full_prompt:
            if r.follows is None:
                full_prompt[r.index] = len(r.prompt_token_ids)
            else:
                prev = by_index[r.follows]
                full_prompt[r.index] = (prompt_len(prev) + prev.output_len
                                        + len(r.prompt_token_ids))
        return full_prompt[r.index]

    # Walk in index order: the workloads built here list a turn after the one it follows, so
    # the recursion above stays one level deep.
    return [prompt_len(r) + r.output_len for r in requests]


# ============================================================================ statistics
def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not len(values):
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "min": float(a.min()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max()), "sum": float(a.sum())}


def workload_stats(workload: Workload) -> dict[str, Any]:
    """Counts, length statistics, arrival span and class shares of a built workload (what
    ``corellm bench workload --describe`` prints)."""
    reqs = workload.requests
    firsts = [r for r in reqs if r.follows is None]
    follows = [r for r in reqs if r.follows is not None]
    starts = sorted(r.delay_s for r in firsts)
    gaps = np.diff(starts) if len(starts) > 1 else np.zeros(0)
    ctx = context_lengths(reqs)
    sent_prompt = [c - r.output_len for c, r in zip(ctx, reqs)]
    return {
        "requests": len(reqs),
        "first_turns": len(firsts),
        "follow_ups": len(follows),
        "sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "new_prompt_tokens": _stats([len(r.prompt_token_ids) for r in reqs]),
        "first_turn_prompt_tokens": _stats([len(r.prompt_token_ids) for r in firsts]),
        "sent_prompt_tokens": _stats(sent_prompt),
        "output_tokens": _stats([r.output_len for r in reqs]),
        "max_context_tokens": max(ctx) if ctx else 0,
        "arrival_span_s": float(starts[-1] - starts[0]) if starts else 0.0,
        "mean_interarrival_s": float(gaps.mean()) if gaps.size else None,
        "interarrival_cv": (float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0
                            else None),
        "think_time_s": _stats([r.delay_s for r in follows]),
        "shared_prefix_groups": dict(sorted(Counter(
            r.shared_prefix_group for r in reqs if r.shared_prefix_group is not None).items())),
        "tenants": dict(sorted(Counter(r.user for r in reqs if r.user is not None).items())),
        "priorities": dict(sorted(Counter(r.priority for r in reqs).items())),
        "lora_adapters": dict(sorted(Counter(r.lora_name for r in reqs
                                             if r.lora_name is not None).items())),
    }
