"""The model runner's persistent batch: one row per running request, kept across steps.

A request gets a row when the plan first schedules it (or schedules it again after preemption)
and keeps it until it finishes or is preempted; the row is then free for the next request
(lowest free row first, so the live rows stay packed). Everything a step needs of a request is
in fixed-size numpy arrays indexed by row:

* ``token_ids`` [rows, width] int32: prompt and output so far (``num_tokens`` of them). The
  width starts at ``min(max_model_len, 1024)`` and doubles when a request needs more, so a
  server that never sees a long request never pays for ``max_model_len`` columns; at most
  ``rows * max_model_len * 4`` bytes (256 rows at 32k tokens: 32 MiB).
* ``block_table`` [rows, ceil(max_model_len / block_size)] int64 (the dtype of
  ``CommonAttentionMetadata.block_table``), zero past each row's ``num_blocks``.
* ``num_computed``, ``num_tokens``, ``num_prompt`` [rows] int64.
* ``lora_slot`` [rows] int64: the device slot of the request's LoRA adapter (-1: none).
* The sampling parameters as columns, written once when the row is filled: float32
  temperature (0 for greedy rows, clamped to float32's max), top-p, min-p and the three
  penalties; int64 top-k (resolved: the vocabulary where off) and logprobs (-1: none); flags
  (greedy, each filter or penalty on, seeded, min_tokens bans).

A plan changes only what it names: a new block written into one row, ``num_computed`` of the
scheduled rows, a sampled token appended to the rows that sampled. A step gathers its rows in the
batch order with vectorized numpy indexing (ids, positions, slot mapping, the block table's rows
up to the widest of the step); no Python loop runs over tokens or block ids.

``sampling_metadata`` reuses the previous step's tensors when the rows that sample are the same
requests in the same order (``serial``: unique to each stay of a request in a row), and
otherwise gathers them from the columns in one indexing per kind; only seeded generators, the
``min_tokens`` bans and the penalties' (row, token) pairs, which move with each token, are
redone every step, for the rows that have them. Tensors reach the device through
``corellm.attention.DeviceArray``: a zero-copy view on the CPU, a pinned buffer and a
non-blocking copy on a GPU.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from corellm.attention import CommonAttentionMetadata, DeviceArray
from corellm.sampling import SamplingMetadata
from corellm.worker.request_state import _F32_MAX, generator_seed, penalty_pairs

if TYPE_CHECKING:
    from corellm.worker.request_state import CachedRequestState

# Rows of the float column block ``fcols`` [6, rows] float32.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
# Rows of the flag block ``flags`` [10, rows] bool.
(GREEDY, TOP_K_ON, TOP_P_ON, MIN_P_ON, PENALIZED, PRESENCE_ON, FREQUENCY_ON, REPETITION_ON,
 SEEDED, MIN_TOKENS) = range(10)
_NUM_FLAGS = 10
_INITIAL_TOKEN_WIDTH = 1024


@dataclass
class PreparedStep:
    """One step's inputs, gathered from the batch in the builder's order."""

    rows: np.ndarray                 # [num_reqs] the batch rows, in the step's order
    common: CommonAttentionMetadata
    input_ids: np.ndarray            # [T] int64
    positions: np.ndarray            # [T] int64
    logits_indices: np.ndarray       # [S] int64
    sample_rows: np.ndarray          # [S] the batch rows that sample, in logits order


@dataclass
class _SamplingRows:
    """What a set of sampling rows (in order) makes of the columns; reused while it lasts."""

    key: bytes                               # the rows' serials, in order
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_num_logprobs: int | None
    seeded: list[tuple[int, Any]]            # (metadata row, state) of seeded random rows
    min_tokens: list[tuple[int, Any]]        # (metadata row, state) of rows with min_tokens bans
    penalized: np.ndarray | None             # metadata rows with a penalty (None: no row)
    repetition: np.ndarray | None            # metadata rows with a repetition penalty
    repetition_states: list[Any]
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition_penalties: torch.Tensor | None


class InputBatch:
    """The persistent rows of the running requests (see the module's docstring). ``rows``
    starts at ``max_num_seqs``; the arrays grow (doubling) rather than fail when a scheduler
    runs more, or a request outgrows ``max_model_len``'s blocks or the token width."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_model_len = max_model_len
        rows = max(1, max_num_seqs)
        self.capacity = rows
        self.block_table = np.zeros((rows, max(1, -(-max_model_len // block_size))),
                                    dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt = np.zeros(rows, dtype=np.int64)
        self.lora_slot = np.full(rows, -1, dtype=np.int64)
        self.token_ids = np.zeros((rows, max(1, min(max_model_len, _INITIAL_TOKEN_WIDTH))),
                                  dtype=np.int32)
        self.serial = np.full(rows, -1, dtype=np.int64)
        self.fcols = np.zeros((6, rows), dtype=np.float32)
        self.flags = np.zeros((_NUM_FLAGS, rows), dtype=bool)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.logprobs = np.full(rows, -1, dtype=np.int64)
        self.states = np.full(rows, None, dtype=object)     # row -> CachedRequestState
        self.req_ids = np.full(rows, None, dtype=object)    # row -> request id
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows))                      # a heap: lowest row first
        self._next_serial = 0
        self._longest = 0                   # at least every row's num_tokens
        # Device buffers of the sampling tensors (zero-copy views on the CPU).
        self._floats = DeviceArray((6, rows), torch.float32, device)
        self._top_k = DeviceArray((rows,), torch.int64, device)
        self._pairs = DeviceArray((2, rows), torch.int64, device)
        self._counts = DeviceArray((rows,), torch.int32, device)
        self._keep = DeviceArray((rows,), torch.int64, device)
        self._sampling: _SamplingRows | None = None
        self.sampling_rebuilds = 0          # how often the sampling rows were gathered anew

    # ------------------------------------------------------------------ rows
    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    def _grow_rows(self) -> None:
        old, new = self.capacity, 2 * self.capacity
        for name in ("block_table", "num_blocks", "num_computed", "num_tokens", "num_prompt",
                     "token_ids", "serial", "top_k", "logprobs", "states", "req_ids",
                     "lora_slot"):
            arr = getattr(self, name)
            grown = np.zeros((new,) + arr.shape[1:], dtype=arr.dtype)
            if name in ("serial", "logprobs", "lora_slot"):
                grown[:] = -1
            elif arr.dtype == object:
                grown[:] = None
            grown[:old] = arr
            setattr(self, name, grown)
        for name in ("fcols", "flags"):
            arr = getattr(self, name)
            grown = np.zeros((arr.shape[0], new), dtype=arr.dtype)
            grown[:, :old] = arr
            setattr(self, name, grown)
        self.capacity = new
        for row in range(old, new):
            heapq.heappush(self._free, row)

    def _grow_tokens(self, needed: int) -> None:
        width = self.token_ids.shape[1]
        if width < self.max_model_len:
            new = max(needed, min(2 * width, self.max_model_len))
        else:           # past max_model_len (a scheduler that overruns it): a little at a time
            new = max(needed, width + 64)
        grown = np.zeros((self.capacity, new), dtype=self.token_ids.dtype)
        grown[:, :width] = self.token_ids
        self.token_ids = grown

    def _grow_blocks(self, needed: int) -> None:
        width = self.block_table.shape[1]
        grown = np.zeros((self.capacity, max(needed, 2 * width)), dtype=self.block_table.dtype)
        grown[:, :width] = self.block_table
        self.block_table = grown

    def add(self, state: CachedRequestState) -> int:
        """Give ``state`` a row filled with its tokens, blocks, progress (which it then drops)
        and sampling parameters; returns the row."""
        token_ids, block_ids = state._token_ids, state._block_ids
        if not self._free:
            self._grow_rows()
        row = heapq.heappop(self._free)
        n, k = len(token_ids), len(block_ids)
        if n > self.token_ids.shape[1]:
            self._grow_tokens(n)
        if k > self.block_table.shape[1]:
            self._grow_blocks(k)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self._longest = max(self._longest, n)
        self.num_prompt[row] = state.num_prompt_tokens
        self.num_computed[row] = state._num_computed
        self.lora_slot[row] = state.lora_slot
        self.block_table[row, :k] = block_ids
        self.num_blocks[row] = k
        self._write_sampling(row, state)
        self.serial[row] = self._next_serial
        state.serial = self._next_serial
        self._next_serial += 1
        self.states[row] = state
        self.req_ids[row] = state.req_id
        self.row_of[state.req_id] = row
        state.batch, state.row = self, row
        state._token_ids = state._block_ids = None
        return row

    def _write_sampling(self, row: int, state: CachedRequestState) -> None:
        p, vocab = state.params, self.vocab_size
        greedy = p.greedy
        f, flags = self.fcols, self.flags
        with np.errstate(over="ignore"):     # a finite double past float32's range: inf
            f[TEMPERATURE, row] = 0.0 if greedy else min(p.temperature, _F32_MAX)
            f[TOP_P, row] = p.top_p
            f[MIN_P, row] = p.min_p
            f[PRESENCE, row] = p.presence_penalty
            f[FREQUENCY, row] = p.frequency_penalty
            f[REPETITION, row] = p.repetition_penalty
        self.top_k[row] = min(p.top_k, vocab) if p.top_k > 0 else vocab
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        flags[GREEDY, row] = greedy
        flags[TOP_K_ON, row] = p.top_k > 0
        flags[TOP_P_ON, row] = p.top_p < 1.0
        flags[MIN_P_ON, row] = p.min_p > 0.0
        flags[PENALIZED, row] = p.has_penalties
        flags[PRESENCE_ON, row] = p.presence_penalty != 0.0
        flags[FREQUENCY_ON, row] = p.frequency_penalty != 0.0
        flags[REPETITION_ON, row] = p.repetition_penalty != 1.0
        flags[SEEDED, row] = p.seed is not None and not greedy
        flags[MIN_TOKENS, row] = bool(state.min_tokens_banned)

    def remove(self, state: CachedRequestState) -> None:
        """Free ``state``'s row (its block-table entries zeroed: the table's padding is 0)."""
        row = state.row
        if row < 0 or self.states[row] is not state:
            return
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.num_tokens[row] = self.num_computed[row] = self.num_prompt[row] = 0
        self.serial[row] = self.lora_slot[row] = -1
        self.states[row] = self.req_ids[row] = None
        del self.row_of[state.req_id]
        heapq.heappush(self._free, row)
        state.batch, state.row = None, -1      # its lists are gone: a state is not reused

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self._grow_blocks(end)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_tokens(self, rows: np.ndarray, tokens: Any) -> None:
        """One sampled token appended to each of ``rows`` (distinct)."""
        if not len(rows):
            return
        n = self.num_tokens[rows]
        # ``_longest`` bounds every row's length (+1 per append), so the width is checked
        # without a reduction over the rows on most steps.
        self._longest += 1
        if self._longest >= self.token_ids.shape[1]:
            self._longest = int(self.num_tokens.max()) + 1
            if self._longest > self.token_ids.shape[1]:
                self._grow_tokens(self._longest)
        self.token_ids[rows, n] = tokens
        self.num_tokens[rows] = n + 1

    def rows_of(self, req_ids: Any) -> np.ndarray:
        """The rows of ``req_ids`` (each running), in order."""
        return np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.int64,
                           count=len(req_ids))

    # ------------------------------------------------------------------ a step's inputs
    def prepare(self, rows: np.ndarray, n_sched: np.ndarray, decodes_first: bool
                ) -> PreparedStep:
        """The step of ``rows`` (the plan's order) computing ``n_sched`` (>= 1) tokens each, in
        the builder's order: decodes first, shortest context first (stable), when
        ``decodes_first``."""
        num_reqs = len(rows)
        starts = self.num_computed[rows]
        not_one = n_sched != 1
        decode_only = not not_one.any()
        if decodes_first:                           # stable sorts, like list.sort
            if decode_only:
                order = np.argsort(starts, kind="stable")
                rows, starts = rows[order], starts[order]
            else:
                order = np.lexsort((starts, not_one))
                rows, n_sched, starts = rows[order], n_sched[order], starts[order]
                not_one = not_one[order]
        seq_lens = starts + n_sched
        known = self.num_tokens[rows]
        num_blocks = self.num_blocks[rows]
        bs = self.block_size
        if (seq_lens > known).any() or (seq_lens > num_blocks * bs).any():
            self._refuse(rows, seq_lens, known)
        if decode_only:
            num_decodes = total = num_reqs
            cu = np.arange(num_reqs + 1, dtype=np.int64)
            positions, token_rows, max_query_len = starts, rows, 1
        else:
            not_decode = np.flatnonzero(not_one)
            num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
            cu = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(n_sched, out=cu[1:])
            total, max_query_len = int(cu[-1]), int(n_sched.max())
            req_of_token = np.repeat(np.arange(num_reqs), n_sched)
            positions = (np.arange(total, dtype=np.int64) - cu[:-1][req_of_token]
                         + starts[req_of_token])
            token_rows = rows[req_of_token]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        table = self.block_table
        block_idx, offset = np.divmod(positions, bs)
        slot_mapping = table[token_rows, block_idx] * bs + offset
        block_table = table[rows, :int(num_blocks.max())]
        # Rows that reach the end of their known tokens sample; partial prefill chunks do not.
        sample_idx = np.flatnonzero(seq_lens == known)
        common = CommonAttentionMetadata(
            num_reqs=num_reqs, num_decodes=num_decodes, num_actual_tokens=total,
            query_start_loc=cu, seq_lens=seq_lens, context_lens=starts, block_table=block_table,
            slot_mapping=slot_mapping, max_seq_len=int(seq_lens.max()),
            max_query_len=max_query_len, block_size=bs)
        return PreparedStep(rows, common, input_ids, positions, cu[1:][sample_idx] - 1,
                            rows[sample_idx])

    def token_lora_slots(self, step: PreparedStep) -> np.ndarray | None:
        """The LoRA slot of each of ``step``'s tokens (-1: the base model), or None when no
        request of the step runs an adapter."""
        slots = self.lora_slot[step.rows]
        if not (slots >= 0).any():
            return None
        return np.repeat(slots, np.diff(step.common.query_start_loc))

    def _refuse(self, rows: np.ndarray, seq_lens: np.ndarray, known: np.ndarray) -> None:
        bad_tokens = np.flatnonzero(seq_lens > known)
        if len(bad_tokens):
            i = int(bad_tokens[0])
            raise RuntimeError(
                f"the plan computes {int(seq_lens[i])} tokens of request "
                f"{self.req_ids[rows[i]]!r}, but the worker knows {int(known[i])}")
        i = int(np.flatnonzero(seq_lens > self.num_blocks[rows] * self.block_size)[0])
        raise RuntimeError(
            f"the plan computes {int(seq_lens[i])} tokens of request {self.req_ids[rows[i]]!r}, "
            f"but its {int(self.num_blocks[rows[i]])} KV blocks hold "
            f"{int(self.num_blocks[rows[i]]) * self.block_size}")

    def select(self, logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
        """``logits``' rows ``keep`` (index copied through the pinned buffer on a GPU)."""
        return logits.index_select(0, self._keep.put(np.asarray(keep, dtype=np.int64)))

    # ------------------------------------------------------------------ sampling
    def sampling_metadata(self, rows: np.ndarray, generator: torch.Generator | None
                          ) -> SamplingMetadata:
        """The sampler's inputs for ``rows`` (batch rows, in logits order): the tensors of the
        last call when the rows hold the same requests in the same order, else gathered from
        the columns; seeds, bans and penalty pairs for this step."""
        key = self.serial[rows].tobytes()
        cached = self._sampling
        if cached is None or cached.key != key:
            cached = self._sampling = self._gather_sampling(rows, key)
            self.sampling_rebuilds += 1
        generators: dict[int, torch.Generator] = {}
        banned: dict[int, list[int]] = {}
        if cached.seeded or cached.min_tokens:
            outputs = self.num_tokens - self.num_prompt
            for i, state in cached.seeded:
                gen = state.generator
                if gen is None:
                    gen = state.generator = torch.Generator(device=self.device)
                gen.manual_seed(generator_seed(state.params.seed, int(outputs[state.row])))
                generators[i] = gen
            for i, state in cached.min_tokens:
                if outputs[state.row] < state.params.min_tokens:
                    banned[i] = state.min_tokens_banned
        md = SamplingMetadata(
            num_rows=len(rows), all_greedy=cached.all_greedy, all_random=cached.all_random,
            temperature=cached.temperature, top_k=cached.top_k, top_p=cached.top_p,
            min_p=cached.min_p, generators=generators, generator=generator,
            banned_token_ids=banned, max_num_logprobs=cached.max_num_logprobs)
        if cached.penalized is not None:
            self._add_penalties(md, rows, cached)
        return md

    def _gather_sampling(self, rows: np.ndarray, key: bytes) -> _SamplingRows:
        flags = np.take(self.flags, rows, axis=1)           # [F, n]
        on = flags.any(axis=1)
        all_greedy = bool(flags[GREEDY].all())
        floats = self._floats.put(np.take(self.fcols, rows, axis=1))   # [6, n]
        temperature = top_k = top_p = min_p = None
        seeded: list[tuple[int, Any]] = []
        if not all_greedy:
            temperature = floats[TEMPERATURE]
            if on[TOP_K_ON]:
                top_k = self._top_k.put(self.top_k[rows])
            if on[TOP_P_ON]:
                top_p = floats[TOP_P]
            if on[MIN_P_ON]:
                min_p = floats[MIN_P]
            if on[SEEDED]:
                states = self.states
                seeded = [(i, states[rows[i]]) for i in np.flatnonzero(flags[SEEDED]).tolist()]
        min_tokens = []
        if on[MIN_TOKENS]:
            min_tokens = [(i, self.states[rows[i]])
                          for i in np.flatnonzero(flags[MIN_TOKENS]).tolist()]
        lp = self.logprobs[rows]
        top_lp = int(lp.max()) if len(lp) else -1
        penalized = repetition = None
        repetition_states: list[Any] = []
        presence = frequency = repetition_penalties = None
        if on[PENALIZED]:
            penalized = np.flatnonzero(flags[PENALIZED])
            presence = floats[PRESENCE] if on[PRESENCE_ON] else None
            frequency = floats[FREQUENCY] if on[FREQUENCY_ON] else None
            repetition_penalties = floats[REPETITION] if on[REPETITION_ON] else None
            repetition = np.flatnonzero(flags[REPETITION_ON])
            repetition_states = [self.states[rows[i]] for i in repetition.tolist()]
        return _SamplingRows(
            key=key, all_greedy=all_greedy, all_random=not on[GREEDY],
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            max_num_logprobs=top_lp if top_lp >= 0 else None, seeded=seeded,
            min_tokens=min_tokens, penalized=penalized, repetition=repetition,
            repetition_states=repetition_states, presence=presence, frequency=frequency,
            repetition_penalties=repetition_penalties)

    def _add_penalties(self, md: SamplingMetadata, rows: np.ndarray,
                       cached: _SamplingRows) -> None:
        """The penalty fields: the columns of ``cached``, and the (row, token) pairs of this
        step's outputs, gathered from ``token_ids`` in one indexing."""
        md.presence_penalties = cached.presence
        md.frequency_penalties = cached.frequency
        md.repetition_penalties = cached.repetition_penalties
        pen = cached.penalized
        prow = rows[pen]
        first = self.num_prompt[prow]
        lens = self.num_tokens[prow] - first
        ends = np.cumsum(lens)
        seg = np.repeat(np.arange(len(prow)), lens)
        cols = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) \
            - (ends - lens)[seg] + first[seg]
        out_tokens = self.token_ids[prow[seg], cols].astype(np.int64)
        sets = [s.prompt_set() for s in cached.repetition_states]
        vocab = self.vocab_size
        pairs, counts = penalty_pairs(pen, lens, out_tokens, cached.repetition, sets, vocab)
        both = self._pairs.put(np.stack([pairs // vocab, pairs % vocab]))
        md.penalty_rows, md.penalty_token_ids = both[0], both[1]
        md.penalty_output_counts = self._counts.put(counts)
