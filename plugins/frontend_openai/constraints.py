"""A request's output constraints as ``StructuredOutputsParams``: OpenAI's ``response_format``
(chat) and vLLM's ``structured_outputs`` (both routes), with errors naming the field the client
sent."""

from __future__ import annotations

from typing import Any

from corellm.sampling_params import StructuredOutputsParams

from .errors import APIError


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
    if req.structured_outputs is None and fmt and fmt.get("type") in ("json_object",
                                                                       "json_schema"):
        fields.update({"structured_outputs.json": "response_format.json_schema.schema",
                       "structured_outputs.json_object": "response_format",
                       "structured_outputs": "response_format"})
    return fields
