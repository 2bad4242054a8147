"""The default sampler against direct computations of each filter and of the distribution."""

from __future__ import annotations

import pytest
import torch

from corellm.plugins import load_registry
from corellm.sampling import SamplingMetadata

V = 50


@pytest.fixture(scope="module")
def sampler():
    reg = load_registry()
    entry = reg.get("sampler", "default")
    return entry.spec.factory(entry.spec.options(), None)


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
