"""The OpenAI / vLLM request fields that constrain an output -> one `StructuredOutputsParams`
(their shapes are checked by the request's models, `protocol.py`).

Fields (both endpoints):
  response_format    {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
                     "json_schema": {"name", "schema", "strict", "description"}}
  structured_outputs vLLM's object: a constraint (json, regex, choice, grammar,
                     json_object) and/or options (disable_any_whitespace,
                     disable_additional_properties, whitespace_pattern); options alone
                     apply to the constraint another field gives.
  guided_json, guided_regex, guided_choice, guided_grammar, guided_whitespace_pattern:
                     vLLM's older names. guided_decoding_backend is accepted and ignored
                     (llguidance is the only backend).
A request gives at most one constraint (tools with tool_choice "required" or a named
function count as one): a second is refused naming its field. `source` remembers which
field the constraint came from, so an error found later (a schema that does not compile,
at submission) names the request's own field.
"""

from __future__ import annotations

import dataclasses

from arcjax.entrypoints.openai.protocol import ResponseFormat, SamplingFields
from arcjax.errors import RequestError, StructuredOutputsError
from arcjax.sampling_params import KINDS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class ResponseFormatError(RequestError):
    """A constraint field the server refuses (names the request's field)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """The request's constraint and the field it came from (for error messages)."""

    params: StructuredOutputsParams | None
    source: str | None


def _response_format(value: ResponseFormat | None) -> dict | None:
    """{kind: value} from `response_format` (checked by its model), or None for text."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return {"json_object": True}
    return {"json": value.json_schema.json_schema}


def constraint_from_request(req: SamplingFields,
                            tool_constraint: StructuredOutputsParams | None = None
                            ) -> Constraint:
    """The one constraint a request asks for (None when it asks for none).

    Args:
      req: the validated request (`protocol.SamplingFields`).
      tool_constraint: what `tools` + `tool_choice` require (`tool_calls.ToolPlan.constraint`).

    Raises:
      ResponseFormatError / StructuredOutputsError naming the request's field.
    """
    found: list[tuple[str, dict]] = []
    fmt = _response_format(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    options = {}
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k in KINDS if (v := getattr(so, "json_" if k == "json" else k))
                 is not None}
        options = {k: getattr(so, k) for k in _OPTIONS if k in so.model_fields_set}
        if given:
            found.append(("structured_outputs", given))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if req.guided_whitespace_pattern is not None:
        options.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    if tool_constraint is not None:
        found.append(("tool_choice", {}))
    if len(found) > 1:
        raise ResponseFormatError(found[1][0], f"only one output constraint per request; "
                                               f"{found[0][0]} already gives one")
    if not found:
        bad = next((k for k, v in options.items() if v not in (None, False)), None)
        if bad is not None:
            field = (f"structured_outputs.{bad}" if so is not None and bad in
                     so.model_fields_set else "guided_whitespace_pattern")
            raise ResponseFormatError(field, "needs a constraint (json, regex, choice, "
                                             "grammar, json_object) to apply to")
        return Constraint(None, None)
    source, kinds = found[0]
    try:
        if source == "tool_choice":
            params = dataclasses.replace(tool_constraint, **options)
        else:
            params = StructuredOutputsParams.coerce({**kinds, **options})
    except StructuredOutputsError as e:
        field = source if source != "structured_outputs" else e.field
        raise StructuredOutputsError(field, e.message, limit=e.limit) from None
    return Constraint(params, source)


def rename_field(error: StructuredOutputsError, constraint: Constraint) -> StructuredOutputsError:
    """An error the engine raised about "structured_outputs.<kind>", naming the request's
    own field instead (response_format, guided_json, tool_choice, ...)."""
    if constraint.source in (None, "structured_outputs"):
        return error
    return StructuredOutputsError(constraint.source, error.message, limit=error.limit)
