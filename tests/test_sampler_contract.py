"""The sampler contract as the engine enforces it (docs/plugins.md, "A sampler").

A sampler must apply ``SamplingMetadata.banned_token_ids``: it is how ``min_tokens`` holds the
stop tokens back. The model runner checks every sampler's output with
``corellm.sampling.find_banned``, so a sampler that ignores the bans fails the step with an
error naming it and its plugin, instead of stopping a request before ``min_tokens``. Also: the
``BuildContext`` a sampler's factory gets.
"""

from __future__ import annotations

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.components import SamplerSpec
from corellm.errors import PluginError
from corellm.interfaces import Sampler
from corellm.request import RequestStatus
from corellm.sampling import SamplerOutput
from tests.conftest import assert_pool_whole, engine_config

PROMPT = [5, 6, 7, 8]


class IgnoresBans(Sampler):
    """Greedy, the way a sampler written without the contract would be: no bans applied."""

    def __call__(self, logits, metadata):
        return SamplerOutput(logits.argmax(dim=-1))


class BadSamplerPlugin:
    """Registers ``ignores_bans`` and records, while its factory runs, what ``ctx`` holds."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def corellm_samplers(self):
        def make(options, ctx):
            self.seen.append(dict(vars(ctx)))
            return IgnoresBans()
        yield SamplerSpec(name="ignores_bans", factory=make)


def submit(llm: LLM, rid: str, params: SamplingParams):
    """Add one request to the engine directly; returns the scheduler's ``Request``."""
    _, request = llm.processor.process(rid, {"prompt_token_ids": PROMPT}, params)
    llm.engine.add_request(request)
    return llm.engine.scheduler.requests[rid]


def run(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_a_sampler_that_ignores_bans_fails_the_request_naming_it(llama_path):
    plugin = BadSamplerPlugin()
    llm = LLM(engine_config(llama_path, sampler={"name": "ignores_bans"}), plugins=[plugin])
    free = llm.generate({"prompt_token_ids": PROMPT},
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = free[0]            # greedy emits it first: a stop token that ends the request at once

    # Without min_tokens the stop token is allowed, and this sampler does stop there.
    early = submit(llm, "early", SamplingParams(max_tokens=6, temperature=0,
                                                stop_token_ids=[stop]))
    run(llm)
    assert early.output_token_ids == [stop] and early.status == RequestStatus.FINISHED_STOPPED

    # With min_tokens=4 the stop token is banned for the first 4 tokens; this sampler samples it
    # anyway, in its first step: the step fails and says who broke the contract.
    bad = submit(llm, "bad", SamplingParams(max_tokens=6, min_tokens=4, temperature=0,
                                            stop_token_ids=[stop]))
    with pytest.raises(PluginError) as info:
        run(llm)
    msg = str(info.value)
    entry = llm.registry.get("sampler", "ignores_bans")
    assert "'ignores_bans'" in msg and entry.plugin.describe() in msg, msg
    assert f"token {stop}" in msg and "'bad'" in msg and "banned" in msg, msg
    assert "min_tokens" in msg and "A sampler" in msg, msg
    assert bad.status == RequestStatus.FINISHED_ERROR and bad.status.finish_reason == "error"
    assert stop not in bad.output_token_ids              # the banned token never got out
    assert not llm.engine.has_unfinished_requests()
    assert_pool_whole(llm)

    # The engine goes on: the same greedy continuation as before the failure.
    again = llm.generate({"prompt_token_ids": PROMPT},
                         SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert again == free
    assert_pool_whole(llm)


def test_the_default_sampler_keeps_the_same_request_to_min_tokens(llama_path):
    """The same request under the built-in sampler: the ban holds and nothing fails, so the
    failure above is the bad sampler's."""
    llm = LLM(engine_config(llama_path))
    free = llm.generate({"prompt_token_ids": PROMPT},
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = free[0]
    req = submit(llm, "good", SamplingParams(max_tokens=6, min_tokens=4, temperature=0,
                                             stop_token_ids=[stop]))
    run(llm)
    assert req.status != RequestStatus.FINISHED_ERROR
    assert len(req.output_token_ids) >= 4 and stop not in req.output_token_ids[:4]
    assert_pool_whole(llm)


def test_what_a_sampler_factory_gets_in_ctx(llama_path):
    """The fields docs/plugins.md ("A sampler") lists as set when the factory runs."""
    plugin = BadSamplerPlugin()
    llm = LLM(engine_config(llama_path, sampler={"name": "ignores_bans"}), plugins=[plugin])
    assert len(plugin.seen) == 1                          # one worker: one sampler
    ctx = plugin.seen[0]
    runner = llm.engine.executor.worker.runner
    assert ctx["config"] == llm.engine.config
    assert ctx["config"].sampler.name == "ignores_bans"
    assert ctx["registry"] is llm.registry
    assert ctx["arch"].vocab_size == runner.model_info.vocab_size
    assert ctx["device"] == torch.device("cpu") and ctx["dtype"] == torch.float32
    assert ctx["platform"] is runner.platform and ctx["platform"].ops is not None
    assert ctx["max_model_len"] == runner.model_info.max_model_len
    assert ctx["parallel"].tp_rank == 0 and ctx["parallel"].tp_size == 1
    assert ctx["attention_backend"] is runner.attn_backend
    assert ctx["path"] == "sampler"
    assert ctx["kv_cache_manager"] is None and ctx["num_kv_blocks"] is None
