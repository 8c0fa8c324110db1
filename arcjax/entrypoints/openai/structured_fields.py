"""The OpenAI / vLLM request fields that constrain an output -> one `StructuredOutputsParams`.

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

from arcjax.errors import RequestError, StructuredOutputsError
from arcjax.sampling_params import KINDS, StructuredOutputsParams

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "guided_whitespace_pattern",
          "guided_decoding_backend")
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


def _response_format(value) -> dict | None:
    """{kind: value} from `response_format`, or None for text."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ResponseFormatError("response_format", f"must be an object with a type, got "
                                                     f"{value!r}")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise ResponseFormatError(f"response_format.{sorted(extra)[0]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ResponseFormatError("response_format.json_schema",
                                      "must be an object with name and schema")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ResponseFormatError(f"response_format.json_schema.{sorted(unknown)[0]}",
                                      "unknown field")
        if not isinstance(spec.get("name"), str):
            raise ResponseFormatError("response_format.json_schema.name", "is required (a "
                                                                          "string)")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: a missing schema = {}
        if not isinstance(schema, dict):
            raise ResponseFormatError("response_format.json_schema.schema",
                                      "must be a JSON schema object")
        return {"json": schema}
    raise ResponseFormatError("response_format.type", f"must be \"text\", \"json_object\" "
                                                      f"or \"json_schema\", got {kind!r}")


def constraint_from_body(body: dict, tool_constraint: StructuredOutputsParams | None = None
                         ) -> Constraint:
    """The one constraint a request body asks for (None when it asks for none).

    Args:
      body: the decoded request.
      tool_constraint: what `tools` + `tool_choice` require (`tool_calls.ToolPlan.constraint`).

    Raises:
      ResponseFormatError / StructuredOutputsError naming the request's field.
    """
    found: list[tuple[str, dict]] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    options = {}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ResponseFormatError("structured_outputs", f"must be an object, got {so!r}")
        unknown = sorted(set(so) - set(KINDS) - set(_OPTIONS))
        if unknown:
            raise ResponseFormatError(f"structured_outputs.{unknown[0]}", "unknown field")
        given = {k: v for k, v in so.items() if k in KINDS and v is not None}
        options = {k: v for k, v in so.items() if k in _OPTIONS}
        if given:
            found.append(("structured_outputs", given))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if body.get("guided_whitespace_pattern") is not None:
        options.setdefault("whitespace_pattern", body["guided_whitespace_pattern"])
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise ResponseFormatError("guided_decoding_backend", f"must be a string, got "
                                                             f"{backend!r}")
    if tool_constraint is not None:
        found.append(("tool_choice", {}))
    if len(found) > 1:
        raise ResponseFormatError(found[1][0], f"only one output constraint per request; "
                                               f"{found[0][0]} already gives one")
    if not found:
        bad = next((k for k, v in options.items() if v not in (None, False)), None)
        if bad is not None:
            field = (f"structured_outputs.{bad}" if bad in (so or {})
                     else "guided_whitespace_pattern")
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
