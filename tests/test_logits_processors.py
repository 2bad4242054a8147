"""The logits-processor component kind (plugin API 1.4), with processors registered in-process.

A processor that bans every token of the request's sequence gives, greedy, what transformers'
``generate(no_repeat_ngram_size=1)`` gives on the same checkpoint, while the requests beside it
in the batch sample exactly as without it; after a preemption the worker makes the state anew
from the tokens kept (checked by what ``new_request`` received, and by unchanged outputs); a
request a processor cannot serve ends with "error" alone; ``validate`` refuses bad parameters
naming the field; ``logits_processors.enable`` names processors, checked at its key path.
"""

from __future__ import annotations

import pytest
import torch

from corellm import LLM, SamplingParams, hookimpl
from corellm.components import LogitsProcessorSpec
from corellm.errors import ConfigError, InvalidRequestError
from corellm.interfaces import LogitsProcessor, RequestsFailed
from tests.conftest import assert_pool_whole, engine_config

PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 9, 14, 77], [42], [8, 9, 10, 11, 12]]
N = 12


class NoRepeat(LogitsProcessor):
    """``extra_args={"no_repeat": True}``: no token of the sequence (prompt and output) again.
    ``{"fail": True}``: the request cannot be served."""

    def __init__(self) -> None:
        self.made: list[tuple[str, list[int]]] = []     # (request, output it replayed)

    def new_request(self, req_id, params, prompt_token_ids, output_token_ids):
        args = params.extra_args or {}
        if args.get("fail"):
            return {"req_id": req_id, "fail": True}
        if not args.get("no_repeat"):
            return None
        self.made.append((req_id, list(output_token_ids)))
        return {"req_id": req_id, "seen": set(prompt_token_ids) | set(output_token_ids)}

    def apply(self, logits, rows, states):
        failed = {}
        for row, state in zip(rows, states):
            if state.get("fail"):
                failed[state["req_id"]] = "refused"
                continue
            logits[row, sorted(state["seen"])] = float("-inf")
        if failed:
            raise RequestsFailed(failed)

    def accept(self, state, token_id):
        state["seen"].add(token_id)
        return True


def _check(params) -> None:
    if (params.extra_args or {}).get("no_repeat") not in (None, True, False):
        raise ValueError("no_repeat: expected a boolean")


class Plugin:
    processor = None

    @staticmethod
    @hookimpl
    def corellm_logits_processors():
        def make(options, ctx):
            Plugin.processor = NoRepeat()
            return Plugin.processor
        yield LogitsProcessorSpec(name="no_repeat", factory=make, validate=_check,
                                  extra_args=("no_repeat",),
                                  summary="test: bans repeated tokens")


def _params(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0,
                          extra_args=extra or None)


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def plain(llama_path) -> list[list[int]]:
    with LLM(engine_config(llama_path)) as llm:
        return [o.token_ids for o in _generate(llm, _params())]


def _hf_no_repeat(path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                         no_repeat_ngram_size=1, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def test_constrained_rows_match_transformers_and_the_others_are_untouched(llama_path, plain):
    with LLM(engine_config(llama_path), plugins=[Plugin]) as llm:
        outs = _generate(llm, [_params(no_repeat=True), _params(), _params(no_repeat=True),
                               _params()])
        for i in (1, 3):
            assert outs[i].token_ids == plain[i]
        for i in (0, 2):
            ids = outs[i].token_ids
            assert not set(ids) & set(PROMPTS[i]) and len(set(ids)) == len(ids)
            assert ids == _hf_no_repeat(llama_path, PROMPTS[i])
        # Finished requests' states go at the next step (the worker hears of them then).
        llm.generate({"prompt_token_ids": [5]}, _params(), use_tqdm=False)
        assert not llm.engine.executor.worker.runner.logits_processors.num_constrained
        assert_pool_whole(llm)


def test_state_is_replayed_after_preemption(llama_path):
    params = [_params(no_repeat=True)] * len(PROMPTS)
    with LLM(engine_config(llama_path), plugins=[Plugin]) as llm:
        roomy = [o.token_ids for o in _generate(llm, params)]
    # 6 blocks of 4 tokens: the four requests (up to 18 tokens each) cannot all stay.
    with LLM(engine_config(llama_path, kv_cache={"num_blocks": 6, "block_size": 4},
                           model={"max_model_len": 24}), plugins=[Plugin]) as llm:
        outs = [o.token_ids for o in _generate(llm, params)]
        assert llm.engine.get_stats().num_preemptions > 0
        replays = [out for _, out in Plugin.processor.made if out]
        assert replays, "no preempted request was made anew with its kept tokens"
        assert outs == roomy
        assert_pool_whole(llm)


def test_a_request_a_processor_cannot_serve_ends_alone(llama_path, plain):
    with LLM(engine_config(llama_path), plugins=[Plugin]) as llm:
        outs = _generate(llm, [_params(), _params(fail=True), _params(), _params()])
        assert outs[1].finish_reason == "error" and outs[1].token_ids == []
        assert [outs[i].token_ids for i in (0, 2, 3)] == [plain[i] for i in (0, 2, 3)]
        assert_pool_whole(llm)


def test_validate_refuses_naming_the_field(llama_path):
    with LLM(engine_config(llama_path), plugins=[Plugin]) as llm:
        with pytest.raises(InvalidRequestError, match="no_repeat: expected a boolean") as info:
            llm.generate({"prompt_token_ids": [5]}, _params(no_repeat="yes"), use_tqdm=False)
        assert info.value.field == "sampling_params.extra_args"
        assert not llm.engine.has_unfinished_requests()


def test_enable_names_processors_at_its_key_path(llama_path, plain):
    with pytest.raises(ConfigError) as info:
        LLM(engine_config(llama_path, logits_processors={"enable": ["no_such"]}),
            plugins=[Plugin])
    assert "logits_processors.enable[0]" in str(info.value)
    assert "no_such" in str(info.value)
    # Enabled by name; and `enable: []` leaves it out even though it is installed.
    with LLM(engine_config(llama_path, logits_processors={"enable": ["no_repeat"]}),
             plugins=[Plugin]) as llm:
        assert [e.spec.name for e in llm.engine.executor.worker.runner.logits_processors.entries
                ] == ["no_repeat"]
    with LLM(engine_config(llama_path, logits_processors={"enable": []}),
             plugins=[Plugin]) as llm:
        assert not llm.engine.executor.worker.runner.logits_processors.entries
        # A key that only a processor left out reads is refused, not served unconstrained.
        with pytest.raises(InvalidRequestError) as refused:
            _generate(llm, _params(no_repeat=True))
        assert refused.value.field == "prompts[0].sampling_params.extra_args"
        assert "no_repeat: read by logits processor 'no_repeat'" in str(refused.value)
        assert "not enabled (logits_processors.enable)" in str(refused.value)
        # A key no installed processor declares is the caller's business.
        out = _generate(llm, [_params(other=True)] * len(PROMPTS))
        assert [o.token_ids for o in out] == plain


def test_the_banned_words_example(llama_path, monkeypatch):
    """examples/corellm-banned-words from its source tree: a word of the free greedy output is
    gone once banned, bad arguments name the field, and a request without the key is as free."""
    from tests.plugin_fixtures import source_module
    from tests.test_example_sampler import REPO

    module = next(source_module(monkeypatch, REPO / "examples" / "corellm-banned-words",
                                "corellm_banned_words"))
    cfg = engine_config(llama_path, plugins={"disable": ["banned_words"]})
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(cfg, plugins=[module]) as llm:
        free = llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0].text
        words = [w for w in free.split() if w.isalpha() and len(w) > 2]
        assert words, free
        banned = SamplingParams(max_tokens=24, temperature=0.0,
                                extra_args={"banned_words": words[:2]})
        text = llm.generate("Hello there", banned, use_tqdm=False)[0].outputs[0].text
        assert text != free and not set(text.split()) & set(words[:2]), (free, text)
        assert llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0].text == free
        with pytest.raises(InvalidRequestError) as info:
            llm.generate("Hello", SamplingParams(extra_args={"banned_words": "x"}),
                         use_tqdm=False)
        assert info.value.field == "sampling_params.extra_args"
        assert_pool_whole(llm)


def test_without_xgrammar_structured_outputs_are_refused_with_the_reason(llama_path,
                                                                         monkeypatch):
    """The built-in processor is listed as unavailable, with how to install it, and a request
    asking for structured outputs is refused naming that, instead of failing in the worker."""
    import importlib.util

    from corellm.plugins.discovery import load_registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    registry = load_registry()
    entry = registry.providers["logits_processors"]["xgrammar"][0]
    assert "corellm[structured]" in entry.spec.unavailable
    with LLM(engine_config(llama_path)) as llm:
        assert not llm.engine.executor.worker.runner.logits_processors.entries
        with pytest.raises(InvalidRequestError, match="corellm\\[structured\\]") as info:
            llm.generate({"prompt_token_ids": [5]},
                         SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
        assert info.value.field == "sampling_params.structured_outputs"


class Broken(LogitsProcessor):
    """Raises from new_request for ``{"boom": "new"}`` and from apply for ``{"boom": "apply"}``."""

    def new_request(self, req_id, params, prompt_token_ids, output_token_ids):
        boom = (params.extra_args or {}).get("boom")
        if boom == "new":
            raise ValueError("cannot prepare")
        return boom

    def apply(self, logits, rows, states):
        raise RuntimeError("cannot apply")


class BrokenPlugin:
    @staticmethod
    @hookimpl
    def corellm_logits_processors():
        yield LogitsProcessorSpec(name="broken", factory=lambda o, ctx: Broken())


def test_a_processor_that_raises_ends_only_its_requests(llama_path, plain):
    with LLM(engine_config(llama_path), plugins=[BrokenPlugin]) as llm:
        outs = _generate(llm, [_params(), _params(boom="new"), _params(boom="apply"),
                               _params()])
        assert [o.finish_reason for o in outs[1:3]] == ["error", "error"]
        assert [outs[i].token_ids for i in (0, 3)] == [plain[i] for i in (0, 3)]
        llm.generate({"prompt_token_ids": [5]}, _params(), use_tqdm=False)
        assert llm.engine.executor.worker.runner.logits_processors.num_constrained == 0
        assert_pool_whole(llm)


def test_the_server_refuses_an_extra_args_key_of_a_processor_left_out():
    """The server's constraint checks refuse such a key at once (a 400 naming vllm_xargs),
    before deciding whether any enabled processor has checks to run."""
    import asyncio
    import types

    from corellm.config.logits_processors import RequestChecker
    from corellm.plugins.discovery import load_registry
    from corellm_plugins.frontend_openai.constraints import ConstraintChecks
    from corellm_plugins.frontend_openai.errors import APIError

    entry = load_registry(plugins=[Plugin]).get("logits_processors", "no_repeat")
    checker = RequestChecker([], None, [entry])             # installed, not enabled
    engine = types.SimpleNamespace(processor=types.SimpleNamespace(checker=checker))
    checks = ConstraintChecks(engine, limits=None, off_loop=None)
    req = types.SimpleNamespace(structured_outputs=None, response_format=None)
    with pytest.raises(APIError) as refused:
        asyncio.run(checks.check(req, _params(no_repeat=True), cost=0))
    assert refused.value.status == 400 and refused.value.param == "vllm_xargs"
    assert refused.value.message.startswith("vllm_xargs: no_repeat: read by logits processor "
                                            "'no_repeat'")
    asyncio.run(checks.check(req, _params(other=True), cost=0))       # nothing to refuse
