"""Offline ``LLM.chat`` (vLLM's): conversations rendered with the model's chat template (the
tokenizer's own ``apply_chat_template`` is the reference), errors naming the message."""

from __future__ import annotations

import pytest

from corellm import LLM, SamplingParams
from corellm.errors import InvalidRequestError
from tests.conftest import engine_config

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_path):
    engine = LLM(engine_config(llama_path))
    yield engine
    engine.shutdown()


def test_chat_equals_generate_on_the_rendered_template(llm, tokenizer):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello there"}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    ids = tokenizer.encode(expected, add_special_tokens=False)
    [out] = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids
    [ref] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_batch_of_conversations_and_content_parts(llm, tokenizer):
    a = [{"role": "user", "content": "one"}]
    b = [{"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "text",
                                                                     "text": "wo"}]}]
    outs = llm.chat([a, b], GREEDY, use_tqdm=False)
    assert len(outs) == 2
    want_b = tokenizer.apply_chat_template([{"role": "user", "content": "two"}], tokenize=False,
                                           add_generation_prompt=True)
    assert outs[1].prompt_token_ids == tokenizer.encode(want_b, add_special_tokens=False)


def test_continue_final_message_and_own_template(llm, tokenizer):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    [out] = llm.chat(conversation, GREEDY, add_generation_prompt=False,
                     continue_final_message=True, use_tqdm=False)
    text = tokenizer.decode(out.prompt_token_ids)
    assert text.endswith("Well,")                      # the reply goes on from here
    [own] = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False,
                     chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert tokenizer.decode(own.prompt_token_ids) == "<Hi>"


@pytest.mark.parametrize("messages,kwargs,field,text", [
    ([], {}, "messages", "non-empty list"),
    ([{"content": "no role"}], {}, "messages[0]", "'role'"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages[0].content[0]",
     "only text parts"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs", "'tokenize'"),
    ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "messages",
     "cannot both be true"),
    ([[{"role": "user", "content": "x"}], [{"role": 3}]], {}, "messages[1][0]", "'role'"),
])
def test_bad_conversations_name_the_field(llm, messages, kwargs, field, text):
    with pytest.raises(InvalidRequestError) as err:
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert err.value.field == field and text in err.value.message


def test_a_model_without_a_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llm.chat([{"role": "user", "content": "x"}], GREEDY, use_tqdm=False)
