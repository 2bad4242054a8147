"""The enabled logits processors of the worker that samples: each request's states, their place
between the forward and the sampler, and what a processor's failure ends (its requests, never
the batch)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from corellm.components import BuildContext
from corellm.errors import PluginError
from corellm.interfaces import LogitsProcessor, RequestsFailed
from corellm.registry import RegisteredComponent, call_factory
from corellm.worker.request_state import CachedRequestState

logger = logging.getLogger(__name__)


class LogitsProcessorSet:
    """Builds the enabled processors and keeps, per request, the states of those that
    constrain it. A batch none of whose requests is constrained costs one comparison."""

    def __init__(self, entries: Sequence[RegisteredComponent], ctx: BuildContext) -> None:
        self.entries = list(entries)
        self.processors: list[LogitsProcessor] = []
        for entry in self.entries:
            options = entry.spec.options(name=entry.spec.name)
            path = f"logits_processors.{entry.spec.name}"
            processor = call_factory(entry, path, options, ctx)
            if not isinstance(processor, LogitsProcessor):
                raise PluginError(f"{entry.describe()}: its factory returned "
                                  f"{type(processor).__name__}, not a LogitsProcessor")
            self.processors.append(processor)
        self.num_constrained = 0        # live requests with at least one state

    def add(self, state: CachedRequestState) -> None:
        """Ask each processor whether it constrains the request (a new one, or one recomputed
        after a preemption: its output tokens so far are replayed)."""
        if not self.processors:
            return
        prompt = state.token_ids[:state.num_prompt_tokens]
        output = state.token_ids[state.num_prompt_tokens:]
        for k, processor in enumerate(self.processors):
            try:
                lp_state = processor.new_request(state.req_id, state.params, prompt, output)
            except Exception as exc:
                raise PluginError(f"{self.entries[k].describe()}: new_request() for request "
                                  f"{state.req_id!r} raised {exc!r}") from exc
            if lp_state is not None:
                state.processors.append((k, lp_state))
        if state.processors:
            self.num_constrained += 1

    def remove(self, state: CachedRequestState) -> None:
        if not state.processors:
            return
        self.num_constrained -= 1
        for k, lp_state in state.processors:
            try:
                self.processors[k].free(lp_state)
            except Exception:        # a leak at worst: the request is gone either way
                logger.exception("%s: free() failed", self.entries[k].describe())
        state.processors = []

    def apply(self, logits: torch.Tensor, states: Sequence[CachedRequestState],
              ) -> dict[str, str]:
        """Constrain the rows of ``logits`` (one per state, in order) in place, one call per
        processor for all its rows. Returns the requests a processor could not serve, with why."""
        if not self.num_constrained:
            return {}
        groups: dict[int, tuple[list[int], list[Any]]] = {}
        for row, state in enumerate(states):
            for k, lp_state in state.processors:
                rows, lp_states = groups.setdefault(k, ([], []))
                rows.append(row)
                lp_states.append(lp_state)
        failed: dict[str, str] = {}
        for k, (rows, lp_states) in groups.items():
            try:
                self.processors[k].apply(logits, rows, lp_states)
            except RequestsFailed as exc:
                for rid, why in exc.failed.items():
                    failed[rid] = f"{self.entries[k].describe()}: {why}"
            except Exception as exc:
                raise PluginError(f"{self.entries[k].describe()}: apply() raised "
                                  f"{exc!r}") from exc
        return failed

    def accept(self, states: Sequence[CachedRequestState], tokens: Sequence[int]) -> None:
        """Advance each constrained request's states by the token its row sampled."""
        if not self.num_constrained:
            return
        for state, token in zip(states, tokens):
            if not state.processors:
                continue
            kept = []
            for k, lp_state in state.processors:
                if self.processors[k].accept(lp_state, token):
                    kept.append((k, lp_state))
                else:
                    logger.warning("%s rejected token %d of request %r; the request goes on "
                                   "without it", self.entries[k].describe(), token, state.req_id)
                    self.processors[k].free(lp_state)
            if len(kept) != len(state.processors):
                state.processors = kept
                if not kept:
                    self.num_constrained -= 1
