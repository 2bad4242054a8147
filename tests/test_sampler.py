"""The default sampler against direct computations of each filter and of the distribution."""

from __future__ import annotations

import pytest
import torch

from corellm.plugins.discovery import load_registry
from corellm.sampling import SamplingMetadata

V = 50


@pytest.fixture(scope="module")
def sampler():
    reg = load_registry()
    entry = reg.get("sampler", "default")
    from corellm.components import BuildContext
    from corellm.config.compose import load_config
    return entry.spec.factory(entry.spec.options(),
                              BuildContext(config=load_config({}, registry=reg), registry=reg))


def md(n, temperature=1.0, top_k=None, top_p=None, min_p=None, generators=None, logprobs=None):
    t = torch.full((n,), float(temperature)) if not isinstance(temperature, torch.Tensor) else temperature
    greedy = t == 0
    return SamplingMetadata(
        num_rows=n, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
        temperature=None if greedy.all() else t,
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.full((n,), float(top_p)),
        min_p=None if min_p is None else torch.full((n,), float(min_p)),
        generators=generators or {}, max_num_logprobs=logprobs)


@pytest.fixture(scope="module")
def logits():
    torch.manual_seed(0)
    return torch.randn(V) * 2


def draws(sampler, logits, n=4000, **kw):
    out = sampler(logits.expand(n, V).clone(), md(n, **kw))
    return out.sampled_token_ids


def test_greedy(sampler, logits):
    rows = torch.randn(6, V)
    out = sampler(rows, md(6, temperature=0.0))
    assert out.sampled_token_ids.tolist() == rows.argmax(-1).tolist()


@pytest.mark.parametrize("n", [1, 5, 31, 33, 1000, 32000])
def test_greedy_pass_is_torchs_first_maximum(n, monkeypatch):
    """``corellm.sampling.greedy`` with the CPU platform's ops (a native argmax) and with the
    reference ops picks what ``max(dim=-1).indices`` picks: the first of tied maxima (-0.0 ties
    +0.0), an infinity, a row of -inf (index 0), the first NaN anywhere in the row; strided rows
    too."""
    from corellm.sampling import greedy
    from corellm_plugins.platform_cpu.kernels import cpu_ops
    from corellm_plugins.platform_cpu.ops import CpuDeviceOps
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1, -1] = x[1].max()                       # a tie with an earlier maximum
    x[2] = float("-inf")
    x[3, n // 2] = float("inf")
    x[3, -1] = float("inf")
    x[4, n // 3] = float("nan")
    x[4, -1] = float("nan")
    x[5, -1] = float("nan")
    x[6] = 0.0
    x[6, :(n + 1) // 2] = -0.0                   # -0.0 first: it wins the tie
    x[7, 0] = float("nan")
    cases = [x, torch.cat([x, x], dim=1)[:, :n], x[:0]]
    kernels = cpu_ops()                           # built: the platform's ops take the native pass
    platform_ops = CpuDeviceOps(weight_packing=False, fused_ops=True)
    platform_ops.prepare(torch.nn.Linear(2, 2))
    assert platform_ops.kernels is kernels
    ran = []
    if kernels is not None:
        assert kernels.argmax(x.double()) is None     # float32 only
        monkeypatch.setattr(type(kernels), "argmax",
                            lambda self, t, f=type(kernels).argmax: (ran.append(1), f(self, t))[1])
    for t in cases:                               # without a C compiler: torch's reduction
        assert torch.equal(greedy(t, platform_ops), t.max(dim=-1).indices)
        assert torch.equal(greedy(t), t.max(dim=-1).indices)         # the reference ops
    assert len(ran) == (len(cases) if kernels is not None else 0)


def test_distribution_matches_softmax(sampler, logits):
    torch.manual_seed(1)
    n = 40000
    counts = torch.bincount(draws(sampler, logits, n=n, temperature=0.7), minlength=V).float() / n
    expected = torch.softmax(logits / 0.7, -1)
    assert 0.5 * (counts - expected).abs().sum() < 0.02     # total variation distance


def test_top_k(sampler, logits):
    allowed = set(logits.topk(5).indices.tolist())
    got = set(draws(sampler, logits, top_k=5, temperature=2.0).tolist())
    assert got <= allowed and len(got) == 5
    assert set(draws(sampler, logits, top_k=1).tolist()) == {int(logits.argmax())}


def test_top_p(sampler, logits):
    probs = torch.softmax(logits, -1)
    p_sorted, idx = probs.sort(descending=True)
    cum = p_sorted.cumsum(0)
    nucleus = set(idx[: int((cum < 0.6).sum()) + 1].tolist())   # smallest set reaching 0.6
    got = set(draws(sampler, logits, top_p=0.6).tolist())
    assert got == nucleus


def test_min_p(sampler, logits):
    probs = torch.softmax(logits, -1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    got = set(draws(sampler, logits, min_p=0.2).tolist())
    assert got == allowed


def test_mixed_greedy_and_random_rows(sampler):
    torch.manual_seed(3)
    rows = torch.randn(4, V)
    t = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = sampler(rows, md(4, temperature=t)).sampled_token_ids
    assert out[0] == rows[0].argmax() and out[2] == rows[2].argmax()


def test_seeded_rows_are_reproducible(sampler, logits):
    def run():
        g = torch.Generator().manual_seed(77)
        return sampler(logits.expand(3, V).clone(), md(3, generators={1: g})).sampled_token_ids[1]
    assert len({int(run()) for _ in range(5)}) == 1


def test_logprobs(sampler):
    rows = torch.randn(3, V)
    out = sampler(rows, md(3, temperature=0.0, logprobs=4))
    ref = torch.log_softmax(rows, -1)
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 5)
    assert torch.equal(lp.token_ids[:, 0], rows.argmax(-1))
    assert torch.allclose(lp.logprobs[:, 1:], ref.topk(4).values)
    assert lp.sampled_ranks.tolist() == [1, 1, 1]
    out = sampler(rows, md(3, temperature=1.0, logprobs=0))
    s = out.sampled_token_ids
    expected_rank = (ref > ref.gather(1, s[:, None])).sum(-1) + 1
    assert out.logprobs.sampled_ranks.tolist() == expected_rank.tolist()
    assert out.logprobs.token_ids.shape == (3, 1)


# ---------------------------------------------------------------- penalties

def naive_penalties(logits, prompts, outputs, presence, frequency, repetition):
    """vLLM's penalty rules, one token at a time in plain Python."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            x = float(out[r, t])
            count = outputs[r].count(t)
            if t in prompts[r] or count:
                x = x / repetition[r] if x > 0 else x * repetition[r]
            x -= frequency[r] * count
            if count:
                x -= presence[r]
            out[r, t] = x
    return out


def penalty_md(n, prompts, outputs, presence, frequency, repetition, **kw):
    """SamplingMetadata with the penalty fields as the model runner fills them."""
    from corellm.sampling_params import SamplingParams
    from corellm.worker.request_state import CachedRequestState, add_penalties

    states = [CachedRequestState(str(i), list(p) + list(o), len(p), [], 0,
                                 SamplingParams(presence_penalty=presence[i],
                                                frequency_penalty=frequency[i],
                                                repetition_penalty=repetition[i]), None)
              for i, (p, o) in enumerate(zip(prompts, outputs))]
    m = md(n, **kw)
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if rows:
        add_penalties(m, states, rows, V, torch.device("cpu"))
    return m


def random_history(n, seed):
    rng = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=rng)),),
                             generator=rng).tolist() for _ in range(n)]
    # a few distinct tokens, repeated, so counts above 1 occur
    outputs = [torch.randint(0, V // 5, (int(torch.randint(0, 15, (1,), generator=rng)),),
                             generator=rng).tolist() for _ in range(n)]
    return prompts, outputs


PENALTY_CASES = {
    "presence": ([0.0, 1.5, -0.7, 2.0, 0.0, 0.3], [0.0] * 6, [1.0] * 6),
    "frequency": ([0.0] * 6, [0.0, 0.4, -1.0, 2.0, 0.0, 0.9], [1.0] * 6),
    "repetition": ([0.0] * 6, [0.0] * 6, [1.0, 1.3, 0.8, 10.0, 1.0, 0.05]),
    "combined": ([0.0, 1.0, -0.5, 0.0, 0.0, 2.0], [0.0, 0.5, 0.0, -2.0, 0.0, 1.0],
                 [1.0, 1.2, 0.7, 1.0, 1.0, 2.0]),
}


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_apply_penalties_matches_naive_loop(case):
    from corellm.sampling import apply_penalties

    presence, frequency, repetition = PENALTY_CASES[case]
    n = len(presence)
    prompts, outputs = random_history(n, seed=len(case))
    outputs[1] = outputs[1] or [3]          # the penalized rows do have an output to penalize
    torch.manual_seed(5)
    logits = torch.randn(n, V) * 3          # about half negative: both sides of the rule
    m = penalty_md(n, prompts, outputs, presence, frequency, repetition)
    got = apply_penalties(logits, m)
    want = naive_penalties(logits, prompts, outputs, presence, frequency, repetition)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert not torch.equal(got, logits)
    # a penalty nobody uses is None; unpenalized rows are bitwise intact
    assert (m.presence_penalties is None) == all(p == 0 for p in presence)
    assert (m.frequency_penalties is None) == all(f == 0 for f in frequency)
    assert (m.repetition_penalties is None) == all(r == 1 for r in repetition)
    for r in range(n):
        if presence[r] == 0 and frequency[r] == 0 and repetition[r] == 1:
            assert torch.equal(got[r], logits[r])


def test_penalty_metadata_pairs():
    prompts = [[1, 2, 2], [4, 6, 4], [7, 7], [3]]
    outputs = [[5, 5, 9, 5], [6], [1, 7], []]
    m = penalty_md(4, prompts, outputs, [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                   [1.0, 1.2, 1.0, 1.5])
    pairs = list(zip(m.penalty_rows.tolist(), m.penalty_token_ids.tolist(),
                     m.penalty_output_counts.tolist()))
    # row 0: output only (no repetition penalty); row 1: prompt and output, each token once;
    # row 2: no penalty, absent; row 3: prompt only
    assert pairs == [(0, 5, 3), (0, 9, 1), (1, 4, 0), (1, 6, 1), (3, 3, 0)]
    assert m.penalty_rows.dtype == torch.int64 and m.penalty_output_counts.dtype == torch.int32
    assert m.presence_penalties.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert m.frequency_penalties is None
    assert m.repetition_penalties.tolist() == pytest.approx([1.0, 1.2, 1.0, 1.5])


def test_no_penalties_builds_nothing():
    from corellm.sampling import apply_penalties

    m = penalty_md(2, [[1], [2]], [[1], [2]], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    assert m.penalty_rows is None and m.penalty_output_counts is None
    assert m.presence_penalties is None and m.repetition_penalties is None
    logits = torch.randn(2, V)
    assert apply_penalties(logits, m) is logits
    # a presence penalty before anything is generated touches nothing
    m = penalty_md(2, [[1], [2]], [[], []], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    assert m.penalty_rows.numel() == 0
    assert torch.equal(apply_penalties(logits, m), logits)


def test_apply_penalties_leaves_input_alone():
    from corellm.sampling import apply_penalties

    m = penalty_md(2, [[1, 2], [3]], [[2, 2], [4]], [0.5, 0.0], [0.5, 0.0], [1.3, 0.9])
    logits = torch.randn(V, 2).t()                 # not contiguous
    before = logits.clone()
    got = apply_penalties(logits, m)
    assert torch.equal(logits, before)
    want = naive_penalties(before, [[1, 2], [3]], [[2, 2], [4]], [0.5, 0.0], [0.5, 0.0],
                           [1.3, 0.9])
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_sampler_greedy_uses_penalized_logits_and_raw_logprobs(sampler):
    presence, frequency, repetition = PENALTY_CASES["combined"]
    n = len(presence)
    prompts, outputs = random_history(n, seed=11)
    torch.manual_seed(6)
    logits = torch.randn(n, V)
    # make every penalized row's favourite an already generated token, so penalties matter
    for r in (1, 2, 5):
        outputs[r] = outputs[r] or [3]
        logits[r, outputs[r][0]] = logits[r].max() + 0.5
    m = penalty_md(n, prompts, outputs, presence, frequency, repetition, temperature=0.0,
                   logprobs=3)
    out = sampler(logits.clone(), m)
    want = naive_penalties(logits, prompts, outputs, presence, frequency, repetition)
    assert out.sampled_token_ids.tolist() == want.argmax(-1).tolist()
    assert out.sampled_token_ids.tolist() != logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs.logprobs[:, 1:], raw.topk(3).values)
    assert torch.allclose(out.logprobs.logprobs[:, 0],
                          raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    # unpenalized rows choose exactly as without any penalty metadata
    plain = sampler(logits.clone(), md(n, temperature=0.0)).sampled_token_ids
    for r in (0, 4):
        assert out.sampled_token_ids[r] == plain[r]


def test_sampler_penalties_before_temperature(sampler, logits):
    torch.manual_seed(2)
    n = 40000
    prompt, output = [0, 1, 2], [int(logits.argmax()), 4, 4]
    m = penalty_md(n, [prompt] * n, [output] * n, [0.5] * n, [0.8] * n, [1.5] * n,
                   temperature=0.7)
    counts = torch.bincount(sampler(logits.expand(n, V).clone(), m).sampled_token_ids,
                            minlength=V).float() / n
    penalized = naive_penalties(logits[None], [prompt], [output], [0.5], [0.8], [1.5])[0]
    expected = torch.softmax(penalized / 0.7, -1)
    assert 0.5 * (counts - expected).abs().sum() < 0.02


# ---------------------------------------------------------------- banned tokens and the pieces

def test_sampler_never_samples_a_banned_token(sampler):
    """Greedy rows take the best token that is not banned; random rows, at a temperature that
    makes every token likely, never draw a banned one; rows without bans are unaffected."""
    torch.manual_seed(4)
    rows = torch.randn(3, V)
    rows[2, 7] = rows[2].max() + 1.0                  # the two best of row 2 are banned
    first = rows.argmax(-1).tolist()
    m = md(3, temperature=0.0)
    runner_up = int(rows[2].index_fill(0, torch.tensor([7]), float("-inf")).argmax())
    m.banned_token_ids = {0: [first[0]], 2: [7, runner_up]}
    want = rows.clone()
    for r, ids in m.banned_token_ids.items():
        want[r, ids] = float("-inf")
    got = sampler(rows.clone(), m).sampled_token_ids.tolist()
    assert got == want.argmax(-1).tolist()
    assert got[1] == first[1] and got[0] != first[0] and 7 not in got
    n = 2000
    flat = torch.zeros(n, V)                      # uniform: each token about n / V times
    m = md(n, temperature=5.0)
    banned = [0, 3, V - 1]
    m.banned_token_ids = {r: banned for r in range(0, n, 2)}
    drawn = sampler(flat, m).sampled_token_ids
    assert not set(drawn[0::2].tolist()) & set(banned)
    assert set(banned) <= set(drawn[1::2].tolist())


def test_apply_banned_tokens():
    from corellm.sampling import apply_banned_tokens

    logits = torch.randn(3, V)
    before = logits.clone()
    m = md(3, temperature=0.0)
    assert apply_banned_tokens(logits, m) is logits           # nothing banned: no copy
    m.banned_token_ids = {2: [1, 4], 0: [V - 1], 1: []}
    got = apply_banned_tokens(logits, m)
    assert torch.equal(logits, before)                        # the input is left alone
    masked = {(0, V - 1), (2, 1), (2, 4)}
    for r in range(3):
        for t in range(V):
            if (r, t) in masked:
                assert got[r, t] == float("-inf")
            else:
                assert got[r, t] == logits[r, t]


def test_find_banned():
    from corellm.sampling import find_banned

    class Untouchable:
        """Any use of the sampled ids fails: nothing banned must cost nothing."""

        def __getattr__(self, name):
            raise AssertionError(f"find_banned used sampled.{name}")

        def __getitem__(self, index):
            raise AssertionError("find_banned indexed sampled")

    m = md(4, temperature=0.0)
    assert find_banned(Untouchable(), m) is None               # type: ignore[arg-type]
    m.banned_token_ids = {1: []}
    assert find_banned(Untouchable(), m) is None               # type: ignore[arg-type]

    # rows in insertion order 3, 1: the first hit is the lowest row
    m.banned_token_ids = {3: [7], 1: [4, 9], 2: [5]}
    for sampled in ([0, 9, 0, 7], torch.tensor([0, 9, 0, 7])):
        assert find_banned(sampled, m) == (1, 9)
    for sampled in ([9, 3, 5, 2], torch.tensor([9, 3, 5, 2])):  # 9 is banned in row 1 only
        assert find_banned(sampled, m) == (2, 5)
    for sampled in ([4, 5, 7, 9], torch.tensor([4, 5, 7, 9])):
        assert find_banned(sampled, m) is None
    hit = find_banned(torch.tensor([1, 2, 3, 7]), m)
    assert hit == (3, 7) and all(type(x) is int for x in hit)


def test_pieces_compose_into_the_default_sampler(sampler):
    """A sampler written from the public pieces alone draws exactly what the default sampler
    draws, token for token, with every filter, a ban, a seeded row and logprobs."""
    from corellm.sampling import (SamplerOutput, apply_banned_tokens, apply_min_p,
                                  apply_penalties, apply_top_k_top_p, gather_logprobs,
                                  random_sample)

    def composed(logits, m):
        raw = torch.log_softmax(logits, -1)
        logits = apply_banned_tokens(apply_penalties(logits, m), m)
        probs = apply_min_p(apply_top_k_top_p(logits / m.temperature[:, None], m.top_k,
                                              m.top_p).softmax(-1), m.min_p)
        sampled = random_sample(probs, m)
        return SamplerOutput(sampled, gather_logprobs(raw, sampled, m.max_num_logprobs))

    n = 64
    torch.manual_seed(8)
    logits = torch.randn(n, V) * 2

    def metadata():
        m = md(n, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=3,
               generators={5: torch.Generator().manual_seed(3)})
        m.generator = torch.Generator().manual_seed(11)
        m.banned_token_ids = {r: [int(logits[r].argmax())] for r in range(0, n, 3)}
        return m
    ours, theirs = composed(logits.clone(), metadata()), sampler(logits.clone(), metadata())
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    for name in ("token_ids", "logprobs", "sampled_ranks"):
        assert torch.equal(getattr(ours.logprobs, name), getattr(theirs.logprobs, name))


def test_random_sample_follows_probs_and_generators():
    from corellm.sampling import random_sample

    n = 40000
    probs = torch.softmax(torch.randn(V), -1)
    weights = probs * 3.0                                      # need not sum to 1
    weights[4] = 0.0
    rows = weights.expand(n, V).clone()
    m = md(n)
    m.generator = torch.Generator().manual_seed(1)
    drawn = random_sample(rows, m)
    assert torch.equal(rows, weights.expand(n, V))            # the input is left alone
    counts = torch.bincount(drawn, minlength=V).float() / n
    assert counts[4] == 0
    assert 0.5 * (counts - weights / weights.sum()).abs().sum() < 0.02

    def seeded_row():
        m = md(3, generators={1: torch.Generator().manual_seed(5)})
        m.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        return int(random_sample(rows[:3], m)[1])
    assert len({seeded_row() for _ in range(8)}) == 1


def test_a_zero_exponential_draw_never_picks_an_impossible_token(monkeypatch):
    """exponential_ can return exactly 0; 0 / 0 would be NaN and win the race. A token of
    probability 0 (banned, filtered) must lose it all the same."""
    from corellm.sampling import random_sample

    real = torch.Tensor.exponential_

    def with_zeros(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out[..., 0] = 0.0                       # a zero draw on the impossible token
        out[..., 1] = 0.0                       # and on a possible one
        return out
    monkeypatch.setattr(torch.Tensor, "exponential_", with_zeros)
    probs = torch.full((4, V), 1.0 / (V - 1))
    probs[:, 0] = 0.0
    drawn = random_sample(probs, md(4)).tolist()
    assert drawn == [1, 1, 1, 1]                # the finite winner, never the NaN


def test_apply_min_p_and_gather_logprobs():
    from corellm.sampling import apply_min_p, gather_logprobs

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    assert apply_min_p(probs, None) is probs
    got = apply_min_p(probs, torch.tensor([0.5, 0.9]))
    assert torch.equal(got, torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))

    lp = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    out = gather_logprobs(lp, torch.tensor([2, 1]), 2)
    assert out.token_ids.tolist() == [[2, 1, 2], [1, 0, 2]]
    assert torch.equal(out.logprobs[:, 0], lp[[0, 1], [2, 1]])
    assert out.sampled_ranks.tolist() == [2, 3]
    assert gather_logprobs(lp, torch.tensor([1, 0]), 0).token_ids.tolist() == [[1], [0]]
