"""The example sampler wrapper, examples/corellm-banned-tokens.

The fast tests register its module in-process and check: with nothing banned its outputs are
the ``default`` sampler's, greedy and seeded; with tokens banned, none of them is sampled and the
greedy continuation is transformers' ``generate`` with the same tokens in ``bad_words_ids``
(its ``NoBadWordsLogitsProcessor``) on the same checkpoint, with the model's own logprobs; its
bans add to the ``min_tokens`` bans the engine makes; a delegate that ignores the bans is
named; a typo inside ``delegate`` and a token id outside the vocabulary are config errors at
their key paths; it imports only public names; and the "A sampler" guide quotes it verbatim.
tests/test_examples_installed.py pip-installs it into a fresh virtual environment and runs it
from the command line and from Python.
"""

from __future__ import annotations

import ast
import json
import tomllib
from pathlib import Path

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.components import SamplerSpec
from corellm.errors import ConfigError, PluginError
from corellm.interfaces import Sampler
from corellm.sampling import SamplerOutput, SamplingMetadata
from tests.conftest import assert_pool_whole, engine_config
from tests.plugin_fixtures import source_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-banned-tokens"
EXAMPLE_MODULE = "corellm_ban_tokens"
EXAMPLE_ENTRY_POINT = "sampler_ban"        # [project.entry-points.corellm] in its pyproject.toml
PROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
BAN = "ban_tokens"
# The corellm modules the example may import: public ones (docs/compatibility.md).
PUBLIC = {"corellm", "corellm.components", "corellm.errors", "corellm.sampling",
          "corellm.wrappers"}
PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 9, 14, 77], [42]]
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture
def ban_module(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    yield from source_module(monkeypatch, EXAMPLE, EXAMPLE_MODULE)


def _config(path, **sections) -> dict:
    # The entry point is disabled in case the example is also installed here: the module would
    # otherwise be registered twice.
    return engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]}, **sections)


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def default_greedy(llama_path) -> list[list[int]]:
    with LLM(engine_config(llama_path)) as llm:
        return [o.token_ids for o in generate(llm)]


def test_nothing_banned_is_the_default_sampler(ban_module, llama_path, default_greedy):
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=7,
                            ignore_eos=True)
    with LLM(engine_config(llama_path)) as llm:
        default_seeded = [o.token_ids for o in generate(llm, seeded)]
    cfg = _config(llama_path, sampler={"name": BAN, "delegate": {"name": "default"}})
    with LLM(cfg, plugins=[ban_module]) as llm:
        sampler = llm.engine.executor.worker.runner.sampler
        assert type(sampler) is ban_module.BanTokensSampler and sampler.token_ids == []
        assert llm.registry.get("sampler", BAN).plugin.name == EXAMPLE_MODULE
        assert [o.token_ids for o in generate(llm)] == default_greedy
        assert [o.token_ids for o in generate(llm, seeded)] == default_seeded
        assert_pool_whole(llm)


def test_banned_tokens_are_never_sampled_and_greedy_is_transformers(ban_module, llama_path,
                                                                    default_greedy):
    """The reference is transformers' greedy ``generate`` with ``bad_words_ids``, one
    single-token entry per banned id, on the same checkpoint; a mismatch is accepted only at a
    near tie (tests/test_hf_equivalence.py's rule)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tests.test_hf_equivalence import compare

    # What greedy picks first for each prompt, and one token from the middle of the first
    # output: every continuation changes at once.
    banned = sorted({out[0] for out in default_greedy} | {default_greedy[0][NEW_TOKENS // 2]})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    cfg = _config(llama_path, sampler={"name": BAN, "token_ids": banned})
    with LLM(cfg, plugins=[ban_module]) as llm:
        ours = generate(llm, params)
        assert_pool_whole(llm)
    for out, free in zip(ours, default_greedy):
        assert not set(out.token_ids) & set(banned), (out.token_ids, banned)
        assert out.token_ids[0] != free[0]

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0, bad_words_ids=[[t] for t in banned])
    notes = []
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, ours):
            ref = model.generate(torch.tensor([prompt]), generation_config=gen_cfg,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 return_dict_in_generate=True, output_logits=True)
            theirs = ref.sequences[0, len(prompt):].tolist()
            raw = [lg[0].float() for lg in ref.logits]        # before the logits processors
            note = compare(out.token_ids, theirs, raw)
            if note is not None:
                notes.append(note)
                continue
            # The logprobs reported are the model's own, bans not applied: the banned token
            # greedy wanted first is still the most likely one.
            for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
                want = torch.log_softmax(raw[i], -1)
                assert lp[token].logprob == pytest.approx(float(want[token]), abs=1e-4)
                assert lp[token].rank == int((want > want[token]).sum()) + 1
            assert out.logprobs[0][out.token_ids[0]].rank > 1
    assert len(notes) < len(PROMPTS), notes


def test_bans_add_to_the_engines_bans(ban_module):
    """Each row keeps the bans the engine made (min_tokens' stop tokens) and gets the
    configured ones; the metadata the engine passed is not changed."""
    from corellm_plugins.sampler_default.sampler import DefaultSampler

    logits = torch.zeros(3, 10)
    logits[:, 3], logits[:, 5], logits[:, 1] = 3.0, 2.0, 1.0       # preference: 3, 5, 1, ...
    md = SamplingMetadata(num_rows=3, all_greedy=True, all_random=False, temperature=None,
                          top_k=None, top_p=None, min_p=None, banned_token_ids={0: [5]})
    sampler = ban_module.BanTokensSampler(DefaultSampler(), [3], "the default sampler")
    assert sampler(logits, md).sampled_token_ids.tolist() == [1, 5, 5]
    assert md.banned_token_ids == {0: [5]}
    # Without the wrapper's bans, only the engine's hold.
    assert DefaultSampler()(logits, md).sampled_token_ids.tolist() == [3, 3, 3]


class IgnoresBans(Sampler):
    def __call__(self, logits, metadata):
        return SamplerOutput(logits.argmax(dim=-1))


class IgnoringPlugin:
    def corellm_samplers(self):
        yield SamplerSpec(name="ignores_bans", factory=lambda options, ctx: IgnoresBans())


def test_a_delegate_that_ignores_the_bans_is_named(ban_module, llama_path, default_greedy):
    plugin = IgnoringPlugin()
    cfg = _config(llama_path, sampler={"name": BAN, "token_ids": [default_greedy[0][0]],
                                       "delegate": {"name": "ignores_bans"}})
    with LLM(cfg, plugins=[ban_module, plugin]) as llm:
        with pytest.raises(PluginError) as info:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        msg = str(info.value)
        assert msg.startswith("sampler.delegate: sampler 'ignores_bans' of plugin"), msg
        assert "registered in-process" in msg and "banned_token_ids" in msg, msg
        assert f"sampled token {default_greedy[0][0]}" in msg, msg
        assert not llm.engine.has_unfinished_requests()
        assert_pool_whole(llm)


def test_config_errors_name_the_key_path(ban_module, llama_path):
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[ban_module])
    cfg = {"sampler": {"name": BAN, "token_ids": [5], "delegate": {"name": "default",
                                                                   "tmperature": 1.0}}}
    with pytest.raises(ConfigError) as info:
        load_config(cfg, registry=registry)
    assert "sampler.delegate.tmperature" in str(info.value), str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({"sampler": {"name": BAN, "token_ids": [-1]}}, registry=registry)
    assert "sampler.token_ids" in str(info.value), str(info.value)
    # Outside the vocabulary: known once the model is, when the factory runs in the worker.
    vocab = json.loads((Path(llama_path) / "config.json").read_text())["vocab_size"]
    with pytest.raises(ConfigError) as info:
        LLM(_config(llama_path, sampler={"name": BAN, "token_ids": [3, vocab]}),
            plugins=[ban_module])
    msg = str(info.value)
    assert "sampler.token_ids" in msg and f"{vocab} is not a token id" in msg, msg
    assert "'ban_tokens' of plugin 'corellm_ban_tokens'" in msg, msg


def test_example_config_validates(ban_module):
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[ban_module])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert config.sampler.name == BAN and config.sampler.token_ids == [5, 7]
    assert config.sampler.delegate.name == "default"


def test_example_imports_only_public_names():
    tree = ast.parse((EXAMPLE / EXAMPLE_MODULE / "__init__.py").read_text())
    used = {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0].startswith("corellm")}
    used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names if alias.name.startswith("corellm")}
    assert used and used <= PUBLIC, used - PUBLIC
