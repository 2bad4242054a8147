"""A request's output constraints as ``StructuredOutputsParams``: OpenAI's ``response_format``
(chat) and vLLM's ``structured_outputs`` (both routes), with errors naming the field the client
sent; the bounds a constraint must keep before anything parses it
(``frontend.limits.constraints``); and the functions the check processes run."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from corellm.serving.constraint_shape import constraint_shape, digest, json_depth
from corellm.errors import InvalidRequestError
from corellm.serving.lru import ByteLRU
from corellm.sampling_params import SamplingParams, StructuredOutputsParams
from corellm.serving.sandbox import CallRejected, ChildDied, DeadlineExceeded, Sandbox, StartFailed

from .errors import APIError, _busy, _invalid
from .options import ConstraintLimits


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; a 400 for one that is malformed."""
    given = req.structured_outputs
    fmt = getattr(req, "response_format", None)
    kind = fmt.get("type", "text") if fmt else "text"
    if given is not None and kind != "text":
        raise APIError(400, "structured_outputs: give either structured_outputs or a "
                            "response_format of type json_object / json_schema, not both",
                       param="structured_outputs")
    if given is not None:
        fields = set(StructuredOutputsParams.KINDS)
        unknown = sorted(set(given) - fields)
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]}: unknown key (expected one of "
                                f"{', '.join(StructuredOutputsParams.KINDS)})",
                           param=f"structured_outputs.{unknown[0]}")
        return StructuredOutputsParams(**given)
    if kind == "text":
        unknown = sorted(set(fmt or {}) - {"type"})
        if unknown:
            raise APIError(400, f"response_format.{unknown[0]}: not allowed with type text",
                           param=f"response_format.{unknown[0]}")
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type: {kind!r} is not one of text, json_object, "
                            "json_schema", param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema: required with type json_schema (an "
                            "object with name and schema)", param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema: must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)


def constraint_fields(req: Any) -> dict[str, str]:
    """``InvalidRequestError`` fields of a constraint -> the request field they came from."""
    fmt = getattr(req, "response_format", None)
    fields = {"extra_args": "vllm_xargs"}
    choice = getattr(req, "tool_choice", None)
    if getattr(req, "tools", None) and (choice == "required" or isinstance(choice, dict)):
        # the constraint is the calls' schema, made of the tools
        return {**fields, "structured_outputs.json": "tools", "structured_outputs": "tools"}
    if req.structured_outputs is None and fmt and fmt.get("type") in ("json_object",
                                                                       "json_schema"):
        fields.update({"structured_outputs.json": "response_format.json_schema.schema",
                       "structured_outputs.json_object": "response_format",
                       "structured_outputs": "response_format"})
    return fields


# --------------------------------------------------------------------------- bounds
def check_constraint_bounds(so: StructuredOutputsParams, limits: ConstraintLimits) -> int:
    """Refuse a constraint over ``frontend.limits.constraints`` (an ``InvalidRequestError``
    naming its field, before anything parses or compiles it); else its cost, in
    ``FairExecutor``'s unit (about a microsecond), for the queue of the checks. Reading its
    shape is linear in its size (about 0.3 s for the worst 1 MiB): run it off the event loop."""
    field = f"structured_outputs.{so.kind}"
    shape = constraint_shape(so)
    key = "frontend.limits.constraints."
    if shape.size > limits.max_bytes:
        raise InvalidRequestError(field, f"{shape.size} bytes exceed the limit of "
                                         f"{limits.max_bytes} ({key}max_bytes)")
    if shape.depth > limits.max_depth:
        raise InvalidRequestError(field, f"nests {shape.depth} objects deep, over the limit of "
                                         f"{limits.max_depth} ({key}max_depth)")
    if shape.properties > limits.max_properties:
        raise InvalidRequestError(field, f"{shape.properties} object properties exceed the "
                                         f"limit of {limits.max_properties} "
                                         f"({key}max_properties)")
    if shape.repetition > limits.max_repetition:
        what = "its patterns' counted repetitions" if so.kind == "json" else \
            "its counted repetitions ({m,n})"
        raise InvalidRequestError(field, f"{what} unroll to {shape.repetition} atoms, over the "
                                         f"limit of {limits.max_repetition} "
                                         f"({key}max_repetition)")
    return shape.cost


# --------------------------------------------------------------------------- the check process
# The server's constraint checks run in child processes (corellm.serving.sandbox): each child
# builds the enabled logits processors' checker once, from the server's config.
_checker: Any = None


def init_checker(config: Any) -> None:
    """A check process's initializer: the checker the engine's ``Processor`` has, built again
    (plugins are imported per process)."""
    global _checker
    from corellm.config.logits_processors import RequestChecker
    from corellm.plugins import load_registry

    _checker = RequestChecker.for_config(config, load_registry(disable=config.plugins.disable))


def check_in_child(params: SamplingParams) -> None:
    """The enabled logits processors' checks of ``params``, in a check process."""
    _checker.check(params)


def checker_imports(entries: Any) -> list[str]:
    """What the check processes' fork server imports ahead: the checker's modules and the
    enabled processors' ``validate_imports`` (``entries``: their registry entries)."""
    mods = ["corellm.config.logits_processors", "corellm.plugins.discovery", __name__]
    for entry in entries:
        mods.extend(entry.spec.validate_imports)
    return list(dict.fromkeys(mods))


# --------------------------------------------------------------------------- the checks
# The digests of constraints that passed their check (or ran past its deadline) are kept up to
# this many bytes.
CHECKED_CACHE_BYTES = 4 << 20
# Constraints up to this many characters are held to their bounds on the event loop (under a
# millisecond); longer ones on the preprocessing pool.
INLINE_BOUNDS_CHARS = 4096
# A constraint whose check ran past the deadline (or ended its process) this many times within
# STRIKE_TTL_S is refused at once: twice, so that one slow check on a loaded machine does not
# refuse a constraint for good.
STRIKES = 2
STRIKE_TTL_S = 600.0


class ConstraintChecks:
    """A server's checks of output constraints: the bounds (``frontend.limits.constraints``),
    then the enabled logits processors' checks in two check processes (``corellm.serving.sandbox``),
    cheapest first, each killed at ``check_timeout_s``. ``off_loop(fn, *args, cost=...)`` runs
    work on the preprocessing pool."""

    def __init__(self, engine: Any, limits: ConstraintLimits,
                 off_loop: Callable[..., Awaitable[Any]]) -> None:
        self.engine, self.limits, self.off_loop = engine, limits, off_loop
        # Constraints that passed their check, and those that ran past its deadline, by digest
        # (16 bytes each, whatever their size).
        self._checked: ByteLRU[bytes, None] = ByteLRU(CHECKED_CACHE_BYTES)
        self._too_slow: ByteLRU[bytes, tuple[int, float]] = ByteLRU(CHECKED_CACHE_BYTES)

    async def bounds(self, req: Any) -> int:
        """The request's output constraint held to ``frontend.limits.constraints`` before any
        other work is spent on it; its cost in the check queue (0 without one). Reading its
        shape takes time linear in its size: a small one is read here, a large one on the
        preprocessing pool."""
        so = structured_outputs(req)
        if so is None:
            return 0
        value = getattr(so, so.kind)
        try:
            size = (len(json.dumps(value)) if isinstance(value, dict)
                    else sum(map(len, value)) if isinstance(value, list)
                    else len(value) if isinstance(value, str) else 0)
        except (ValueError, RecursionError):
            size = self.limits.max_bytes
        try:
            if size <= INLINE_BOUNDS_CHARS:
                return check_constraint_bounds(so, self.limits)
            return await self.off_loop(check_constraint_bounds, so, self.limits, cost=size)
        except InvalidRequestError as exc:
            raise _invalid(exc, constraint_fields(req)) from None

    async def check(self, req: Any, params: SamplingParams, cost: int) -> None:
        """A request's output constraint and processor arguments, checked by the enabled
        logits processors (parsing a JSON schema, a regex, a grammar) in a check process that
        is killed at ``check_timeout_s``, never on the threads that tokenize prompts: a 400
        naming the field when one refuses or takes too long. ``cost``: the constraint's, from
        ``bounds``, which it passed. A constraint that passed is remembered, and so is one that
        ran past the deadline or ended its process twice (a 400 at once when it comes back,
        for ``STRIKE_TTL_S``)."""
        so, xargs = params.structured_outputs, params.extra_args
        checker = self.engine.processor.checker
        fields = constraint_fields(req)
        try:
            checker.check_keys(params)          # a key of a processor left out: at once
        except InvalidRequestError as exc:
            raise _invalid(exc, fields) from None
        if (so is None and xargs is None) or (so is None and not checker.entries):
            return
        field = "vllm_xargs" if so is None else fields.get(
            f"structured_outputs.{so.kind}", f"structured_outputs.{so.kind}")
        limits = self.limits
        if xargs is not None and (depth := json_depth(xargs)) > limits.max_depth:
            raise APIError(400, f"vllm_xargs: nests {depth} deep, over the limit of "
                                f"{limits.max_depth} (frontend.limits.constraints.max_depth)",
                           param="vllm_xargs")
        key = digest(repr((so, xargs)))
        try:
            if so is not None and checker.backend is None:
                checker.check(params)               # refused at once: no backend serves it
            if key in self._checked:
                return
            if self._failures(key) >= STRIKES:
                raise DeadlineExceeded(limits.check_timeout_s)
            await self._checks.run_isolated(check_in_child, params,
                                            cost=cost + 1 + len(repr(xargs or "")))
        except InvalidRequestError as exc:
            raise _invalid(exc, fields) from None
        except DeadlineExceeded:
            self._strike(key)
            raise APIError(400, f"{field}: the structured-output backend did not finish "
                                f"checking it within {limits.check_timeout_s:g} s "
                                "(frontend.limits.constraints.check_timeout_s); simplify it",
                           param=field, code="constraint_too_complex") from None
        except (ChildDied, CallRejected) as exc:
            self._strike(key)
            why = ("ended the check process (out of memory, or a crash in the structured-output "
                   "backend)" if isinstance(exc, ChildDied) else "cannot be sent to a check "
                   "process")
            raise APIError(400, f"{field}: checking it {why}; simplify it", param=field,
                           code="constraint_too_complex") from None
        except StartFailed as exc:
            raise _busy(f"the server cannot check output constraints now: {exc}") from None
        self._checked.put(key, None, 0)

    def _failures(self, key: bytes) -> int:
        """How many times the constraint of ``key`` ran past the deadline (or ended its
        process) within the last ``STRIKE_TTL_S``."""
        entry = self._too_slow.get(key)
        if entry is None or time.monotonic() - entry[1] > STRIKE_TTL_S:
            return 0
        return entry[0]

    def _strike(self, key: bytes) -> None:
        self._too_slow.put(key, (self._failures(key) + 1, time.monotonic()), 0)

    @functools.cached_property
    def _checks(self) -> Sandbox:
        """The check processes, started at the first request that needs them."""
        entries = self.engine.processor.checker.entries
        return Sandbox("corellm-constraint-check", timeout_s=self.limits.check_timeout_s,
                       preload=checker_imports(entries), initializer=init_checker,
                       initargs=(self.engine.config,))

    def close(self) -> None:
        if "_checks" in self.__dict__:
            self._checks.shutdown()
