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
from corellm.outputs import INVALID_REQUEST, SERVER_BUSY
from corellm.plugins.registry import RegisteredComponent, call_factory
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
        self.num_constrained = 0        # live requests with a state, or a failure to report
        self._failures: dict[str, str] = {}     # request -> why, reported at its next sample

    def _fail(self, k: int, req_id: str, exc: BaseException, method: str) -> None:
        logger.error("%s: %s() raised for request %r", self.entries[k].describe(), method,
                     req_id, exc_info=exc)
        self._failures.setdefault(req_id, f"{self.entries[k].describe()}: {method}() raised "
                                          f"{exc!r}")

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
            except Exception as exc:            # that request fails, at its first sample
                self._fail(k, state.req_id, exc, "new_request")
                continue
            if lp_state is not None:
                state.processors.append((k, lp_state))
        if state.processors or state.req_id in self._failures:
            self.num_constrained += 1

    def remove(self, state: CachedRequestState) -> None:
        if not state.processors and state.req_id not in self._failures:
            return
        self.num_constrained -= 1
        self._failures.pop(state.req_id, None)
        self._free(state, state.processors)
        state.processors = []

    def _free(self, state: CachedRequestState, held: list[tuple[int, Any]]) -> None:
        for k, lp_state in held:
            try:
                self.processors[k].free(lp_state)
            except Exception:        # a leak at worst: the request is gone either way
                logger.exception("%s: free() failed", self.entries[k].describe())

    def deferred(self, states: Sequence[CachedRequestState]) -> list[int]:
        """Rows whose request a processor is not ready for (its grammar still compiling):
        left unsampled this step."""
        if not self.num_constrained:
            return []
        out = []
        for row, state in enumerate(states):
            for k, lp_state in state.processors:
                try:
                    ready = self.processors[k].ready(lp_state)
                except Exception as exc:
                    self._fail(k, state.req_id, exc, "ready")
                    ready = True            # it fails at apply, with the reason
                if not ready:
                    out.append(row)
                    break
        return out

    def apply(self, logits: torch.Tensor, states: Sequence[CachedRequestState],
              ) -> dict[str, str]:
        """Constrain the rows of ``logits`` (one per state, in order) in place, one call per
        processor for all its rows. Returns the requests that cannot be served, with why."""
        if not self.num_constrained:
            return {}
        failed: dict[str, str] = {}
        groups: dict[int, tuple[list[int], list[Any], list[str]]] = {}
        for row, state in enumerate(states):
            why = self._failures.get(state.req_id)
            if why is not None:
                failed[state.req_id] = why
                continue
            for k, lp_state in state.processors:
                rows, lp_states, rids = groups.setdefault(k, ([], [], []))
                rows.append(row)
                lp_states.append(lp_state)
                rids.append(state.req_id)
        for k, (rows, lp_states, rids) in groups.items():
            try:
                self.processors[k].apply(logits, rows, lp_states)
            except RequestsFailed as exc:
                for rid, why in exc.failed.items():
                    failed[rid] = f"{self.entries[k].describe()}: {why}"
                for rid, why in exc.invalid.items():
                    failed[rid] = INVALID_REQUEST + why
                for rid, why in exc.busy.items():
                    failed[rid] = SERVER_BUSY + why
            except Exception as exc:            # its requests fail; the batch samples on
                logger.error("%s: apply() raised", self.entries[k].describe(), exc_info=exc)
                for rid in rids:
                    failed[rid] = f"{self.entries[k].describe()}: apply() raised {exc!r}"
        return failed

    def accept(self, states: Sequence[CachedRequestState], tokens: Sequence[int]) -> None:
        """Advance each constrained request's states by the token its row sampled."""
        if not self.num_constrained:
            return
        for state, token in zip(states, tokens):
            if not state.processors:
                continue
            kept, dropped = [], []
            for k, lp_state in state.processors:
                try:
                    ok = self.processors[k].accept(lp_state, token)
                except Exception:
                    logger.exception("%s: accept() raised", self.entries[k].describe())
                    ok = False
                if ok:
                    kept.append((k, lp_state))
                else:
                    logger.warning("%s rejected token %d of request %r; the request goes on "
                                   "without it", self.entries[k].describe(), token, state.req_id)
                    dropped.append((k, lp_state))
            if dropped:
                self._free(state, dropped)
                state.processors = kept
                if not kept and state.req_id not in self._failures:
                    self.num_constrained -= 1
