"""Workload specs for ``corellm bench``: validation (errors name the key path), seeded and
deterministic building, the statistics of every distribution and arrival process, sessions,
shared prefixes, class mixes, vLLM's random dataset, the example files, and the
``corellm bench workload`` generator and ``--describe``. No model is needed."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from corellm_plugins.bench.workload_args import spec_from_vllm_args
from corellm_plugins.bench.distributions import arrival_times
from corellm_plugins.bench.workload import (BenchRequest, Workload, build_workload,
                                            context_lengths, workload_stats)
from corellm_plugins.bench.workload_cli import add_workload_subcommand
from corellm_plugins.bench.workload_spec import WorkloadError, load_workload_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "workloads"
VOCAB = 1000


def spec(**overrides) -> dict:
    base = {"num_requests": 40, "requests": {"input_len": 8, "output_len": 4}}
    for key, value in overrides.items():
        if key == "requests":
            base["requests"] = {**base["requests"], **value}
        else:
            base[key] = value
    return base


def build(data: dict, seed: int | None = None, **kw) -> Workload:
    return build_workload(load_workload_spec(data), vocab_size=VOCAB, seed=seed, **kw)


def lengths(dist, n: int = 4000, seed: int = 0) -> np.ndarray:
    """``n`` draws of a length distribution, as the input lengths of a workload."""
    w = build(spec(num_requests=n, requests={"input_len": dist}), seed=seed)
    return np.array([len(r.prompt_token_ids) for r in w.requests])


def problems(data) -> list[tuple[str, str]]:
    with pytest.raises(WorkloadError) as info:
        load_workload_spec(data)
    return info.value.problems


# ----------------------------------------------------------------------------- determinism
def test_same_seed_same_requests_different_seed_different():
    data = spec(requests={"input_len": {"dist": "uniform", "low": 4, "high": 64}},
                tenants=[{"name": "a"}, {"name": "b"}],
                priorities=[{"priority": 0}, {"priority": 1}],
                arrivals={"pattern": "poisson", "rate": 5})
    a, b = build(data), build(data)
    assert a.requests == b.requests
    c = build(data, seed=1)
    assert [r.prompt_token_ids for r in c.requests] != [r.prompt_token_ids for r in a.requests]
    assert [r.delay_s for r in c.requests] != [r.delay_s for r in a.requests]
    # The seed argument overrides the spec's, and is what the result records.
    assert build({**data, "seed": 1}).requests == c.requests
    assert c.spec["seed"] == 1 and a.spec["seed"] == 0 and "seed 1" in c.description


def test_each_aspect_draws_from_its_own_stream():
    """Adding tenants must not change the prompts or arrivals: workloads that differ in one
    knob stay comparable request by request."""
    base = spec(requests={"input_len": {"dist": "uniform", "low": 4, "high": 64}},
                arrivals={"pattern": "poisson", "rate": 5})
    with_tenants = {**base, "tenants": [{"name": "a"}, {"name": "b", "weight": 3}]}
    a, b = build(base), build(with_tenants)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.delay_s for r in a.requests] == [r.delay_s for r in b.requests]
    assert {r.user for r in a.requests} == {None} and {r.user for r in b.requests} == {"a", "b"}


def test_random_prompts_avoid_excluded_ids_and_stay_in_vocab():
    w = build_workload(load_workload_spec(spec(requests={"input_len": 50})), vocab_size=20,
                       exclude_ids={0, 5})
    ids = {t for r in w.requests for t in r.prompt_token_ids}
    assert ids <= set(range(20)) - {0, 5} and len(ids) == 18
    with pytest.raises(WorkloadError, match="no token ids"):
        build_workload(load_workload_spec(spec()), vocab_size=2, exclude_ids={0, 1})


# ----------------------------------------------------------------------------- distributions
def test_fixed_and_plain_integer_lengths():
    assert set(lengths(7, n=50)) == {7}
    assert set(lengths({"dist": "fixed", "value": 3}, n=50)) == {3}
    w = build(spec(requests={"output_len": 9}))
    assert {r.output_len for r in w.requests} == {9}


def test_uniform_lengths_inclusive_bounds_and_mean():
    x = lengths({"dist": "uniform", "low": 10, "high": 20})
    assert x.min() == 10 and x.max() == 20          # both ends are reachable
    assert set(x) == set(range(10, 21))
    assert abs(x.mean() - 15) < 0.25                # sd of the mean: 3.2 / sqrt(4000) = 0.05


def test_normal_lengths_mean_std_and_clipping():
    x = lengths({"dist": "normal", "mean": 100, "std": 10})
    assert abs(x.mean() - 100) < 1.0 and abs(x.std() - 10) < 1.0
    assert x.dtype.kind == "i"
    clipped = lengths({"dist": "normal", "mean": 100, "std": 40, "min": 80, "max": 110})
    assert clipped.min() == 80 and clipped.max() == 110
    # Clipping piles the tails onto the bounds: P(N(100, 40) > 110) ~ 0.4.
    assert 0.3 < np.mean(clipped == 110) < 0.5


def test_file_lengths_text_and_json(tmp_path):
    (tmp_path / "lens.txt").write_text("# lengths seen in production\n5, 7\n11\n")
    (tmp_path / "lens.json").write_text("[3, 300]")
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(spec(
        num_requests=600, requests={"input_len": {"dist": "file", "path": "lens.txt"},
                                    "output_len": {"dist": "file", "path": "lens.json"}})))
    # Relative paths are relative to the workload file, wherever the process runs.
    w = build_workload(load_workload_spec(tmp_path / "w.yaml"), vocab_size=VOCAB)
    ins = Counter(len(r.prompt_token_ids) for r in w.requests)
    outs = Counter(r.output_len for r in w.requests)
    assert set(ins) == {5, 7, 11} and min(ins.values()) > 150     # ~200 each
    assert set(outs) == {3, 300}


def test_mixture_exact_shares_and_component_bounds():
    mix = {"dist": "mixture", "components": [
        {"weight": 3, "dist": "uniform", "low": 10, "high": 20},
        {"weight": 1, "dist": "fixed", "value": 500}]}
    for seed in range(3):
        x = lengths(mix, n=100, seed=seed)
        assert np.sum(x == 500) == 25                        # exactly its share, every seed
        short = x[x != 500]
        assert short.min() >= 10 and short.max() <= 20
    # ... in a shuffled order: the long ones are spread out, not one block of 25.
    long_at = np.flatnonzero(lengths(mix, n=100) == 500)
    assert long_at.max() - long_at.min() > 50


def test_think_time_distributions():
    def think(dist, n=3000):
        w = build({"requests": {"input_len": 2, "output_len": 1},
                   "sessions": {"num_sessions": n, "turns": 2, "think_time_s": dist}})
        return np.array([r.delay_s for r in w.requests if r.follows is not None])

    assert set(think(1.5, n=10)) == {1.5}
    e = think({"dist": "exponential", "mean": 2.0})
    assert abs(e.mean() - 2.0) < 0.15 and e.min() >= 0 and abs(e.std() / e.mean() - 1) < 0.1
    u = think({"dist": "uniform", "low": 1, "high": 3})
    assert u.min() >= 1 and u.max() <= 3 and abs(u.mean() - 2) < 0.05
    nrm = think({"dist": "normal", "mean": 0.5, "std": 1.0})
    assert nrm.min() == 0.0                      # clipped at min (default 0): no negative waits


# ----------------------------------------------------------------------------- arrivals
def gaps(pattern: dict | str, n: int = 20000, seed: int = 0) -> np.ndarray:
    """Inter-arrival gaps (the first from t=0) of ``n`` arrivals."""
    arrivals = load_workload_spec(spec(arrivals=pattern)).arrivals
    t = arrival_times(arrivals, n, np.random.default_rng(seed))
    assert np.all(np.diff(t) >= 0)
    return np.diff(np.concatenate([[0.0], t]))


def test_arrivals_in_a_built_workload():
    w = build(spec(num_requests=200, arrivals={"pattern": "gamma", "rate": 10,
                                               "burstiness": 0.5}))
    t = np.array([r.delay_s for r in w.requests])
    assert np.all(np.diff(t) >= 0)                       # requests listed in arrival order
    assert t[0] > 0 and t[-1] == pytest.approx(20.0)     # rescaled: the last at n / rate
    assert {r.follows for r in w.requests} == {None}
    w = build(spec(num_requests=10, arrivals="all_at_once"))   # the string shorthand
    assert {r.delay_s for r in w.requests} == {0.0}


def test_all_at_once():
    assert set(gaps({"pattern": "all_at_once"}, n=10)) == {0.0}


def test_poisson_and_gamma_mean_gap_is_one_over_rate():
    for pattern in ({"pattern": "poisson", "rate": 4, "rescale": False},
                    {"pattern": "gamma", "rate": 4, "burstiness": 0.25, "rescale": False},
                    {"pattern": "gamma", "rate": 4, "burstiness": 4, "rescale": False}):
        g = gaps(pattern)
        # sd of the mean gap: cv / (rate * sqrt(n)) <= 2 / (4 * 141) ~ 0.0035
        assert abs(g.mean() - 0.25) < 0.015, pattern
        assert g[0] > 0                                   # as vLLM: the first waits one gap


def test_burstiness_controls_the_coefficient_of_variation():
    def cv(b):
        g = gaps({"pattern": "gamma", "rate": 4, "burstiness": b})
        return g.std() / g.mean()

    # gamma(shape b): cv = 1/sqrt(b)
    assert abs(cv(1.0) - 1.0) < 0.05
    assert abs(cv(0.25) - 2.0) < 0.15
    assert cv(0.25) > cv(1.0) > cv(4.0)
    assert abs(cv(4.0) - 0.5) < 0.05
    poisson = gaps({"pattern": "poisson", "rate": 4})
    assert abs(poisson.std() / poisson.mean() - 1.0) < 0.05
    constant = gaps({"pattern": "gamma", "rate": 4, "burstiness": math.inf}, n=10)
    assert np.allclose(constant, 0.25)


def test_rescale_puts_the_last_arrival_at_n_over_rate():
    rng = np.random.default_rng(0)
    spec_ = load_workload_spec(spec(arrivals={"pattern": "gamma", "rate": 2, "burstiness": 0.5}))
    t = arrival_times(spec_.arrivals, 50, rng)
    assert t[-1] == pytest.approx(25.0) and t[0] > 0
    raw = load_workload_spec(spec(arrivals={"pattern": "gamma", "rate": 2, "burstiness": 0.5,
                                            "rescale": False}))
    t2 = arrival_times(raw.arrivals, 50, np.random.default_rng(0))
    assert t2[-1] != pytest.approx(25.0)
    # One common factor: the gaps keep their relative shape.
    assert np.allclose(t / t[-1], t2 / t2[-1])


# ----------------------------------------------------------------------------- vLLM's random set
def test_vllm_range_ratio_bounds():
    s = spec_from_vllm_args(input_len=100, output_len=10, range_ratio=0.1, num_prompts=3000,
                            request_rate=math.inf, burstiness=1.0, seed=0)
    w = build_workload(s, vocab_size=VOCAB)
    ins = [len(r.prompt_token_ids) for r in w.requests]
    outs = [r.output_len for r in w.requests]
    assert (min(ins), max(ins)) == (90, 110)         # not 111: no float noise in the bounds
    assert (min(outs), max(outs)) == (9, 11)
    assert len(w.requests) == 3000 and {r.delay_s for r in w.requests} == {0.0}
    # The output range never goes below one token; ratio 0 means fixed lengths.
    s = spec_from_vllm_args(input_len=64, output_len=2, range_ratio=0.9, num_prompts=500,
                            request_rate=math.inf, burstiness=1.0, seed=0)
    outs = {r.output_len for r in build_workload(s, vocab_size=VOCAB).requests}
    assert min(outs) == 1 and max(outs) == 4         # floor(0.2) -> 1, ceil(3.8) = 4
    s = spec_from_vllm_args(input_len=64, output_len=8, range_ratio=0.0, num_prompts=5,
                            request_rate=math.inf, burstiness=1.0, seed=0)
    assert s.requests.input_len.dist == "fixed" and s.requests.output_len.dist == "fixed"


def test_vllm_rate_and_burstiness_map_to_arrivals():
    def arrivals(rate, burst):
        return spec_from_vllm_args(input_len=8, output_len=8, range_ratio=0.0, num_prompts=4,
                                   request_rate=rate, burstiness=burst, seed=3).arrivals

    assert arrivals(math.inf, 0.5).pattern == "all_at_once"
    assert arrivals(2.0, 1.0).pattern == "poisson"
    g = arrivals(2.0, 0.5)
    assert (g.pattern, g.rate, g.burstiness) == ("gamma", 2.0, 0.5)
    s = spec_from_vllm_args(input_len=8, output_len=8, range_ratio=0.0, num_prompts=4,
                            request_rate=2.0, burstiness=0.5, seed=3)
    assert s.seed == 3 and s.num_requests == 4


def test_vllm_args_errors():
    with pytest.raises(WorkloadError, match="random_range_ratio"):
        spec_from_vllm_args(input_len=8, output_len=8, range_ratio=1.0, num_prompts=4,
                            request_rate=1.0, burstiness=1.0, seed=0)
    with pytest.raises(WorkloadError, match="shortest prompt would be 0"):
        spec_from_vllm_args(input_len=1, output_len=8, range_ratio=0.5, num_prompts=4,
                            request_rate=1.0, burstiness=1.0, seed=0)
    with pytest.raises(WorkloadError, match="burstiness"):
        spec_from_vllm_args(input_len=8, output_len=8, range_ratio=0.0, num_prompts=4,
                            request_rate=1.0, burstiness=0.0, seed=0)


# ----------------------------------------------------------------------------- structure
def test_shared_prefix_groups_share_their_prefix():
    w = build(spec(num_requests=30, requests={
        "input_len": {"dist": "uniform", "low": 5, "high": 9},
        "shared_prefix": {"num_groups": 3, "length": 16}}))
    by_group: dict[int, list[BenchRequest]] = {}
    for r in w.requests:
        by_group.setdefault(r.shared_prefix_group, []).append(r)
    assert sorted(by_group) == [0, 1, 2] and [len(v) for v in by_group.values()] == [10] * 3
    prefixes = {}
    for g, reqs in by_group.items():
        heads = {tuple(r.prompt_token_ids[:16]) for r in reqs}
        assert len(heads) == 1                               # one prefix per group
        prefixes[g] = heads.pop()
        assert all(5 + 16 <= len(r.prompt_token_ids) <= 9 + 16 for r in reqs)
        # ... followed by each request's own tokens.
        assert len({tuple(r.prompt_token_ids[16:]) for r in reqs}) == len(reqs)
    assert len(set(prefixes.values())) == 3                  # groups differ


def test_sessions_link_turns():
    w = build({"requests": {"input_len": 20, "output_len": 5},
               "sessions": {"num_sessions": 6, "turns": 3, "message_len": 4,
                            "think_time_s": {"dist": "uniform", "low": 0.5, "high": 1.5}},
               "tenants": [{"name": "a"}, {"name": "b"}],
               "priorities": [{"priority": 0}, {"priority": 2}],
               "arrivals": {"pattern": "poisson", "rate": 2}})
    reqs = w.requests
    assert len(reqs) == 18 and [r.index for r in reqs] == list(range(18))
    sessions: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 6
    starts = []
    for turns in sessions.values():
        first, *rest = turns
        assert first.follows is None and len(first.prompt_token_ids) == 20
        starts.append(first.delay_s)
        for prev, cur in zip(turns, rest):
            assert cur.follows == prev.index                  # a chain, in order
            assert len(cur.prompt_token_ids) == 4             # only the new message
            assert 0.5 <= cur.delay_s <= 1.5                  # think time
        # A session belongs to one tenant and one priority class.
        assert len({r.user for r in turns}) == 1 and len({r.priority for r in turns}) == 1
    assert starts == sorted(starts) and starts[0] > 0
    assert Counter(t[0].user for t in sessions.values()) == {"a": 3, "b": 3}
    # Contexts grow with the history: 20+5, then +4+5 per turn.
    assert context_lengths(reqs)[:3] == [25, 34, 43]


def test_session_turns_from_a_distribution():
    w = build({"requests": {"input_len": 3, "output_len": 1},
               "sessions": {"num_sessions": 200, "turns": {"dist": "uniform", "low": 1,
                                                           "high": 5}}})
    per = Counter(r.session_id for r in w.requests)
    assert len(per) == 200 and min(per.values()) == 1 and max(per.values()) == 5
    # Without message_len, follow-ups use input_len.
    assert {len(r.prompt_token_ids) for r in w.requests} == {3}


def test_tenant_and_priority_shares_are_exact():
    w = build(spec(num_requests=50, tenants=[{"name": "a", "weight": 3},
                                             {"name": "b", "weight": 1},
                                             {"name": "c", "weight": 1}],
                   priorities=[{"priority": 0, "weight": 1}, {"priority": 1, "weight": 4}]))
    assert Counter(r.user for r in w.requests) == {"a": 30, "b": 10, "c": 10}
    assert Counter(r.priority for r in w.requests) == {0: 10, 1: 40}
    # Shuffled: the interactive class is spread through the backlog.
    first = [r.index for r in w.requests if r.priority == 0]
    assert first != list(range(10))
    stats = workload_stats(w)
    assert stats["tenants"] == {"a": 30, "b": 10, "c": 10} and stats["priorities"] == {0: 10,
                                                                                        1: 40}


def test_workload_spec_is_plain_json():
    w = build(spec(arrivals={"pattern": "gamma", "rate": 1, "burstiness": math.inf}))
    text = json.dumps(w.spec, allow_nan=False)
    assert json.loads(text)["arrivals"]["burstiness"] == "inf"
    # ... and the recorded spec rebuilds the same workload.
    assert build(json.loads(text)).requests == w.requests


def test_max_model_len_rejects_contexts_that_do_not_fit():
    data = {"requests": {"input_len": 100, "output_len": 50},
            "sessions": {"num_sessions": 2, "turns": 3, "message_len": 10}}
    # The last turn: 100 + 50 + (10 + 50) * 2 = 270 tokens.
    build(data, max_model_len=270)
    with pytest.raises(WorkloadError, match="270 tokens"):
        build(data, max_model_len=269)


# ----------------------------------------------------------------------------- prompt files
def test_prompts_from_a_file(tmp_path, tokenizer):
    lines = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5], "output_len": 7},
             {"prompt": "hello world"}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    data = {"num_requests": 6,
            "requests": {"output_len": 3, "prompts": {"source": "file", "path": str(path),
                                                      "order": "sequential"}}}
    w = build(data, tokenizer=tokenizer)
    text_ids = tokenizer.encode("hello world", add_special_tokens=True)
    assert [r.prompt_token_ids for r in w.requests] == [[1, 2, 3], [4, 5], text_ids] * 2
    assert [r.output_len for r in w.requests] == [3, 7, 3] * 2
    # shuffle: every line once per pass, in a seeded order that changes with the seed.
    data["requests"]["prompts"]["order"] = "shuffle"
    orders = {tuple(map(tuple, (r.prompt_token_ids for r in
                                build(data, seed=s, tokenizer=tokenizer).requests[:3])))
              for s in range(6)}
    assert all(len(set(o)) == 3 for o in orders) and len(orders) > 1


def test_text_prompts_need_a_tokenizer(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    spec_ = load_workload_spec({"num_requests": 2, "requests": {
        "output_len": 3, "prompts": {"source": "file", "path": str(path)}}})
    with pytest.raises(WorkloadError) as info:
        build_workload(spec_, vocab_size=VOCAB)
    path_, msg = info.value.problems[0]
    assert path_ == "requests.prompts.path" and "tokenizer" in msg


def test_prompt_file_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n" + '{"text": "x"}\n')
    (p, msg), = problems({"num_requests": 1, "requests": {
        "output_len": 1, "prompts": {"source": "file", "path": str(path)}}})
    assert p == "requests.prompts.path" and "p.jsonl:2" in msg
    path.write_text(json.dumps({"prompt_token_ids": [1, 5000]}) + "\n")
    with pytest.raises(WorkloadError, match="outside the vocabulary"):
        build({"num_requests": 1, "requests": {"output_len": 1, "prompts": {
            "source": "file", "path": str(path)}}})


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_key_path(tmp_path):
    assert problems(spec(requests={"input_lne": 5})) == [
        ("requests.input_lne", "unknown key; did you mean input_len?")]
    assert problems(spec(arrivals={"pattern": "poisson", "rate": -2}))[0][0] == "arrivals.rate"
    mix = problems(spec(requests={"input_len": {"dist": "mixture", "components": []}}))
    assert mix == [("requests.input_len.components", "must not be empty")]
    bad_component = problems(spec(requests={"input_len": {"dist": "mixture", "components": [
        {"dist": "fixed", "value": 4}, {"dist": "uniform", "low": 9, "high": 3}]}}))
    assert bad_component[0][0] == "requests.input_len.components.1.high"
    (p, msg), = problems(spec(requests={"input_len": {"dist": "unifrom", "low": 1, "high": 2}}))
    assert p == "requests.input_len.dist" and "did you mean uniform" in msg
    (p, msg), = problems(spec(requests={"input_len": {"low": 1, "high": 2}}))
    assert p == "requests.input_len.dist" and "uniform" in msg
    assert problems(spec(requests={"input_len": 0}))[0][0] == "requests.input_len"
    assert problems({"requests": {"input_len": 1, "output_len": 1}})[0][0] == "num_requests"
    assert problems(spec(sessions={"num_sessions": 2, "turns": 2}))[0][0] == "num_requests"
    assert problems(spec(sessions={"num_sessions": 2, "turns": 2, "thinktime": 1}),
                    )[-1][0] == "sessions.thinktime"
    assert problems(spec(tenants=[{"name": "a"}, {"name": "a"}]))[0][0] == "tenants"
    assert problems(spec(tenants=[]))[0][0] == "tenants"
    assert problems(spec(priorities=[{"priority": 0, "weight": 0}]))[0][0] == \
        "priorities.0.weight"
    assert problems(spec(requests={"output_len": {"dist": "file", "path": "nope.txt"}}))[0][0] \
        == "requests.output_len.path"
    assert problems({**spec(), "requests": {"output_len": 2}})[0] == (
        "requests.input_len", "required with random prompts")
    assert problems(spec(bogus=1))[0] == ("bogus", "unknown key")
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_requests: [1\n")
    with pytest.raises(WorkloadError, match="bad.yaml"):
        load_workload_spec(bad)


def test_error_message_lists_every_problem():
    with pytest.raises(WorkloadError) as info:
        load_workload_spec(spec(requests={"input_len": -1, "output_len": {"dist": "normal"}},
                                arrivals={"pattern": "gamma", "rate": 0}))
    text = str(info.value)
    for key in ("requests.input_len", "requests.output_len.mean", "arrivals.rate",
                "arrivals.burstiness"):
        assert f"  {key}: " in text


# ----------------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", ["backlog-priority", "chat-sessions", "mixed-lengths"])
def test_example_workloads_load_and_build(name):
    spec_ = load_workload_spec(EXAMPLES / f"{name}.yaml")
    # The demo model: vocab 4096, max_model_len 2048.
    w = build_workload(spec_, vocab_size=4096, exclude_ids={0}, max_model_len=2048)
    assert w.description.startswith(name) and 20 <= len(w.requests) <= 64
    stats = workload_stats(w)
    if name == "backlog-priority":
        assert stats["arrival_span_s"] == 0 and set(stats["priorities"]) == {0, 1}
    if name == "chat-sessions":
        assert stats["sessions"] >= 4 and stats["follow_ups"] > 0 and len(stats["tenants"]) >= 2
    if name == "mixed-lengths":
        lens = [len(r.prompt_token_ids) for r in w.requests]
        assert min(lens) < 100 < 300 < max(lens) and stats["arrival_span_s"] > 0


def test_example_configs_are_valid_ab_pair():
    from corellm.config.compose import read_config_file
    fcfs = read_config_file(EXAMPLES / "fcfs.yaml")
    prio = read_config_file(EXAMPLES / "priority.yaml")
    assert fcfs["scheduler"]["name"] == "fcfs" and prio["scheduler"]["name"] == "priority"
    # The default model (whichever is installed), capped so the small pool holds a request.
    assert fcfs["model"] == prio["model"] == {"max_model_len": 2048}
    # Everything but the policy is the same, so the A/B isolates it.
    assert {k: v for k, v in fcfs["scheduler"].items() if k != "name"} == \
        {k: v for k, v in prio["scheduler"].items() if k != "name"}
    assert fcfs["kv_cache"] == prio["kv_cache"]
    readme = (EXAMPLES / "README.md").read_text()
    for f in ("backlog-priority.yaml", "chat-sessions.yaml", "mixed-lengths.yaml", "fcfs.yaml",
              "priority.yaml"):
        assert f in readme


# ----------------------------------------------------------------------------- the command
def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="corellm bench")
    add_workload_subcommand(parser.add_subparsers())
    args = parser.parse_args(["workload", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv", [
    ["--kind", "backlog"],
    ["--kind", "chat"],
    ["--kind", "mixed"],
    ["--kind", "backlog", "--num-requests", "20", "--input-len", "8:16", "--output-len", "4",
     "--rate", "3", "--burstiness", "0.5", "--tenants", "a:3,b:1", "--priorities", "0:1,1:1,2:2",
     "--shared-prefix", "2:8", "--seed", "5", "--name", "custom"],
    ["--kind", "mixed", "--sessions", "4", "--turns", "2:3", "--think-time", "0.5",
     "--message-len", "6", "--no-tenants", "--rate", "inf"],
])
def test_generator_round_trips_through_the_loader(argv, capsys, tmp_path):
    out = tmp_path / "w.yaml"
    rc, _, _ = run_cli([*argv, "-o", str(out)], capsys)
    assert rc == 0
    text = out.read_text()
    assert text.startswith("# corellm bench workload") and "\n# " in text   # commented
    spec_ = load_workload_spec(out)
    w = build_workload(spec_, vocab_size=VOCAB)
    assert w.requests
    # Stdout gets the same file.
    rc, stdout, _ = run_cli(argv, capsys)
    assert yaml.safe_load(stdout) == yaml.safe_load(text)
    if "custom" in argv:
        assert spec_.name == "custom" and spec_.seed == 5 and len(w.requests) == 20
        assert Counter(r.user for r in w.requests) == {"a": 15, "b": 5}
        assert Counter(r.priority for r in w.requests) == {0: 5, 1: 5, 2: 10}
        assert (spec_.arrivals.pattern, spec_.arrivals.rate,
                spec_.arrivals.burstiness) == ("gamma", 3, 0.5)
        assert all(8 + 8 <= len(r.prompt_token_ids) <= 16 + 8 for r in w.requests)
        assert {r.shared_prefix_group for r in w.requests} == {0, 1}
    if "--sessions" in argv:
        assert spec_.num_requests is None and spec_.sessions.num_sessions == 4
        assert spec_.arrivals.pattern == "all_at_once" and spec_.tenants is None
        assert {len(r.prompt_token_ids) for r in w.requests if r.follows is not None} == {6}


def test_generator_rejects_contradictory_flags(capsys):
    rc, _, err = run_cli(["--kind", "chat", "--num-requests", "5"], capsys)
    assert rc == 2 and "--sessions" in err
    rc, _, err = run_cli(["--kind", "backlog", "--burstiness", "0.5"], capsys)
    assert rc == 2 and "--rate" in err
    rc, _, err = run_cli(["--kind", "backlog", "--turns", "3"], capsys)
    assert rc == 2 and "--sessions" in err
    with pytest.raises(SystemExit):
        run_cli(["--tenants", "a:0"], capsys)


def test_help_lists_kinds_and_examples(capsys):
    with pytest.raises(SystemExit):
        run_cli(["--help"], capsys)
    out = capsys.readouterr().out
    for text in ("--kind", "backlog", "chat", "mixed", "--describe", "--tenants",
                 "corellm bench --workload"):
        assert text in out


def test_describe(capsys):
    rc, out, _ = run_cli(["--describe", str(EXAMPLES / "chat-sessions.yaml")], capsys)
    assert rc == 0
    w = build_workload(load_workload_spec(EXAMPLES / "chat-sessions.yaml"), vocab_size=VOCAB)
    n = len(w.requests)
    sessions = len({r.session_id for r in w.requests})
    assert f"{n} in {sessions} sessions" in out
    for tenant, count in Counter(r.user for r in w.requests).items():
        assert f"{tenant}: {count} (" in out
    assert "arrivals" in out and "first turns over" in out and "think time" in out
    rc, out, _ = run_cli(["--describe", str(EXAMPLES / "backlog-priority.yaml"), "--json"],
                         capsys)
    stats = json.loads(out)
    assert stats["requests"] == 48 and stats["arrival_span_s"] == 0
    assert stats["priorities"] == {"0": 10, "1": 38}
    outs = [r.output_len for r in build_workload(load_workload_spec(
        EXAMPLES / "backlog-priority.yaml"), vocab_size=VOCAB).requests]
    assert stats["output_tokens"]["sum"] == sum(outs)
    rc, _, err = run_cli(["--describe", str(EXAMPLES / "fcfs.yaml")], capsys)
    assert rc == 2 and "scheduler" in err


def test_prompt_ids_are_drawn_as_choice_draws_them():
    """Random prompts are drawn in one call for the whole workload and sliced: the ids of one
    ``rng.choice(allowed, size=n)`` per prompt, which is what earlier releases drew (so seeded
    workloads keep their prompts). Both identities that rely on numpy's generator hold."""
    from corellm_plugins.bench.workload import build_workload, draw_tokens

    rng = np.random.default_rng(0)
    for vocab in (2, 1000, 49152, 2 ** 31 - 1):
        allowed = np.arange(3, vocab + 3, dtype=np.int64)
        sizes = [int(n) for n in rng.integers(0, 200, size=30)]
        a, b, c = (np.random.default_rng([vocab, 7]) for _ in range(3))
        per_prompt = [a.choice(allowed, size=n).tolist() for n in sizes]
        assert [draw_tokens(b, allowed, n) for n in sizes] == per_prompt
        once = draw_tokens(c, allowed, sum(sizes))
        offsets = np.cumsum([0, *sizes])
        assert [once[i:j] for i, j in zip(offsets, offsets[1:])] == per_prompt
    spec = {"name": "s", "seed": 5,
            "requests": {"input_len": {"dist": "uniform", "low": 4, "high": 30},
                         "output_len": 4},
            "sessions": {"num_sessions": 6, "turns": {"dist": "uniform", "low": 1, "high": 4},
                         "message_len": {"dist": "uniform", "low": 2, "high": 9}},
            "arrivals": "all_at_once"}
    wl = build_workload(spec, vocab_size=500, exclude_ids={0, 1}, seed=3)
    from corellm_plugins.bench.workload import _rng, allowed_token_ids
    token_rng, allowed = _rng(3, "tokens"), allowed_token_ids(500, {0, 1})
    assert [r.prompt_token_ids for r in wl.requests] == [
        token_rng.choice(allowed, size=len(r.prompt_token_ids)).tolist() for r in wl.requests]
