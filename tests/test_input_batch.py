"""The model runner's persistent batch (corellm/worker/input_batch.py) against the per-request
construction it replaces: rows kept and reused, deltas touching only their row, the step's
arrays gathered in the builder's order, and the sampling metadata reused while the sampling rows
are the same requests and rebuilt when they change."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from corellm.sampling_params import SamplingParams
from corellm.worker.input_batch import InputBatch
from corellm.worker.request_state import CachedRequestState, sampling_metadata

from tests.conftest import engine_config

VOCAB = 97
BS = 4
CPU = torch.device("cpu")


def make_batch(rows: int = 4, max_model_len: int = 64) -> InputBatch:
    return InputBatch(rows, max_model_len, BS, VOCAB, CPU)


def add(batch: InputBatch, rid: str, tokens: list[int], num_prompt: int | None = None,
        blocks: list[int] | None = None, computed: int = 0,
        params: SamplingParams | None = None, eos: int | None = 3) -> CachedRequestState:
    if blocks is None:
        blocks = list(range(100, 100 + -(-len(tokens) // BS)))
    state = CachedRequestState(rid, list(tokens), len(tokens) if num_prompt is None else num_prompt,
                               list(blocks), computed, params or SamplingParams(temperature=0.0),
                               eos)
    batch.add(state)
    return state


def snapshot(batch: InputBatch) -> dict[str, np.ndarray]:
    return {name: getattr(batch, name).copy() for name in (
        "block_table", "num_blocks", "num_computed", "num_tokens", "num_prompt", "token_ids",
        "fcols", "flags", "top_k", "logprobs", "serial")}


# ---------------------------------------------------------------------------- rows
def test_rows_are_kept_and_reused_after_finish_and_preemption():
    b = make_batch(rows=3)
    a = add(b, "a", [1, 2, 3, 4, 5], blocks=[7, 8])
    c = add(b, "c", [9] * 9, blocks=[1, 2, 3])
    d = add(b, "d", [4, 4], blocks=[5])
    assert (a.row, c.row, d.row) == (0, 1, 2)
    b.remove(c)                               # finished: its row is free, its table zeroed
    assert b.block_table[1].tolist() == [0] * b.block_table.shape[1]
    assert "c" not in b.row_of and b.states[1] is None
    e = add(b, "e", [6, 6, 6], blocks=[11])
    assert e.row == 1                         # the freed row, not a new one
    assert e.token_ids == [6, 6, 6] and e.block_ids == [11]
    assert b.block_table[1, 1:].tolist() == [0] * (b.block_table.shape[1] - 1)
    assert a.token_ids == [1, 2, 3, 4, 5] and a.block_ids == [7, 8]   # others untouched
    b.remove(a)                                # preempted, then back: a row (and serial) anew
    back = add(b, "a", [1, 2, 3, 4, 5, 6], num_prompt=5, blocks=[20, 21])
    assert back.row == 0 and back.serial != a.serial
    assert back.num_output_tokens == 1 and back.token_ids == [1, 2, 3, 4, 5, 6]
    assert b.num_rows == 3 and b.capacity == 3


def test_a_scheduler_past_max_num_seqs_grows_the_batch():
    b = make_batch(rows=2, max_model_len=8)
    states = [add(b, f"r{i}", [i + 1] * (3 + i), blocks=[i, i + 10]) for i in range(5)]
    assert b.capacity >= 5 and sorted(s.row for s in states) == list(range(5))
    for i, s in enumerate(states):
        assert s.token_ids == [i + 1] * (3 + i) and s.block_ids == [i, i + 10]
    # A token width and a block width past max_model_len's grow too.
    b.append_blocks(states[0].row, [50, 51, 52])
    b.append_tokens(np.array([states[4].row]), [77])
    long = add(b, "long", list(range(40)), blocks=list(range(200, 210)))
    assert long.token_ids == list(range(40)) and long.block_ids == list(range(200, 210))
    assert states[0].block_ids == [0, 10, 50, 51, 52] and states[4].token_ids[-1] == 77


def test_a_block_appended_to_one_row_changes_only_that_row():
    b = make_batch(rows=4)
    states = [add(b, f"r{i}", [i + 1] * (5 + i), blocks=[10 * i, 10 * i + 1]) for i in range(4)]
    before = snapshot(b)
    target = states[2]
    b.append_blocks(target.row, [99])
    after = snapshot(b)
    diff = np.argwhere(before["block_table"] != after["block_table"])
    assert diff.tolist() == [[target.row, 2]]
    assert np.flatnonzero(before["num_blocks"] != after["num_blocks"]).tolist() == [target.row]
    for name in before:
        if name not in ("block_table", "num_blocks"):
            assert np.array_equal(before[name], after[name]), name
    # A sampled token touches only the rows that sampled.
    b.append_tokens(np.array([states[1].row, states[3].row]), [42, 43])
    again = snapshot(b)
    changed = np.flatnonzero((after["token_ids"] != again["token_ids"]).any(axis=1))
    assert changed.tolist() == sorted([states[1].row, states[3].row])
    assert states[1].token_ids[-1] == 42 and states[3].token_ids[-1] == 43
    assert states[0].token_ids == [1] * 5


# ---------------------------------------------------------------------------- a step's inputs
def reference_step(states: list[SimpleNamespace], scheduled: dict[str, int],
                   decodes_first: bool) -> dict:
    """The per-request construction the runner used before the persistent batch, from plain
    records of each request (its lists, not the batch's arrays)."""
    by_id = {s.req_id: s for s in states}
    order = list(scheduled.items())
    if decodes_first:
        order.sort(key=lambda kv: (kv[1] != 1, by_id[kv[0]].num_computed_tokens))
    sts = [by_id[rid] for rid, _ in order]
    n_sched = np.array([n for _, n in order], dtype=np.int64)
    starts = np.array([s.num_computed_tokens for s in sts], dtype=np.int64)
    num_reqs = len(sts)
    not_decode = np.flatnonzero(n_sched != 1)
    num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
    total = int(n_sched.sum())
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(n_sched, out=cu[1:])
    ids: list[int] = []
    for s, start, n in zip(sts, starts.tolist(), n_sched.tolist()):
        ids.extend(s.token_ids[start:start + n])
    req_of_token = np.repeat(np.arange(num_reqs), n_sched)
    positions = np.arange(total, dtype=np.int64) - cu[:-1][req_of_token] + starts[req_of_token]
    seq_lens = starts + n_sched
    max_blocks = max(len(s.block_ids) for s in sts)
    table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, s in enumerate(sts):
        table[i, :len(s.block_ids)] = s.block_ids
    slots = table[req_of_token, positions // BS] * BS + positions % BS
    num_tokens = np.array([len(s.token_ids) for s in sts], dtype=np.int64)
    sample_rows = np.flatnonzero(seq_lens == num_tokens)
    return dict(req_ids=[s.req_id for s in sts], ids=np.asarray(ids, dtype=np.int64),
                positions=positions, cu=cu, seq_lens=seq_lens, starts=starts, table=table,
                slots=slots, num_decodes=num_decodes, logits_indices=cu[1:][sample_rows] - 1,
                sampling=[sts[i].req_id for i in sample_rows])


def random_batch(rng: random.Random, b: InputBatch, n: int, only_decodes: bool = False
                 ) -> tuple[list, dict[str, int]]:
    states, scheduled = [], {}
    next_block = 1
    for i in range(n):
        length = rng.randint(1, 40)
        kind = 0.0 if only_decodes else rng.random()
        if kind < 0.5:          # a decode: everything but its last token computed
            computed, n_sched = length - 1, 1
        elif kind < 0.75:       # a whole prompt
            computed, n_sched = 0, length
        else:                   # a chunk, maybe the last one
            computed = rng.randint(0, length - 1)
            n_sched = rng.randint(1, length - computed)
        nblocks = -(-(computed + n_sched) // BS) + rng.randint(0, 1)
        blocks = list(range(next_block, next_block + nblocks))
        rng.shuffle(blocks)
        next_block += nblocks
        num_prompt = rng.randint(1, length)
        tokens = [rng.randrange(VOCAB) for _ in range(length)]
        rid = f"q{i}-{rng.random():.6f}"
        # The last token sampled by the worker (appended to its row), not in the plan's data.
        sampled = rng.random() < 0.3 and length > num_prompt
        add(b, rid, tokens[:-1] if sampled else tokens, num_prompt=num_prompt, blocks=blocks,
            computed=computed)
        if sampled:
            b.append_tokens(b.rows_of([rid]), [tokens[-1]])
        states.append(SimpleNamespace(req_id=rid, token_ids=tokens, block_ids=blocks,
                                      num_computed_tokens=computed))
        scheduled[rid] = n_sched
    return states, scheduled


@pytest.mark.parametrize("decodes_first", [True, False])
def test_gathered_step_equals_the_per_request_construction(decodes_first):
    rng = random.Random(7 if decodes_first else 8)
    for trial in range(40):
        b = make_batch(rows=rng.randint(1, 12))
        # some churn first, so that rows are not in plan order
        junk = [add(b, f"junk{k}", [1] * rng.randint(1, 9)) for k in range(rng.randint(0, 5))]
        states, scheduled = random_batch(rng, b, rng.randint(1, 12), only_decodes=trial % 3 == 0)
        for s in junk[::2]:
            b.remove(s)
        items = list(scheduled.items())
        rng.shuffle(items)
        scheduled = dict(items)
        ref = reference_step(states, scheduled, decodes_first)
        step = b.prepare(b.rows_of(list(scheduled)), np.array(list(scheduled.values())),
                         decodes_first)
        c = step.common
        assert b.req_ids[step.rows].tolist() == ref["req_ids"]
        assert np.array_equal(step.input_ids, ref["ids"]) and step.input_ids.dtype == np.int64
        assert np.array_equal(step.positions, ref["positions"])
        assert np.array_equal(c.query_start_loc, ref["cu"])
        assert np.array_equal(c.seq_lens, ref["seq_lens"])
        assert np.array_equal(c.context_lens, ref["starts"])
        assert np.array_equal(c.block_table, ref["table"]) and c.block_table.dtype == np.int64
        assert np.array_equal(c.slot_mapping, ref["slots"])
        assert c.num_decodes == ref["num_decodes"] and c.num_reqs == len(states)
        assert c.num_actual_tokens == len(ref["ids"])
        assert np.array_equal(step.logits_indices, ref["logits_indices"])
        assert b.req_ids[step.sample_rows].tolist() == ref["sampling"]


def test_a_plan_past_the_known_tokens_or_blocks_is_refused():
    b = make_batch()
    s = add(b, "a", [1, 2, 3, 4, 5], blocks=[1, 2], computed=5)
    with pytest.raises(RuntimeError, match="worker knows 5"):
        b.prepare(b.rows_of(["a"]), np.array([1]), True)
    b.append_tokens(np.array([s.row]), [6])
    b.append_tokens(np.array([s.row]), [7])
    b.append_tokens(np.array([s.row]), [8])
    b.num_computed[s.row] = 8
    b.append_tokens(np.array([s.row]), [9])
    with pytest.raises(RuntimeError, match="2 KV blocks hold 8"):
        b.prepare(b.rows_of(["a"]), np.array([1]), True)
    b.append_blocks(s.row, [3])
    assert b.prepare(b.rows_of(["a"]), np.array([1]), True).input_ids.tolist() == [9]


# ---------------------------------------------------------------------------- sampling
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1e300, seed=5),                 # past float32: clamped
    SamplingParams(temperature=0.9, top_k=5, seed=11),
    SamplingParams(temperature=1.3, top_k=10 ** 6),            # past the vocabulary
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0, logprobs=0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.2),
    SamplingParams(temperature=0.6, repetition_penalty=0.8, seed=2 ** 63 - 1),
    SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[7]),
    SamplingParams(temperature=0.0, min_tokens=2),
]


def assert_same_metadata(md, ref) -> None:
    for name in ("num_rows", "all_greedy", "all_random", "max_num_logprobs",
                 "banned_token_ids"):
        assert getattr(md, name) == getattr(ref, name), name
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalties",
                 "frequency_penalties", "repetition_penalties", "penalty_rows",
                 "penalty_token_ids", "penalty_output_counts"):
        a, r = getattr(md, name), getattr(ref, name)
        assert (a is None) == (r is None), name
        if a is not None:
            assert a.dtype == r.dtype and a.device == r.device, name
            assert torch.equal(a, r), name
    assert md.generators.keys() == ref.generators.keys()
    for row, gen in md.generators.items():
        assert torch.equal(gen.get_state(), ref.generators[row].get_state()), row


def test_sampling_metadata_equals_the_per_request_construction_step_after_step():
    rng = random.Random(3)
    b = make_batch(rows=16)
    gen = torch.Generator().manual_seed(0)
    states = []
    for i, p in enumerate(PARAMS):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        out = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        states.append(add(b, f"s{i}", prompt + out, num_prompt=len(prompt), params=p))
    for step in range(6):
        order = states[:]
        rng.shuffle(order)
        sel = order[:rng.randint(1, len(order))]
        rows = np.array([s.row for s in sel])
        md = b.sampling_metadata(rows, gen)
        ref = sampling_metadata(sel, VOCAB, CPU, gen)
        assert md.generator is gen
        assert_same_metadata(md, ref)
        b.append_tokens(rows, [rng.randrange(VOCAB) for _ in sel])


def test_sampling_metadata_is_reused_while_the_rows_are_the_same_requests():
    rng = random.Random(4)
    b = make_batch(rows=8)
    gen = torch.Generator().manual_seed(0)
    states = [add(b, f"s{i}", [rng.randrange(VOCAB) for _ in range(5)], params=PARAMS[i])
              for i in range(1, 6)]
    rows = np.array([s.row for s in states])
    first = b.sampling_metadata(rows, gen)
    rebuilds = b.sampling_rebuilds
    for _ in range(3):       # decode steps: same requests, one token more each
        b.append_tokens(rows, [rng.randrange(VOCAB) for _ in states])
        md = b.sampling_metadata(rows, gen)
        assert b.sampling_rebuilds == rebuilds
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalties"):
            assert getattr(md, name) is getattr(first, name), name
        # ... while what moves with the tokens is this step's
        assert_same_metadata(md, sampling_metadata(states, VOCAB, CPU, gen))
    # Another order of the same requests: rebuilt, and right.
    swapped = rows[::-1].copy()
    md = b.sampling_metadata(swapped, gen)
    assert b.sampling_rebuilds == rebuilds + 1
    assert_same_metadata(md, sampling_metadata(states[::-1], VOCAB, CPU, gen))
    # A finished request's row taken by a new request of the same id and row: rebuilt.
    b.sampling_metadata(rows, gen)
    count = b.sampling_rebuilds
    victim = states[2]
    row = victim.row
    b.remove(victim)
    states[2] = add(b, victim.req_id, [1, 2, 3], params=SamplingParams(temperature=0.0, top_k=3))
    assert states[2].row == row
    md = b.sampling_metadata(rows, gen)
    assert b.sampling_rebuilds == count + 1
    assert_same_metadata(md, sampling_metadata(states, VOCAB, CPU, gen))
    # One row fewer (a deferred or finished row): rebuilt.
    md = b.sampling_metadata(rows[:-1], gen)
    assert b.sampling_rebuilds == count + 2
    assert_same_metadata(md, sampling_metadata(states[:-1], VOCAB, CPU, gen))


def test_min_tokens_bans_lift_as_tokens_arrive_without_a_rebuild():
    b = make_batch()
    s = add(b, "m", [5, 6], params=SamplingParams(temperature=0.5, min_tokens=2,
                                                   stop_token_ids=[9]), eos=3)
    rows = np.array([s.row])
    assert b.sampling_metadata(rows, None).banned_token_ids == {0: [9, 3]}
    b.append_tokens(rows, [1])
    assert b.sampling_metadata(rows, None).banned_token_ids == {0: [9, 3]}
    b.append_tokens(rows, [2])
    assert b.sampling_metadata(rows, None).banned_token_ids == {}
    assert b.sampling_rebuilds == 1


# ---------------------------------------------------------------------------- the engine
MIXED = [SamplingParams(max_tokens=12, ignore_eos=True, **kw) for kw in (
    dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=1.1, top_k=20),
    dict(temperature=0.9, top_p=0.8, seed=2), dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.7, presence_penalty=0.4, frequency_penalty=0.2, seed=3),
    dict(temperature=0.0, logprobs=2), dict(temperature=0.6, min_p=0.1, seed=4))]


def test_engine_outputs_equal_the_per_request_metadata(llama_path, monkeypatch):
    """Mixed sampling through the engine (chunked prefills, preemptions): the reused metadata
    gives the tokens the per-request construction gives; in steady decoding it is reused."""
    from corellm import LLM
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 50 for j in range(10 + 9 * i)]}
               for i in range(len(MIXED))]
    cfg = engine_config(llama_path, scheduler={"max_num_batched_tokens": 32},
                        kv_cache={"num_blocks": 12})
    cfg["model"]["max_model_len"] = 128

    def run(reference: bool):
        llm = LLM(cfg)
        runner = llm.engine.executor.worker.runner
        if reference:
            def per_request(rows, generator):
                states = runner.batch.states[rows].tolist()
                return sampling_metadata(states, runner.model_info.vocab_size, runner.device,
                                         generator)
            monkeypatch.setattr(runner.batch, "sampling_metadata", per_request)
        try:
            outs = llm.generate(prompts, MIXED, use_tqdm=False)
            stats = llm.get_stats()
            return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                    runner.batch.sampling_rebuilds, stats)
        finally:
            llm.shutdown()

    ours, rebuilds, stats = run(False)
    ref, _, _ = run(True)
    assert ours == ref
    assert stats.num_preemptions > 0          # rows were freed and refilled mid-run
    assert rebuilds < stats.num_steps / 2
