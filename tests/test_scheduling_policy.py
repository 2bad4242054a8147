"""The policy interface (0.3): the waiting queue, the scheduling context, the priority scheduler,
and the mechanism's guarantee that no policy answer can leak a block or lose a request."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corellm import LLM, SamplingParams
from corellm.errors import InvalidRequestError, PluginError
from corellm.interfaces import SchedulingPolicy
from corellm.request import EngineCoreRequest, Request, RequestStatus
from corellm.scheduling import WaitingQueue
from tests.conftest import assert_pool_whole, engine_config
from tests.test_engine import policy_plugin, tight_pool_config

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_request(rid: str, n: int = 4, priority: int = 0, user: str | None = None) -> Request:
    core = EngineCoreRequest(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4), None,
                             time.time(), priority=priority, user=user)
    return Request(core, max_model_len=512)


# --------------------------------------------------------------------------- the waiting queue
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "take"]), st.integers(0, 5),
                          st.integers(0, 2)), max_size=120))
def test_waiting_queue_matches_a_sorted_list(ops):
    """Against a plain list model: first(), best(k) and heads() agree with sorting the live
    requests by (key, arrival), across pushes, lazy removals, re-pushes and rebuilds."""
    WaitingQueue._REBUILD_MIN = 4        # exercise rebuilds in small queues too
    try:
        queue, model = WaitingQueue(), {}          # rid -> (key, seq, group, request)
        pool = [make_request(f"r{i}") for i in range(30)]
        for op, key, group in ops:
            if op == "push":
                free = [r for r in pool if r.request_id not in model]
                if free:
                    r = free[key % len(free)]
                    queue.push(r, key, group)
                    model[r.request_id] = (key, r.arrival_seq, group, r)
            elif model:
                rid = sorted(model)[key % len(model)] if op == "remove" else None
                if op == "take":       # what admission does: remove the best
                    rid = min(model.values(), key=lambda e: e[:2])[3].request_id
                assert queue.remove(model.pop(rid)[3])
            live = sorted(model.values(), key=lambda e: e[:2])
            assert len(queue) == len(live)
            assert queue.first() is (live[0][3] if live else None)
            assert queue.best(3) == [e[3] for e in live[:3]]
            heads = {}
            for e in live:
                heads.setdefault(e[2], e[3])
            assert queue.heads() == heads
            assert set(queue) == {e[3] for e in live}
    finally:
        WaitingQueue._REBUILD_MIN = 256


def test_waiting_queue_refuses_a_duplicate_and_ignores_unknown_removal():
    queue, r = WaitingQueue(), make_request("a")
    queue.push(r, 0)
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(r, 1)
    assert not queue.remove(make_request("b"))
    assert r in queue and make_request("a") not in queue     # identity, not id


# --------------------------------------------------------------------------- the context
class Recorder(SchedulingPolicy):
    """FCFS that records what every decision saw."""

    seen: list = []

    def waiting_key(self, request, ctx):
        Recorder.seen.append(("key", request.request_id, request.priority, request.user,
                              request.session_id, ctx.cached_tokens(request), ctx.now))
        return request.arrival_seq

    def choose_victim(self, running, ctx):
        return running[-1]

    def select(self, waiting, ctx):
        Recorder.seen.append(("select", len(waiting), len(ctx.running), ctx.num_waiting))
        return waiting.first()


def test_attributes_and_live_state_reach_the_policy(llama_path):
    Recorder.seen = []
    cfg = engine_config(llama_path, scheduler={"name": "recorder"})
    llm = LLM(cfg, plugins=[policy_plugin("recorder", Recorder)])
    prefix = list(range(100, 148))                   # 3 whole blocks
    t0 = time.time()
    llm.generate({"prompt_token_ids": prefix + [5]}, GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prefix + [6]}, {"prompt_token_ids": [7, 8]}], GREEDY,
                 priority=[3, -1], user=["acme", None], session_id="s1", use_tqdm=False)
    keys = [s for s in Recorder.seen if s[0] == "key"]
    assert [k[1:5] for k in keys] == [("0", 0, None, None), ("1", 3, "acme", "s1"),
                                      ("2", -1, None, "s1")]
    assert keys[0][5] == 0 and keys[1][5] == 48 and keys[2][5] == 0   # lazily looked-up hits
    assert all(t0 <= k[6] <= time.time() for k in keys)
    assert ("select", 2, 0, 2) in Recorder.seen
    assert_pool_whole(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"user": "x" * 300}, "user"), ({"session_id": ""}, "session_id"),
    ({"user": 5}, "user"), ({"priority": 1.5}, "priority"),
    ({"user": ["a", "b", "c"]}, "user"),
])
def test_bad_scheduling_attributes_name_the_field(llama_path, kwargs, field):
    llm = LLM(engine_config(llama_path))
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, **kwargs)
    assert info.value.field.endswith(field)
    assert not llm.engine.has_unfinished_requests()


def test_attributes_cross_the_process_boundary():
    from corellm.engine import ipc
    req = EngineCoreRequest("r", [1, 2], SamplingParams(), 0, 1.0, priority=-2, user="t",
                            session_id="s")
    back = ipc.request_decoder.decode(ipc.encoder.encode(req))
    assert (back.priority, back.user, back.session_id) == (-2, "t", "s")


def test_a_policy_of_the_old_interface_fails_at_start_up(llama_path):
    class Old(SchedulingPolicy):
        def waiting_key(self, request):                       # 0.2: no ctx
            return request.arrival_seq

        def choose_victim(self, running):
            return running[-1]

    with pytest.raises(PluginError, match=r"Old.waiting_key\(request\) does not take .*0\.3"):
        LLM(engine_config(llama_path, scheduler={"name": "old"}),
            plugins=[policy_plugin("old", Old)])


# --------------------------------------------------------------------------- priority
def finish_order(llm, requests) -> list[str]:
    for rid, n, prio in requests:
        _, core = llm.processor.process(rid, {"prompt_token_ids": list(range(10, 10 + n))},
                                        GREEDY, prio)
        llm.engine.add_request(core)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    return order


def test_priority_order_step_by_step(llama_path):
    """One request at a time: admitted by (priority, arrival); FCFS ignores priority."""
    reqs = [("a", 5, 2), ("b", 5, 0), ("c", 5, 1), ("d", 5, 0), ("e", 5, -3)]
    for name, expected in (("priority", ["e", "b", "d", "c", "a"]),
                           ("fcfs", ["a", "b", "c", "d", "e"])):
        llm = LLM(engine_config(llama_path, scheduler={"name": name, "max_num_seqs": 1}))
        assert finish_order(llm, reqs) == expected, name
        assert_pool_whole(llm)


def _arrive_into_full_batch(llm, max_tokens=30):
    """Two low-priority requests fill the batch; after 3 steps a high-priority one arrives."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = {"low0": list(range(10, 50)), "low1": list(range(60, 100)),
               "high": list(range(200, 240))}
    for rid in ("low0", "low1"):
        llm.engine.add_request(llm.processor.process(rid, {"prompt_token_ids": prompts[rid]},
                                                     params, 5)[1])
    steps, events, tokens = 0, [], {rid: [] for rid in prompts}
    while llm.engine.has_unfinished_requests() or steps <= 3:
        if steps == 3:
            llm.engine.add_request(llm.processor.process(
                "high", {"prompt_token_ids": prompts["high"]}, params, 0)[1])
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        sched = llm.engine.scheduler
        events.append({r.request_id: r.status for r in sched.requests.values()})
    return prompts, tokens, events


@pytest.mark.parametrize("pressure", ["seats", "kv_blocks"])
def test_high_priority_arrival_preempts_a_low_priority_request(llama_path, pressure):
    """The batch (max_num_seqs=2) or the KV pool (8 blocks: two requests' 70 tokens need 10)
    is full of low-priority work when a high-priority request arrives: it preempts the worse
    (later) low-priority request at once, and every output equals an unpreempted run."""
    sched = {"name": "priority", "max_num_seqs": 2 if pressure == "seats" else 8}
    kv = {"num_blocks": 8} if pressure == "kv_blocks" else {}
    cfg = engine_config(llama_path, scheduler=sched, kv_cache=kv, model={"max_model_len": 70})
    llm = LLM(cfg)
    prompts, tokens, events = _arrive_into_full_batch(llm)
    # The step the high-priority request arrived in admitted it, and preempted low1.
    assert events[3]["high"] == RequestStatus.RUNNING
    assert events[3]["low1"] == RequestStatus.PREEMPTED
    assert events[3]["low0"] == RequestStatus.RUNNING or pressure == "kv_blocks"
    assert llm.get_stats().num_preemptions >= 1
    assert_pool_whole(llm)
    reference = LLM(engine_config(llama_path, scheduler={"max_num_seqs": 8}))
    for rid, ids in prompts.items():
        expected = reference.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert tokens[rid] == expected.outputs[0].token_ids, rid


def test_priority_does_not_preempt_when_that_cannot_make_room(llama_path):
    """8 blocks: A (priority 0, 4 blocks) and B (priority 5, 3 blocks) run when H (priority 1,
    70 tokens = 5 blocks) arrives. Preempting B, the only worse request, would free 3 blocks
    next to the 1 free: not enough, so B keeps its work and H waits for A to finish."""
    cfg = engine_config(llama_path, scheduler={"name": "priority"}, kv_cache={"num_blocks": 8},
                        model={"max_model_len": 128})
    llm = LLM(cfg)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rid, start, n, prio in (("A", 10, 60, 0), ("B", 100, 40, 5)):
        llm.engine.add_request(llm.processor.process(
            rid, {"prompt_token_ids": list(range(start, start + n))}, params, prio)[1])
    llm.engine.step()
    assert [r.request_id for r in llm.engine.scheduler.running] == ["A", "B"]
    assert llm.get_stats().kv_blocks_free == 1
    llm.engine.add_request(llm.processor.process(
        "H", {"prompt_token_ids": list(range(300, 370))}, params, 1)[1])
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o.request_id for o in llm.engine.step() if o.finished]
    assert llm.get_stats().num_preemptions == 0
    assert finished.index("A") < finished.index("H")
    assert_pool_whole(llm)


def test_priority_preemption_can_be_switched_off(llama_path):
    cfg = engine_config(llama_path, scheduler={"name": "priority", "max_num_seqs": 2,
                                               "preempt_lower_priority": False})
    llm = LLM(cfg)
    _, tokens, events = _arrive_into_full_batch(llm)
    assert events[3]["high"] == RequestStatus.WAITING
    assert llm.get_stats().num_preemptions == 0
    assert all(len(t) == 30 for t in tokens.values())
    assert_pool_whole(llm)


def test_equal_priority_never_preempts(llama_path):
    cfg = engine_config(llama_path, scheduler={"name": "priority", "max_num_seqs": 1})
    llm = LLM(cfg)
    assert finish_order(llm, [("a", 5, 1), ("b", 5, 1), ("c", 5, 1)]) == ["a", "b", "c"]
    assert llm.get_stats().num_preemptions == 0


# --------------------------------------------------------------------------- rogue policies
class RandomPolicy(SchedulingPolicy):
    """Every decision drawn at random from the answers the interface allows."""

    rng = random.Random(0)
    calls: dict[str, int] = {}

    def _count(self, name):
        RandomPolicy.calls[name] = RandomPolicy.calls.get(name, 0) + 1

    def waiting_key(self, request, ctx):
        return self.rng.random()

    def queue_group(self, request):
        return self.rng.randrange(3)

    def select(self, waiting, ctx):
        if self.rng.random() < 0.1:
            return None
        pool = waiting.best(self.rng.randint(1, 4)) + list(waiting.heads().values())
        return self.rng.choice(pool)

    def can_admit(self, request, ctx):
        return self.rng.random() < 0.8

    def choose_victim(self, running, ctx):
        self._count("choose_victim")
        return self.rng.choice(running)

    def preempt_for(self, request, running, ctx):
        if running and self.rng.random() < 0.5:
            self._count("preempt_for")
            return self.rng.choice(running)
        return None

    def on_scheduled(self, scheduled, ctx):
        assert all(n > 0 for _, n in scheduled)


@pytest.fixture(scope="module")
def random_policy_llm(llama_path):
    cfg = tight_pool_config(llama_path, scheduler={"name": "random", "max_num_seqs": 3,
                                                   "max_num_batched_tokens": 48})
    llm = LLM(cfg, plugins=[policy_plugin("random", RandomPolicy)])
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference_outputs(llama_path):
    llm = LLM(engine_config(llama_path))
    # Half the prompts share a 32-token prefix: cache hits, shared blocks held by several
    # requests (and by victims), and `pending` blocks all occur under the random policy.
    shared = list(range(500, 532))
    prompts = [(shared if i % 2 else []) + list(range(3 + i, 3 + i + n))
               for i, n in enumerate([60, 7, 33, 28, 18, 41])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(2, 6))
def test_no_policy_answer_can_corrupt_state(random_policy_llm, reference_outputs, seed, count):
    """Random keys, groups, selections, admission answers, victims and preemptions for waiting
    requests, in a pool where three requests cannot all fit: every request still finishes
    with the tokens of an unpreempted run, and every block returns."""
    RandomPolicy.rng = random.Random(seed)
    prompts, expected = reference_outputs
    outs = random_policy_llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:count]],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:count]
    assert_pool_whole(random_policy_llm)


def test_the_random_policy_run_is_not_vacuous(random_policy_llm, reference_outputs):
    """The property above really preempts both ways (a derandomized witness)."""
    RandomPolicy.rng, RandomPolicy.calls = random.Random(0), {}
    prompts, expected = reference_outputs
    before = random_policy_llm.get_stats().num_preemptions
    outs = random_policy_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(max_tokens=40, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert RandomPolicy.calls.get("choose_victim", 0) > 0
    assert RandomPolicy.calls.get("preempt_for", 0) > 0
    assert random_policy_llm.get_stats().num_preemptions - before == sum(
        RandomPolicy.calls.values())


@pytest.mark.parametrize("hook", ["on_finished", "on_scheduled", "waiting_key"])
def test_a_policy_that_raises_loses_nothing(llama_path, hook):
    """A policy callback that raises fails the step (or the call) it ran in; every request still
    ends, finished or with an error, every block returns, and the engine serves on."""
    calls = {"n": 0}

    class Raising(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            if hook == "waiting_key" and request.num_preemptions:      # on re-queue only
                raise ValueError("boom in waiting_key")
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return running[-1]

        def on_scheduled(self, scheduled, ctx):
            calls["n"] += 1
            if hook == "on_scheduled" and calls["n"] == 3:
                raise ValueError("boom in on_scheduled")

        def on_finished(self, request, ctx):
            if hook == "on_finished":
                raise ValueError("boom in on_finished")

    cfg = tight_pool_config(llama_path, scheduler={"name": "raising"})
    llm = LLM(cfg, plugins=[policy_plugin("raising", Raising)])
    with pytest.raises(ValueError, match=f"boom in {hook}"):
        llm.generate([{"prompt_token_ids": list(range(3 + i, 63 + i))} for i in range(3)],
                      SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    sched = llm.engine.scheduler
    assert not sched.requests and not sched.running and not sched.waiting
    assert_pool_whole(llm)
    if hook != "on_finished":
        assert llm.generate("again", GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize("method, answer, message", [
    ("select", lambda self, waiting, ctx: make_request("stranger"), "select returned .* not waiting"),
    ("preempt_for", lambda self, request, running, ctx: request,
     "preempt_for returned .* not running"),
])
def test_an_answer_outside_the_offer_is_an_error_and_loses_nothing(llama_path, method, answer,
                                                                   message):
    class Rogue(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return running[-1]

    setattr(Rogue, method, answer)
    cfg = engine_config(llama_path, scheduler={"name": "rogue", "max_num_seqs": 1})
    llm = LLM(cfg, plugins=[policy_plugin("rogue", Rogue)])
    with pytest.raises(RuntimeError, match=message):
        llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_pool_whole(llm)
    assert llm.engine.scheduler.waiting.first() is None


# --------------------------------------------------------------------------- one request's share
def _group_run(llm, arrive_at: int, prompts: dict[str, list[int]], groups: dict[str, str],
               late: set[str], max_tokens: int = 20):
    """Submit the early requests (``groups`` names each one's client request), step, and add
    the ``late`` ones before step ``arrive_at``; returns every request's tokens and the status
    of each request after each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def add(rid):
        llm.engine.add_request(llm.processor.process(
            rid, {"prompt_token_ids": prompts[rid]}, params, group_id=groups.get(rid))[1])

    for rid in prompts:
        if rid not in late:
            add(rid)
    steps, events, tokens = 0, [], {rid: [] for rid in prompts}
    while llm.engine.has_unfinished_requests() or steps <= arrive_at:
        if steps == arrive_at:
            for rid in late:
                add(rid)
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        sched = llm.engine.scheduler
        events.append({r.request_id: r.status for r in sched.requests.values()})
    return tokens, events


def _reference(llama_path, prompts, max_tokens=20):
    llm = LLM(engine_config(llama_path, scheduler={"max_num_seqs": 16}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return {rid: o.outputs[0].token_ids for rid, o in zip(prompts, outs)}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("pressure", ["seats", "kv_blocks"])
def test_one_request_cannot_keep_every_seat_from_a_later_one(llama_path, policy, pressure):
    """Six samples of one client request ("big") run alone and take every seat (4 of 4; or, with
    8 KV blocks, every block); a one-sample request arriving after them is seated in the very
    next step, by preempting big's newest sample, because big holds more than its share (half
    the seats; 2 of the pool's 4 holders with kv_blocks). Every output equals an undisturbed
    run's, and nothing is left in the pool."""
    prompts = {f"big{i}": list(range(10 + 20 * i, 30 + 20 * i)) for i in range(6)}
    prompts["small"] = list(range(300, 320))
    groups = {rid: "big" for rid in prompts if rid.startswith("big")}
    if pressure == "seats":
        sched = {"name": policy, "max_num_seqs": 4}
        kv = {}
    else:        # 20 + 12 tokens, 2 blocks a request: the pool holds 4 requests, the batch 8
        sched = {"name": policy, "max_num_seqs": 8, "max_num_seqs_per_request": 2}
        kv = {"num_blocks": 8}
    max_tokens = 20 if pressure == "seats" else 12
    cfg = engine_config(llama_path, scheduler=sched, kv_cache=kv, model={"max_model_len": 48})
    llm = LLM(cfg)
    tokens, events = _group_run(llm, 3, prompts, groups, late={"small"}, max_tokens=max_tokens)
    running = [rid for rid, s in events[2].items() if s == RequestStatus.RUNNING]
    assert len(running) == 4 and all(rid.startswith("big") for rid in running)  # alone: all
    assert events[3]["small"] == RequestStatus.RUNNING
    assert events[3]["big3"] == RequestStatus.PREEMPTED          # the newest admitted
    assert llm.get_stats().num_preemptions == 1
    assert tokens == _reference(llama_path, prompts, max_tokens)
    assert_pool_whole(llm)
    llm.engine.scheduler.check_invariants()


def test_a_request_at_its_share_lets_a_later_one_take_a_free_seat(llama_path):
    """Big holds 3 of 4 seats (over its share of 2) and has a fourth sample waiting when a small
    request arrives: the free seat goes to the small request, though FCFS would give it to
    big's earlier sample; nothing is preempted for it."""
    prompts = {f"big{i}": list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)}
    prompts |= {"big3": list(range(100, 120)), "small": list(range(300, 320))}
    groups = {rid: "big" for rid in prompts if rid.startswith("big")}
    llm = LLM(engine_config(llama_path, scheduler={"max_num_seqs": 4}))
    tokens, events = _group_run(llm, 2, prompts, groups, late={"big3", "small"})
    assert events[2]["small"] == RequestStatus.RUNNING
    assert events[2]["big3"] == RequestStatus.WAITING
    assert llm.get_stats().num_preemptions == 0
    assert tokens == _reference(llama_path, prompts)
    assert_pool_whole(llm)


def test_the_share_can_be_turned_off(llama_path):
    """max_num_seqs_per_request = max_num_seqs: a request may keep every seat (the small
    request waits for big's samples to finish)."""
    prompts = {f"big{i}": list(range(10 + 20 * i, 30 + 20 * i)) for i in range(6)}
    prompts["small"] = list(range(300, 320))
    groups = {rid: "big" for rid in prompts if rid.startswith("big")}
    llm = LLM(engine_config(llama_path, scheduler={"max_num_seqs": 4,
                                                   "max_num_seqs_per_request": 4}))
    tokens, events = _group_run(llm, 3, prompts, groups, late={"small"})
    assert events[3]["small"] == RequestStatus.WAITING
    assert llm.get_stats().num_preemptions == 0
    assert_pool_whole(llm)


def test_the_samples_of_one_request_share_a_group(llama_path):
    """n samples fan out into engine requests of one group (the request's id), so a request
    with n > max_num_seqs is one client request to the share, not n; a caller's group_id (the
    prompts of one API call) is kept."""
    from corellm.engine.output_processor import OutputProcessor, RequestOutputKind
    llm = LLM(engine_config(llama_path))
    proc = OutputProcessor(llm.tokenizer)
    for group, expected in ((None, "r"), ("call-7", "call-7")):
        _, core = llm.processor.process("r", "hello", SamplingParams(n=3, max_tokens=2),
                                        group_id=group)
        made = proc.add_request("r", "hello", core, RequestOutputKind.FINAL_ONLY)
        assert [c.group_id for c in made.core_requests] == [expected] * 3
        assert Request(made.core_requests[1], 64).group_id == expected
        proc.abort_requests(["r"])
    _, alone = llm.processor.process("q", "hello", SamplingParams(max_tokens=2))
    assert Request(alone, 64).group_id == "q"            # a group of its own
    with pytest.raises(InvalidRequestError, match="group_id"):
        llm.processor.process("q", "hello", SamplingParams(max_tokens=2), group_id="")


@pytest.mark.parametrize("share", [2, 8])
def test_memory_pressure_takes_from_the_request_over_its_share(llama_path, share):
    """Three samples of "big" (over a share of 2) and a later small request fill the 8-block
    pool; each then needs a third block. FCFS preempts the newest running request, the small
    one, unless a request is over its share: then only its requests are offered as victims,
    and big's newest goes first. With the share off (8 = max_num_seqs) the small request is the
    first preempted."""
    prompts = {f"big{i}": list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)}
    prompts["small"] = list(range(300, 320))
    groups = {rid: "big" for rid in prompts if rid.startswith("big")}
    cfg = engine_config(llama_path, scheduler={"max_num_seqs": 8,
                                               "max_num_seqs_per_request": share},
                        kv_cache={"num_blocks": 8}, model={"max_model_len": 48})
    llm = LLM(cfg)
    tokens, events = _group_run(llm, 1, prompts, groups, late={"small"})
    assert events[1]["small"] == RequestStatus.RUNNING
    first = next({rid for rid, st in e.items() if st == RequestStatus.PREEMPTED}
                 for e in events if RequestStatus.PREEMPTED in e.values())
    assert ("small" in first) if share == 8 else first == {"big2"}
    assert llm.get_stats().num_preemptions >= 1
    assert tokens == _reference(llama_path, prompts)
    assert_pool_whole(llm)
