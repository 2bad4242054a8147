"""The outer shell most decoder-only language models share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from corellm.platforms.distributed import SINGLE, ParallelContext, kv_head_split
from corellm.interfaces import CausalLM
from corellm.layers.attention import bind_kv_caches
from corellm.layers.linear import ParallelLMHead
from corellm.arch import ModelArchConfig


class DecoderForCausalLM(nn.Module, CausalLM):
    """A decoder body and an LM head: ``forward`` runs ``self.model`` (input ids, positions,
    attention metadata -> hidden states), ``compute_logits`` applies ``self.lm_head`` and returns
    float32, ``bind_kv_caches`` hands every ``Attention`` module its cache. A subclass builds its
    body, passes it here, and implements ``load_weights``.

    The head is vocab-parallel (``corellm.layers.ParallelLMHead``): under tensor parallelism
    ``compute_logits`` returns the full logits on rank 0 and None on the other ranks, and
    ``num_kv_heads`` is this rank's share. With ``tie_word_embeddings`` the head's weight is the
    body's ``embed_tokens.weight`` (a ``VocabParallelEmbedding``, split the same way; build with
    ``corellm.layers.materialize`` to keep it tied).
    """

    def __init__(self, arch: ModelArchConfig, body: nn.Module, *, lm_head_bias: bool = False,
                 tie_word_embeddings: bool = False, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        self.model = body
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, bias=lm_head_bias,
                                      parallel=parallel)
        if tie_word_embeddings:
            self.lm_head.weight = body.embed_tokens.weight
        self.num_layers = arch.num_hidden_layers
        self.num_kv_heads = kv_head_split(arch.num_key_value_heads, parallel.tp_size)[0]
        self.head_size = arch.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)          # [T, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)                            # [N, vocab]
        return None if logits is None else logits.float()

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        bind_kv_caches(self, kv_caches)
