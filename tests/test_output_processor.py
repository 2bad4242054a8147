"""The engine client's output processing: incremental detokenization, stop strings, streaming
deltas and n>1 fan-out (``corellm.engine.output_processor``), then the offline ``LLM`` end to end.

The detokenizer is checked against ``tokenizer.decode(all ids)`` on random token streams for two
locally built tokenizers: the demo byte-level BPE one, and a SentencePiece/Llama-2-style one
(Metaspace, byte fallback, a decoder that strips the leading space of whatever it decodes).
"""

from __future__ import annotations

import functools
import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corellm import LLM
from corellm.engine.output_processor import (IncrementalDetokenizer, OutputProcessor,
                                             RequestOutputKind, RequestState)
from corellm.engine.stop_strings import StopStringMatcher, stop_string_matcher
from corellm.outputs import EngineCoreOutput
from corellm.request import EngineCoreRequest
from corellm.sampling_params import SamplingParams
from tests.conftest import engine_config

FFFD = "\ufffd"
PROPERTY = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def chunked(ids: list, sizes: list[int]) -> list[list]:
    """``ids`` cut into consecutive chunks of the given sizes, cycled."""
    chunks, pos = [], 0
    for size in itertools.cycle(sizes):
        if pos >= len(ids):
            break
        chunks.append(ids[pos:pos + size])
        pos += size
    return chunks


# =========================================================================== tokenizers
@functools.cache
def demo_tokenizer():
    """The same tokenizer as conftest's session fixture (built once here too, so hypothesis
    strategies can refer to it at collection time)."""
    from corellm.checkpoint.demo import train_tokenizer
    return train_tokenizer(vocab_size=1024)


SP_TEXT = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Grüße aus München! Über die Brücke gehen Bäume und Öl, façade, naïve, résumé.",
    "日本語のテキストです。東京は大きい都市です。",
    "Emoji: 😀 🎉 👍 — and a long dash; «quotes» too.",
    "  Double  spaces and\ttabs\nnewlines too.  ",
]


@functools.cache
def sp_tokenizer():
    """A Llama-2-style tokenizer: BPE over Metaspace pieces, the 256 ``<0xXX>`` byte-fallback
    tokens in the vocabulary (as Llama's are: ordinary tokens, not special ones), and Llama's
    decoder, whose ``Strip(" ", 1, 0)`` drops the leading space of every decoded string."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator(SP_TEXT * 5, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    assert not fast.clean_up_tokenization_spaces
    return fast


def sp_byte_id(b: int) -> int:
    return sp_tokenizer().convert_tokens_to_ids(f"<0x{b:02X}>")


@functools.cache
def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def demo_byte_id(b: int) -> int:
    return demo_tokenizer().convert_tokens_to_ids(_gpt2_byte_chars()[b])


# =========================================================================== detokenizer
# Text with plenty of multi-byte characters: ASCII, Latin-1, CJK, emoji, spaces at the edges.
WORDS = ["Hello", " world", ".", " ", "  ", "\n", "é", " über", "日本", "語", "😀", "🦀", " 🎉",
         "ß", "—", "naïve", "\ufffd", "a"]
texts = st.one_of(st.lists(st.sampled_from(WORDS), max_size=5).map("".join),
                  st.text(st.characters(codec="utf-8"), max_size=6))


def _flatten(pieces: list[list[int]]) -> list[int]:
    return [i for p in pieces for i in p]


@st.composite
def demo_streams(draw) -> list[int]:
    """Any ids at all: the byte-level decoder is lossy UTF-8 over the concatenated bytes, which
    is prefix-consistent, so every stream must detokenize exactly."""
    tok = demo_tokenizer()
    piece = st.one_of(
        st.integers(0, len(tok) - 1).map(lambda i: [i]),
        st.sampled_from([0, 1, 2]).map(lambda i: [i]),                       # special tokens
        texts.map(lambda s: tok.encode(s)),
        st.lists(st.integers(0x80, 0xFF).map(demo_byte_id), min_size=1, max_size=4),  # stray
    )
    ids = _flatten(draw(st.lists(piece, min_size=1, max_size=10)))
    if not ids:
        return [draw(st.integers(0, len(tok) - 1))]
    # Dropping ids splits characters and leaves partial byte sequences anywhere.
    drop = draw(st.sets(st.integers(0, len(ids) - 1), max_size=len(ids) // 4))
    return [t for j, t in enumerate(ids) if j not in drop]


@st.composite
def sp_streams(draw) -> list[int]:
    """Streams for the byte-fallback tokenizer. Its ByteFallback decoder turns a maximal run of
    ``<0xXX>`` tokens into text only if the whole run is valid UTF-8, else into one U+FFFD per
    byte, so a valid character followed in the same run by a stray byte is decoded as U+FFFDs
    (see test_byte_fallback_reference_is_not_prefix_consistent): the reference is not
    prefix-consistent there and no detokenizer that never takes text back can match it. The
    streams below hold every kind of id, but an invalid byte run always follows an ordinary
    token, so it never extends a run that began with a valid character."""
    tok = sp_tokenizer()
    specials = [0, 1, 2]
    byte_ids = {sp_byte_id(b) for b in range(256)}
    normal = [i for i in range(len(tok)) if i not in byte_ids and i not in specials]
    multibyte = [c.encode() for c in "éß日語😀🦀—€"]
    bad_first = list(range(0x80, 0xC2)) + list(range(0xF5, 0x100))    # never starts a character
    piece = st.one_of(
        st.sampled_from(normal).map(lambda i: [i]),
        st.sampled_from(specials).map(lambda i: [i]),
        texts.map(lambda s: tok.encode(s, add_special_tokens=False)),   # valid byte runs
        st.tuples(st.sampled_from(normal), st.sampled_from(bad_first),
                  st.lists(st.integers(0, 255), max_size=3)).map(
            lambda t: [t[0], sp_byte_id(t[1]), *map(sp_byte_id, t[2])]),
        st.tuples(st.sampled_from(normal), st.sampled_from(multibyte), st.integers(1, 3)).map(
            lambda t: [t[0], *(sp_byte_id(b) for b in t[1][:min(t[2], len(t[1]) - 1)])]),
    )
    return _flatten(draw(st.lists(piece, min_size=1, max_size=10))) or [normal[0]]


def run_detokenizer(tok, ids: list[int], sizes: list[int], skip: bool, empty_final: bool,
                    prefix_consistent: bool) -> list[str]:
    """Feed ``ids`` in chunks of ``sizes`` (cycled); check every step; return the deltas.

    ``prefix_consistent``: the tokenizer's decode of a prefix of the ids is itself a prefix of
    the decode of all ids, up to a trailing U+FFFD run (true of byte-level BPE; not of
    ByteFallback, which decodes "0" + half of "é" in one byte run as two U+FFFDs)."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    reference = tok.decode(ids, skip_special_tokens=skip)
    chunks = chunked(ids, sizes)
    if empty_final:
        chunks.append([])
    deltas, emitted = [], ""
    for k, chunk in enumerate(chunks):
        final = k == len(chunks) - 1
        delta = det.add_tokens(chunk, final=final)
        deltas.append(delta)
        emitted += delta
        if final:
            break
        seen = det.token_ids
        partial = tok.decode(seen, skip_special_tokens=skip)
        # A non-final delta never ends in U+FFFD: a split character (and a genuine U+FFFD from
        # invalid bytes alike) waits for the next token that completes a character.
        assert not delta.endswith(FFFD), (ids, chunks, k, deltas)
        # Never ahead of the reference, and never behind it except by a trailing U+FFFD run.
        assert reference.startswith(emitted), (ids, chunks, k, deltas, reference)
        if prefix_consistent:
            assert partial.startswith(emitted), (ids, chunks, k, deltas, partial)
        if not partial.endswith(FFFD):
            assert emitted == partial, (ids, chunks, k, deltas, partial)
    return deltas


chunkings = st.lists(st.integers(1, 4), min_size=1, max_size=6)


@PROPERTY
@given(ids=demo_streams(), sizes=chunkings, empty_final=st.booleans())
def test_detokenizer_matches_decode_byte_level(ids, sizes, empty_final):
    tok = demo_tokenizer()
    for skip in (True, False):
        deltas = run_detokenizer(tok, ids, sizes, skip, empty_final, prefix_consistent=True)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (ids, sizes, deltas)


@PROPERTY
@given(ids=sp_streams(), sizes=chunkings, empty_final=st.booleans())
def test_detokenizer_matches_decode_sentencepiece(ids, sizes, empty_final):
    tok = sp_tokenizer()
    for skip in (True, False):
        deltas = run_detokenizer(tok, ids, sizes, skip, empty_final, prefix_consistent=False)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (ids, sizes, deltas)


def test_detokenizer_takes_the_rust_decode_only_where_it_is_the_same(monkeypatch):
    """The property tests above run on the fast path (the Rust tokenizer's ``decode`` called
    directly); a tokenizer that cleans up spaces, or whose class or instance overrides
    ``decode``/``_decode``, decodes through transformers instead."""
    import copy

    from corellm.engine.output_processor import raw_decoder
    for tok in (demo_tokenizer(), sp_tokenizer()):
        assert raw_decoder(tok) is not None
        assert IncrementalDetokenizer(tok)._raw_decode is not None
        ids = list(range(3, 60))
        for skip in (True, False):
            assert raw_decoder(tok)(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    tok = copy.copy(demo_tokenizer())
    tok.clean_up_tokenization_spaces = True
    assert raw_decoder(tok) is None
    tok = copy.copy(demo_tokenizer())
    tok.decode = lambda ids, **kw: "p" * len(ids)
    assert raw_decoder(tok) is None
    assert IncrementalDetokenizer(tok).add_tokens([5, 6], final=True) == "pp"

    class Custom(type(demo_tokenizer())):
        def _decode(self, token_ids, **kwargs):
            return "c" * len(token_ids)
    tok = copy.copy(demo_tokenizer())
    tok.__class__ = Custom
    assert raw_decoder(tok) is None
    assert IncrementalDetokenizer(tok).add_tokens([5, 6, 7], final=True) == "ccc"


def test_the_generators_reach_the_interesting_cases():
    """Sanity check of the strategies: split characters, stray bytes and specials all occur."""
    from hypothesis import find
    demo = demo_tokenizer()
    sp = sp_tokenizer()
    find(demo_streams(), lambda ids: FFFD in demo.decode(ids)
         and any(0 <= i <= 2 for i in ids) and any(ord(c) > 0xFFFF for c in demo.decode(ids)))
    find(sp_streams(), lambda ids: FFFD in sp.decode(ids) and 1 in ids
         and any(ord(c) > 0xFFFF for c in sp.decode(ids)))


@pytest.mark.parametrize("which", ["sentencepiece", "byte_level"])
def test_emoji_is_emitted_only_when_complete(which):
    if which == "sentencepiece":
        tok, byte_id = sp_tokenizer(), sp_byte_id
        ids = tok.encode("Hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("▁")]
    else:
        tok, byte_id = demo_tokenizer(), demo_byte_id
        ids = tok.encode("Hi ")
    crab = [byte_id(b) for b in "🦀".encode()]                # F0 9F A6 80
    assert tok.convert_ids_to_tokens(crab)[0] in ("<0xF0>", _gpt2_byte_chars()[0xF0])
    ids += crab + [tok.convert_tokens_to_ids("!")]
    det = IncrementalDetokenizer(tok)
    deltas = [det.add_tokens([i], final=j == len(ids) - 1) for j, i in enumerate(ids)]
    first = len(ids) - len(crab) - 1
    assert "".join(deltas[:first]) == "Hi "
    assert deltas[first:] == ["", "", "", "🦀", "!"]
    assert "".join(deltas) == tok.decode(ids) == "Hi 🦀!"


def test_sentencepiece_leading_space_at_window_start():
    """The window the detokenizer decodes starts mid-text, where the decoder strips a space
    that the whole text keeps; the emitted text keeps it."""
    tok = sp_tokenizer()
    ids = tok.encode("Hello world über 日本", add_special_tokens=False)
    for skip in (True, False):
        for with_bos in (False, True):
            stream = [tok.bos_token_id] * with_bos + ids + [tok.eos_token_id]
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            text = "".join(det.add_tokens([i]) for i in stream) + det.add_tokens([], final=True)
            assert text == tok.decode(stream, skip_special_tokens=skip)
            assert "Hello world über 日本" in text
            assert text.startswith("<s>" if with_bos and not skip else "Hello")


def test_byte_fallback_reference_is_not_prefix_consistent():
    """Why sp_streams keeps invalid byte runs apart from valid ones: ByteFallback decodes "€"
    as "€" but "€" + a stray lead byte, in one run, as four U+FFFDs, so the reference takes back
    text it already produced. The detokenizer emits "€" as soon as it is complete (holding it back
    could delay text indefinitely) and cannot retract it."""
    tok = sp_tokenizer()
    euro = [sp_byte_id(b) for b in "€".encode()]
    assert tok.decode(euro) == "€"
    assert tok.decode(euro + [sp_byte_id(0xF0)]) == FFFD * 4
    det = IncrementalDetokenizer(tok)
    assert [det.add_tokens([i]) for i in euro] == ["", "", "€"]


# =========================================================================== stop strings
TEXT = "Hello world. The end. More text"


def core_request(rid: str = "r", **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 100)
    return EngineCoreRequest(rid, [5, 6, 7], SamplingParams(**params), eos_token_id=0,
                             arrival_time=time.time())


def text_ids() -> list[int]:
    ids = demo_tokenizer().encode(TEXT)
    assert demo_tokenizer().decode(ids) == TEXT
    return ids


def feed_one_by_one(proc: OutputProcessor, cid: str, ids: list[int],
                    finish_reason: str = "length"):
    """One token per step; returns the ProcessedOutputs of each step."""
    return [proc.process_outputs([EngineCoreOutput(
        cid, [t], finish_reason=finish_reason if j == len(ids) - 1 else None)])
        for j, t in enumerate(ids)]


def stopped_at(steps) -> int:
    hits = [j for j, s in enumerate(steps) if s.reqs_to_abort]
    assert len(hits) == 1, hits
    return hits[0]


def test_stop_string_across_token_boundary():
    tok = demo_tokenizer()
    ids = text_ids()
    stop = "ld. Th"
    assert not any(stop in tok.decode([i]) for i in ids)     # it spans several tokens
    proc = OutputProcessor(tok)
    proc.add_request("r", "prompt", core_request(stop=[stop]))
    steps = feed_one_by_one(proc, "r", ids)
    j = stopped_at(steps)
    assert steps[j].reqs_to_abort == ["r"]
    assert tok.decode(ids[:j + 1]).startswith("Hello world. The")
    assert not tok.decode(ids[:j]).endswith("The")           # found on the token completing it
    [out] = steps[j].request_outputs
    [c] = out.outputs
    assert out.finished and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == "Hello wor"
    assert c.token_ids == ids[:j + 1]
    assert [st_.request_id for st_ in steps[j].finished] == ["r"]
    # Later outputs for the stopped request (the core ran ahead, or echoes the abort): ignored.
    assert not proc.has_unfinished_requests()
    for later in steps[j + 1:]:
        assert later.request_outputs == [] and later.reqs_to_abort == [] and later.finished == []
    late = proc.process_outputs([EngineCoreOutput("r", [], finish_reason="abort")])
    assert late.request_outputs == [] and late.reqs_to_abort == []


def test_include_stop_str_in_output():
    proc = OutputProcessor(demo_tokenizer())
    proc.add_request("r", None, core_request(stop=["ld. Th"], include_stop_str_in_output=True))
    steps = feed_one_by_one(proc, "r", text_ids())
    [c] = steps[stopped_at(steps)].request_outputs[0].outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello world. Th", "stop", "ld. Th")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("one_step", [False, True])
def test_the_stop_tokens_text_is_left_out_unless_asked_for(include, one_step):
    """A request stopped by its EOS or a stop_token_ids entry keeps the token in token_ids but
    not its text (vLLM's rule), whatever skip_special_tokens says; include_stop_str_in_output
    keeps it."""
    tok = demo_tokenizer()
    ids = text_ids()
    stop_id = ids[-1]                             # an ordinary token, as a stop_token_ids entry
    for params in (dict(skip_special_tokens=False), dict(stop_token_ids=[stop_id])):
        proc = OutputProcessor(tok)
        proc.add_request("r", None, core_request(include_stop_str_in_output=include, **params))
        if one_step:
            out = proc.process_outputs([EngineCoreOutput("r", ids, finish_reason="stop")])
            [c] = out.request_outputs[0].outputs
        else:
            steps = feed_one_by_one(proc, "r", ids, finish_reason="stop")
            [c] = steps[-1].request_outputs[0].outputs
        assert c.token_ids == ids
        assert c.text == (tok.decode(ids) if include else tok.decode(ids[:-1])), params


@pytest.mark.parametrize("one_step", [False, True])
def test_earliest_stop_string_wins(one_step):
    """Several stop strings: the text is cut at the one that starts first, whatever their order
    in the list, also when all of them arrive in a single delta."""
    ids = text_ids()
    proc = OutputProcessor(demo_tokenizer())
    proc.add_request("r", None, core_request(stop=["More", "end", ". The", "zzz"]))
    if one_step:
        res = proc.process_outputs([EngineCoreOutput("r", ids)])
        assert res.reqs_to_abort == ["r"]
        [c] = res.request_outputs[0].outputs
    else:
        steps = feed_one_by_one(proc, "r", ids)
        [c] = steps[stopped_at(steps)].request_outputs[0].outputs
    assert (c.text, c.stop_reason, c.finish_reason) == ("Hello world", ". The", "stop")


def test_min_tokens_delays_stop_strings():
    tok = demo_tokenizer()
    ids = text_ids()
    first_dot = next(j for j, t in enumerate(ids) if tok.decode([t]) == ".") + 1  # tokens so far
    for min_tokens, expected in [(0, "Hello world"), (first_dot, "Hello world"),
                                 (first_dot + 1, "Hello world. The end"),
                                 (len(ids), None)]:
        proc = OutputProcessor(tok)
        proc.add_request("r", None, core_request(stop=["."], min_tokens=min_tokens))
        steps = feed_one_by_one(proc, "r", ids)
        [out] = steps[-1].request_outputs if expected is None else \
            steps[stopped_at(steps)].request_outputs
        [c] = out.outputs
        if expected is None:                     # both dots came before min_tokens
            assert (c.text, c.finish_reason, c.stop_reason) == (TEXT, "length", None)
        else:
            assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", ".")


def test_stop_before_min_tokens_stays_unmatched_whatever_the_other_stops():
    """A stop string wholly in the text produced before ``min_tokens`` is never matched, also when
    a longer stop string widens the window searched for new matches."""
    ids = text_ids()
    results = {}
    for stops in (["o"], ["o", "never seen here"]):
        for include in (False, True):
            for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
                proc = OutputProcessor(demo_tokenizer())
                proc.add_request("r", None, core_request(stop=stops, min_tokens=7,
                                                         include_stop_str_in_output=include),
                                 kind=kind)
                steps = feed_one_by_one(proc, "r", ids)
                texts_ = [c.text for s in steps for o in s.request_outputs for c in o.outputs]
                text = texts_[-1] if kind is RequestOutputKind.FINAL_ONLY else "".join(texts_)
                results[(tuple(stops), include, kind)] = text
    # 7 tokens: "Hello wor" (both "o"s before min_tokens); the next "o" is in " More".
    for (stops, include, kind), text in results.items():
        assert text == ("Hello world. The end. Mo" if include else "Hello world. The end. M"), \
            (stops, include, kind, text)
    # Before the fix, this case streamed "Hello world" and then finished on "Hell" + "o".
    for include in (False, True):
        check_delta_against_final(ids, [1], stop=["o", "never seen here"], min_tokens=7,
                                  include_stop_str_in_output=include)


def test_outputs_after_a_sample_stopped_are_ignored_n2_delta():
    """n=2, streaming: sample 0 stops on a string while sample 1 runs on; what the core still
    sends for sample 0 (it ran ahead before the abort arrived, then echoes the abort) produces no
    further chunk for it."""
    tok = demo_tokenizer()
    ids, other = text_ids(), tok.encode("abc def ghi jkl mno pqr stu vwx yz abc def ghi jkl")
    assert len(other) > len(ids)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, core_request(n=2, stop=[". The"]), kind=RequestOutputKind.DELTA)
    chunks: dict[int, list] = {0: [], 1: []}
    aborted = []
    for j, t in enumerate(other):
        last = j == len(other) - 1
        batch = [EngineCoreOutput("r#1", [t], finish_reason="length" if last else None)]
        if j < len(ids):
            batch.insert(0, EngineCoreOutput("r#0", [ids[j]]))
        elif j == len(ids):
            batch.insert(0, EngineCoreOutput("r#0", [], finish_reason="abort"))
        res = proc.process_outputs(batch)
        aborted += res.reqs_to_abort
        for o in res.request_outputs:
            assert o.finished == last
            for c in o.outputs:
                chunks[c.index].append(c)
    assert aborted == ["r#0"] and not proc.has_unfinished_requests()
    for i, want in [(0, ("Hello world", "stop", ". The")), (1, (tok.decode(other), "length", None))]:
        assert ["finished" for c in chunks[i] if c.finished] == ["finished"], chunks[i]
        assert chunks[i][-1].finished, chunks[i]
        assert ("".join(c.text for c in chunks[i]), chunks[i][-1].finish_reason,
                chunks[i][-1].stop_reason) == want


# =========================================================================== streaming (DELTA)
def run_kind(kind: RequestOutputKind, ids: list[int], sizes: list[int], n: int = 1, **params):
    """Feed every sample the same ids in chunks; returns the RequestOutputs produced."""
    proc = OutputProcessor(demo_tokenizer())
    state = proc.add_request("r", None, core_request(n=n, **params), kind=kind)
    outs = []
    chunks = chunked(ids, sizes)
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        res = proc.process_outputs([EngineCoreOutput(cid, chunk,
                                                     finish_reason="length" if last else None)
                                    for cid in state.child_ids])
        outs.extend(res.request_outputs)
        if last:
            assert not proc.has_unfinished_requests()
    return outs


def check_delta_against_final(ids, sizes, n=1, **params):
    final = run_kind(RequestOutputKind.FINAL_ONLY, ids, sizes, n=n, **params)
    assert len(final) == 1 and final[0].finished
    final_by_index = {c.index: c for c in final[0].outputs}
    assert sorted(final_by_index) == list(range(n))
    cumulative = run_kind(RequestOutputKind.CUMULATIVE, ids, sizes, n=n, **params)
    assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason)
            for c in cumulative[-1].outputs] == \
        [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in final[0].outputs]
    deltas = run_kind(RequestOutputKind.DELTA, ids, sizes, n=n, **params)
    assert deltas and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for i, want in final_by_index.items():
        text, token_ids, ends = "", [], 0
        for o in deltas:
            for c in o.outputs:
                if c.index != i:
                    continue
                assert ends == 0, "a chunk after the sample's final one"
                text += c.text
                token_ids += c.token_ids
                # Streamed text is never taken back: always a prefix of the final text.
                assert want.text.startswith(text), (text, want.text)
                if c.finished:
                    ends += 1
                    assert (c.finish_reason, c.stop_reason) == (want.finish_reason,
                                                                want.stop_reason)
        assert ends == 1
        assert text == want.text
        assert token_ids == want.token_ids
    return final[0]


@pytest.mark.parametrize("stop", [[], ["ld. Th"], [". The", "end", "e"], ["zzz", "t"]])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("sizes", [[1], [3], [2, 1, 4]])
def test_delta_stream_equals_final_text(stop, include, sizes):
    final = check_delta_against_final(text_ids(), sizes, n=2, seed=3, stop=stop,
                                      include_stop_str_in_output=include)
    if not stop:
        assert [c.text for c in final.outputs] == [TEXT, TEXT]


@settings(max_examples=150, deadline=None, database=None)
@given(data=st.data(), sizes=chunkings, include=st.booleans())
def test_delta_stream_property(data, sizes, include):
    tok = demo_tokenizer()
    ids = data.draw(demo_streams())
    full = tok.decode(ids, skip_special_tokens=True)
    substr = st.tuples(st.integers(0, max(0, len(full) - 1)), st.integers(1, 6)).map(
        lambda t: full[t[0]:t[0] + t[1]]).filter(bool)
    stop = data.draw(st.lists(st.one_of(substr, st.text(min_size=1, max_size=3)), max_size=3))
    min_tokens = data.draw(st.integers(0, len(ids)))
    final = check_delta_against_final(ids, sizes, stop=stop, min_tokens=min_tokens,
                                      include_stop_str_in_output=include)
    [c] = final.outputs
    if c.finish_reason == "length":
        assert c.text == full and c.token_ids == ids
    else:
        assert c.stop_reason in stop and full.startswith(c.text)
        assert c.text.endswith(c.stop_reason) if include else \
            full[len(c.text):].startswith(c.stop_reason)


# =========================================================================== n > 1
def test_fan_out_ids_and_seeds():
    req = core_request("rid", n=4, seed=7, temperature=1.0)
    state = RequestState("rid", None, req, demo_tokenizer(), RequestOutputKind.FINAL_ONLY)
    assert [r.request_id for r in state.core_requests] == ["rid#0", "rid#1", "rid#2", "rid#3"]
    assert all(r.sampling_params.n == 1 for r in state.core_requests)
    seeds = [r.sampling_params.seed for r in state.core_requests]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and all(isinstance(s, int) and s >= 0
                                                           for s in seeds)
    again = RequestState("rid", None, core_request("rid", n=4, seed=7), demo_tokenizer(),
                         RequestOutputKind.FINAL_ONLY)
    assert [r.sampling_params.seed for r in again.core_requests] == seeds      # deterministic
    unseeded = RequestState("x", None, core_request("x", n=3), demo_tokenizer(),
                            RequestOutputKind.FINAL_ONLY)
    assert [r.sampling_params.seed for r in unseeded.core_requests] == [None] * 3
    single = RequestState("s", None, core_request("s", seed=7), demo_tokenizer(),
                          RequestOutputKind.FINAL_ONLY)
    assert [r.request_id for r in single.core_requests] == ["s"]
    assert single.core_requests[0].sampling_params.seed == 7
    assert req.sampling_params.n == 4                 # the caller's request is left alone


def test_final_only_waits_for_every_sample_and_abort_returns_unfinished():
    tok = demo_tokenizer()
    ids = text_ids()
    proc = OutputProcessor(tok)
    proc.add_request("r", "p", core_request("r", n=3, stop=["end"]))
    assert proc.process_outputs([EngineCoreOutput("r#1", ids[:4], finish_reason="length")]) \
        .request_outputs == []
    res = proc.process_outputs([EngineCoreOutput("r#0", ids)])          # stops on "end"
    assert res.reqs_to_abort == ["r#0"] and res.request_outputs == []
    assert proc.abort_requests(["r"]) == ["r#2"]            # only the one still running
    assert proc.abort_requests(["r"]) == [] and not proc.has_unfinished_requests()
    # Outputs for an aborted request are dropped.
    assert proc.process_outputs([EngineCoreOutput("r#2", ids, finish_reason="length")]) \
        .request_outputs == []

    proc.add_request("q", "p", core_request("q", n=3, stop=["end"]))
    proc.process_outputs([EngineCoreOutput("q#1", ids[:4], finish_reason="length"),
                          EngineCoreOutput("q#0", ids)])
    res = proc.process_outputs([EngineCoreOutput("q#2", ids[:2], finish_reason="length")])
    [out] = res.request_outputs
    assert out.finished and out.request_id == "q" and out.prompt == "p"
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        (0, "Hello world. The ", "stop", "end"), (1, tok.decode(ids[:4]), "length", None),
        (2, tok.decode(ids[:2]), "length", None)]
    assert out.metrics.num_generation_tokens == 4 + len(ids) + 2
    assert proc.abort_requests(["q"]) == [] and not proc.has_unfinished_requests()


# =========================================================================== end to end
@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(engine_config(llama_path))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)


def test_llm_stop_string_end_to_end(llm):
    tok = llm.tokenizer
    prompt = "The quick brown fox"
    [full] = llm.generate(prompt, greedy(), use_tqdm=False)
    c = full.outputs[0]
    assert len(c.token_ids) == 40 and c.finish_reason == "length"
    full_text = c.text
    # A substring that starts after a few tokens and ends well before the last one, without
    # U+FFFD (random weights produce stray bytes).
    stop = None
    for j in range(4, 30):
        start, end = len(tok.decode(c.token_ids[:j])), len(tok.decode(c.token_ids[:30]))
        cand = full_text[start:start + 5]
        if len(cand) == 5 and start + 5 <= end and FFFD not in cand and cand.strip():
            stop = cand
            break
    assert stop is not None, full_text
    cut = full_text.index(stop)
    llm.reset_prefix_cache()
    [out] = llm.generate(prompt, greedy(stop=[stop]), use_tqdm=False)
    s = out.outputs[0]
    assert s.text == full_text[:cut]
    assert (s.finish_reason, s.stop_reason) == ("stop", stop)
    assert len(s.token_ids) < 40 and s.token_ids == c.token_ids[:len(s.token_ids)]
    assert stop in tok.decode(s.token_ids) and stop not in tok.decode(s.token_ids[:-1])
    llm.reset_prefix_cache()
    [inc] = llm.generate(prompt, greedy(stop=[stop], include_stop_str_in_output=True),
                         use_tqdm=False)
    i = inc.outputs[0]
    assert i.text == full_text[:cut + len(stop)]
    assert (i.finish_reason, i.stop_reason, i.token_ids) == ("stop", stop, s.token_ids)
    stats = llm.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running_reqs == 0


@pytest.mark.slow
def test_engine_process_matches_in_process(llama_path):
    prompts = ["Hello there", "The quick brown fox", {"prompt_token_ids": [5, 9, 13, 21]}]
    params = [SamplingParams(n=2, seed=11, temperature=0.8, max_tokens=24),
              SamplingParams(n=2, seed=12, temperature=1.0, max_tokens=20, stop=[" t", "e "]),
              SamplingParams(n=1, temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)]

    def summary(outs):
        return [(o.request_id, o.prompt_token_ids, o.finished,
                 [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                   None if c.logprobs is None else [sorted(d) for d in c.logprobs])
                  for c in o.outputs]) for o in outs]

    inproc = LLM(engine_config(llama_path))
    try:
        want = summary(inproc.generate(prompts, params, use_tqdm=False))
    finally:
        inproc.shutdown()
    mp = LLM(engine_config(llama_path), engine_process=True)
    try:
        assert mp.engine is None
        got = summary(mp.generate(prompts, params, use_tqdm=False))
        stats = mp.get_stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    finally:
        mp.shutdown()
    assert got == want
    assert any(c[3] == "stop" for o in want for c in o[3])   # the abort path ran


# =========================================================================== stop-string automaton


def reference_stop_match(text: str, start: int, stops: list[str]) -> tuple[int, int] | None:
    """Brute force: every occurrence of every stop string that ends in ``text[start:]``; the
    smallest start wins, then the smallest index in ``stops``. Returns (absolute start, index)."""
    best = None
    for k, stop in enumerate(stops):
        for i in range(max(0, start - len(stop) + 1), len(text) - len(stop) + 1):
            if text.startswith(stop, i) and (best is None or (i, k) < best):
                best = (i, k)
    return best


def run_matcher(stops: list[str], chunks: list[str], ignore_first: int = 0):
    """Feed ``chunks`` in order (the first ``ignore_first`` ones with ``advance``, like text before
    min_tokens); stop at the first reported match. Returns (chunk index, absolute start, index)
    or None, checked against the brute-force reference at every chunk."""
    m = StopStringMatcher(stops)
    state, text = m.INITIAL, ""
    for j, chunk in enumerate(chunks):
        start = len(text)
        text += chunk
        if j < ignore_first:
            state = m.advance(state, chunk)
            continue
        state, match = m.feed(state, chunk)
        want = reference_stop_match(text, start, stops)
        got = None if match is None else (start + match[0], match[1])
        assert got == want, (stops, chunks, ignore_first, j)
        if got is not None:
            assert text.startswith(stops[got[1]], got[0])
            return (j, *got)
    return None


@st.composite
def stop_cases(draw):
    alphabet = draw(st.sampled_from(["a", "ab", "abc", "aé😀"]))
    letters = st.text(st.sampled_from(alphabet), min_size=1, max_size=5)
    stops = draw(st.lists(letters, min_size=1, max_size=6))
    if draw(st.booleans()):                                # duplicates
        stops.append(draw(st.sampled_from(stops)))
    text = draw(st.text(st.sampled_from(alphabet), max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]  # empty ones too
    ignore_first = draw(st.integers(0, len(chunks)))
    return stops, chunks, ignore_first


@PROPERTY
@given(case=stop_cases())
def test_stop_matcher_matches_brute_force(case):
    stops, chunks, ignore_first = case
    run_matcher(stops, chunks, ignore_first)
    # The state depends on the text only, not on how it was split.
    m = StopStringMatcher(stops)
    state = m.INITIAL
    for chunk in chunks:
        state = m.feed(state, chunk)[0]
    assert state == m.advance(m.INITIAL, "".join(chunks))


@pytest.mark.parametrize("stops, chunks, ignore_first, want", [
    (["abc", "ab"], ["abc"], 0, (0, 0, 0)),               # equal starts: first listed wins
    (["ab", "abc"], ["abc"], 0, (0, 0, 0)),
    (["abc", "ab"], ["ab", "c"], 0, (0, 0, 1)),           # "ab" ends in the first delta already
    (["bcd", "abcde", "cd"], ["abcdef"], 0, (0, 0, 1)),   # overlapping: earliest start
    (["cd", "bcd"], ["abcd"], 0, (0, 1, 1)),              # one a suffix of the other
    (["b", "abc"], ["abc"], 0, (0, 0, 1)),                # a later-ending match starts first
    (["x", "x", "y"], ["ayx"], 0, (0, 1, 2)),             # duplicates
    (["x", "y", "x"], ["ax"], 0, (0, 1, 0)),
    (["hello world"], list("hello world"), 0, (10, 0, 0)),   # spans many deltas
    (["hello world"], ["hel", "", "lo", " ", "wor", "ld"], 0, (5, 0, 0)),
    (["a long stop string"], ["a long", " stop"], 0, None),  # longer than all text so far
    (["o"], ["hello", " wo", "rld"], 1, (1, 7, 0)),       # "o" before min_tokens ignored
    (["lo w"], ["hello", " wo", "rld"], 1, (1, 3, 0)),    # begins in ignored text: found
    (["hello"], ["hello", " wo"], 1, None),               # wholly in ignored text: never
    (["é😀", "😀"], ["aé", "😀b"], 0, (1, 1, 0)),            # unicode
    (["日本語"], ["今日", "本", "語"], 0, (2, 1, 0)),
])
def test_stop_matcher_cases(stops, chunks, ignore_first, want):
    assert run_matcher(stops, chunks, ignore_first) == want


def test_stop_matcher_cache_and_validation():
    stops = ["User:", "\n\n"]
    assert stop_string_matcher(stops) is stop_string_matcher(list(stops))  # built once
    assert stop_string_matcher(stops).stops == tuple(stops)
    big = [f"{i:08d}" for i in range(10_000)]            # over the cache's size limit
    assert stop_string_matcher(big) is not stop_string_matcher(big)
    m = stop_string_matcher(big)
    assert m.feed(m.INITIAL, "xx0000123400000099") == (m.advance(m.INITIAL, "xx0000123400000099"),
                                                       (2, 1234))
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


def old_append_text_reference(tok, chunks: list[list[int]], stop: list[str], min_tokens: int,
                              include: bool):
    """What ``RequestState`` did before the automaton: a ``str.find`` per stop string per delta.
    Returns (text, token_ids, finish_reason, stop_reason, index of the chunk that stopped)."""
    det = IncrementalDetokenizer(tok)
    text, ids = "", []
    for j, chunk in enumerate(chunks):
        ids += chunk
        delta = det.add_tokens(chunk, final=j == len(chunks) - 1)
        if not delta:
            continue
        start = len(text)
        text += delta
        if len(ids) < min_tokens:
            continue
        best = None
        for s in stop:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            return (text[:i + len(s)] if include else text[:i]), ids, "stop", s, j
    return text, ids, "length", None, None


@settings(max_examples=100, deadline=None, database=None)
@given(data=st.data(), include=st.booleans())
def test_request_state_stop_strings_match_old_behaviour(data, include):
    """Through ``OutputProcessor.process_outputs``, n=3 samples with their own token streams and
    chunkings: the same text, stop reason and stopping step as the per-stop ``find`` code."""
    tok = demo_tokenizer()
    words = st.lists(st.sampled_from(["ab", "ba", "a", "b", " ", "aab", "é", "😀"]), min_size=1,
                     max_size=12).map("".join)
    stop = data.draw(st.lists(st.text(st.sampled_from("ab é"), min_size=1, max_size=4),
                              min_size=1, max_size=5))
    min_tokens = data.draw(st.integers(0, 8))
    n = 3
    streams = []
    for _ in range(n):
        ids = tok.encode(data.draw(words))
        sizes = data.draw(chunkings)
        chunks = chunked(ids, sizes)
        streams.append(chunks)
    proc = OutputProcessor(tok)
    state = proc.add_request("r", None, core_request(n=n, stop=stop, min_tokens=min_tokens,
                                                     include_stop_str_in_output=include))
    aborted_at: dict[str, int] = {}
    outs = []
    for step in range(max(map(len, streams))):
        batch = [EngineCoreOutput(cid, chunks[step],
                                  finish_reason="length" if step == len(chunks) - 1 else None)
                 for cid, chunks in zip(state.child_ids, streams) if step < len(chunks)]
        res = proc.process_outputs(batch)
        for cid in res.reqs_to_abort:
            aborted_at[cid] = step
        outs += res.request_outputs
    assert not proc.has_unfinished_requests()
    [out] = outs
    for c, cid, chunks in zip(out.outputs, state.child_ids, streams):
        text, ids, reason, stop_reason, j = old_append_text_reference(tok, chunks, stop,
                                                                      min_tokens, include)
        assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == \
            (text, ids, reason, stop_reason)
        assert aborted_at.get(cid) == j


def test_logprobs_decode_each_token_once():
    """Decoded logprob tokens come from a cache shared by the processor's requests; the output is
    what ``tokenizer.decode([id])`` gives."""
    from corellm.outputs import LogprobsLists
    tok = demo_tokenizer()
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, **kw):
            if len(ids) == 1 and not kw:
                calls.append(ids[0])
            return tok.decode(ids, **kw)

    proc = OutputProcessor(Counting())
    rows = [[70, 71, 72], [71, 70, 300], [72, 72, 70]]         # the sampled one also in top-k
    results = []
    for rid in ("a", "b"):
        proc.add_request(rid, None, core_request(rid, logprobs=2))
        res = proc.process_outputs([EngineCoreOutput(
            rid, [r[0] for r in rows], finish_reason="length", new_logprobs=LogprobsLists(
                [list(r) for r in rows], [[-0.5, -1.0, -2.0]] * 3, [1, 2, 3]))])
        [c] = res.request_outputs[0].outputs
        results.append(c.logprobs)
    assert sorted(calls) == [70, 71, 72, 300]                 # once each, across requests
    want = [{70: (-0.5, 1, tok.decode([70])), 71: (-1.0, 1, tok.decode([71])),
             72: (-2.0, 2, tok.decode([72]))},
            {71: (-0.5, 2, tok.decode([71])), 70: (-1.0, 1, tok.decode([70])),
             300: (-2.0, 2, tok.decode([300]))},
            {72: (-0.5, 3, tok.decode([72])), 70: (-2.0, 2, tok.decode([70]))}]
    for lps in results:
        assert [{t: (v.logprob, v.rank, v.decoded_token) for t, v in e.items()} for e in lps] \
            == want
        assert [list(e) for e in lps] == [[70, 71, 72], [71, 70, 300], [72, 70]]
