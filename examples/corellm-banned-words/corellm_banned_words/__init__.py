"""An example third-party logits processor: ``extra_args={"banned_words": [...]}`` keeps those
words out of a request's output, whatever tokens spell them.

Each word is tokenized as it would appear at the start of the text and after a space; a word
that is one token is masked at every step, a longer one at the step that would complete it
(its other tokens are allowed: they start other words too). Requests without the key are left
alone, and cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from corellm import hookimpl
from corellm.components import BuildContext, LogitsProcessorSpec, NoOptions
from corellm.interfaces import LogitsProcessor

CORELLM_PLUGIN_API = "1.7"
KEY = "banned_words"


def _words(params: Any) -> list[str] | None:
    words = (params.extra_args or {}).get(KEY)
    return None if words is None else list(words)


def validate(params: Any) -> None:
    words = (params.extra_args or {}).get(KEY)
    if words is None:
        return
    if not isinstance(words, list) or not words or not all(
            isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"{KEY}: expected a non-empty list of non-empty words, got {words!r}")


class BannedWords(LogitsProcessor):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def spellings(self, word: str) -> list[tuple[int, ...]]:
        """The token sequences that write ``word``: alone and after a space."""
        out = set()
        for text in (word, " " + word):
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if ids and all(i < self.vocab_size for i in ids):
                out.add(ids)
        return sorted(out)

    def new_request(self, req_id: str, params: Any, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> Any | None:
        words = _words(params)
        if not words:
            return None
        spellings = [s for w in words for s in self.spellings(w)]
        # The state: the spellings, and the request's output so far (replayed after a
        # preemption, then grown by accept).
        return {"spellings": spellings, "output": list(output_token_ids)}

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> None:
        for row, state in zip(rows, states):
            output = state["output"]
            banned = [seq[-1] for seq in state["spellings"]
                      if len(seq) == 1 or tuple(output[len(output) - len(seq) + 1:]) == seq[:-1]]
            if banned:
                logits[row, banned] = float("-inf")

    def accept(self, state: Any, token_id: int) -> bool:
        state["output"].append(token_id)
        return True


def constrains(params: Any) -> bool:
    """The requests that name banned words: the others keep overlapped steps."""
    return bool((params.extra_args or {}).get(KEY))


def make_banned_words(options: NoOptions, ctx: BuildContext) -> BannedWords:
    return BannedWords(ctx.tokenizer(), ctx.setup.arch.vocab_size)


@hookimpl
def corellm_logits_processors() -> Iterator[LogitsProcessorSpec]:
    yield LogitsProcessorSpec(name="banned_words", factory=make_banned_words,
                              validate=validate, constrains=constrains, extra_args=(KEY,),
                              summary="Keeps the words of extra_args['banned_words'] out of "
                                      "a request's output.")
