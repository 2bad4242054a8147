"""What a request costs before it reaches the engine: JSON bodies become token ids (chat
templates, tokenization) on worker threads shared by every client.

Two things keep one client's bodies from holding up everyone else's:

- **A bound on the text to tokenize** (``TextBound``): a text with more characters than
  ``max_model_len`` tokens can stand for is refused before it is tokenized. Tokenizing a long
  text is the costliest thing a request does here (figures: docs/server.md); refused by its
  length, it costs nothing.
- **A fair queue** (``corellm.serving.fair.FairExecutor``): the cheapest job first, with aging,
  and a worker kept for small jobs.
"""

from __future__ import annotations

import json
from typing import Any

# --------------------------------------------------------------------------- the text bound
# Pre-tokenizers that keep every character of their input (in some piece). Whitespace splitting
# (BERT's) drops the spaces: a text of a million spaces would be no tokens at all.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts",
                                     "Split", "Punctuation"})


def _keeps_every_character(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_every_character(p) for p in pre.get("pretokenizers", ()))
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of (normalized) text that one token of ``tokenizer`` stands for, or
    None where no such bound holds.

    It holds for a BPE tokenizer that turns every character into tokens: over bytes (GPT-2,
    Llama 3, Qwen, SmolLM), with byte fallback (Llama 2, Mistral, Gemma), or with one unknown
    token per unknown character; and whose pre-tokenizer and added tokens drop nothing (no
    whitespace splitting, no added token that strips the spaces around it). Then a token stands
    for at most as many characters as its string in the vocabulary has: a byte-level token's
    string has one character per byte and a character is at least one byte; a byte-fallback
    token (``<0xE2>``) stands for less than one character.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    model = backend.model
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else None
    over_bytes = '"ByteLevel"' in json.dumps(pre)
    if not (over_bytes or model.byte_fallback or (model.unk_token and not model.fuse_unk)):
        return None
    if not _keeps_every_character(pre):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    return max(map(len, tokenizer.get_vocab()), default=None)


class TextBound:
    """Whether a text can fit in ``max_tokens`` tokens, decided from its length: a text of more
    than ``max_chars_per_token x max_tokens`` characters (after the tokenizer's normalizer,
    which may compose or drop characters) cannot. Without a bound every text may fit."""

    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.per_token = max_chars_per_token(tokenizer)
        self.max_chars = None if self.per_token is None else self.per_token * max_tokens
        normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
        self._normalize = normalizer.normalize_str if normalizer is not None else None

    def excess(self, text: str) -> int:
        """0 when ``text`` may fit; else its length in characters, which cannot."""
        if self.max_chars is None or len(text) <= self.max_chars:
            return 0
        n = len(self._normalize(text)) if self._normalize is not None else len(text)
        return n if n > self.max_chars else 0
