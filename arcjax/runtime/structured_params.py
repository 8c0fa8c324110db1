"""`StructuredOutputsParams`: what a request's output must match (vLLM's names and meanings).

Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `regex`,
`choice` (a list of strings: the output is one of them), `grammar` (a Lark grammar, or a
GBNF one as llama.cpp writes it) or `json_object=True` (any JSON object). Options:
`disable_any_whitespace` (JSON: no whitespace between tokens), `whitespace_pattern` (JSON:
the regex of the whitespace allowed between two tokens; default: at most one space or
newline, bounded unlike vLLM's, so that a schema with bounded values and
`"additionalProperties": false` bounds the output; vLLM's is `r"[ \t\n\r]*"`) and
`disable_additional_properties` (JSON: every object schema that does not say otherwise
gets `"additionalProperties": false`).

Checked when built (types, one constraint, a schema that parses as JSON): a bad value
raises `StructuredOutputsError` whose `.field` is "structured_outputs.<name>". Whether the
constraint compiles into a grammar is checked when the request is submitted (it needs the
model's tokenizer): the engine raises the same error, naming the constraint's field.
"""

from __future__ import annotations

import dataclasses
import json as json_lib
from collections.abc import Mapping, Sequence

from arcjax.errors import StructuredOutputsError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_PREFIX = "structured_outputs"


def _error(name: str, message: str) -> StructuredOutputsError:
    return StructuredOutputsError(f"{_PREFIX}.{name}", message)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")  # keyword -> {name: subschema}
_SCHEMA_ITEMS = ("items", "prefixItems", "additionalItems", "anyOf", "oneOf", "allOf", "not",
                 "if", "then", "else", "contains", "additionalProperties",
                 "unevaluatedProperties", "propertyNames")  # a subschema or a list of them


def _closed_objects(schema):
    """`schema` with `"additionalProperties": false` on every object schema that has
    properties and does not set it (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed_objects(s) for name, s in schema[key].items()}
    for key in _SCHEMA_ITEMS:
        if key in schema:
            out[key] = _closed_objects(schema[key])
    if (schema.get("type") == "object" or "properties" in schema) and (
            "additionalProperties" not in schema):
        out["additionalProperties"] = False
    return out


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on one request's output (see the module docstring).

    Attributes:
      json: a JSON schema: a dict, or a string holding one.
      regex: a regular expression (Rust `regex` syntax) the whole output matches.
      choice: the output is exactly one of these strings.
      grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar.
      json_object: True: the output is a JSON object.
      disable_any_whitespace, disable_additional_properties, whitespace_pattern: JSON
        options (above).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    _schema: object = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise StructuredOutputsError(
                _PREFIX, f"give exactly one of {', '.join(KINDS)}; got "
                         f"{', '.join(given) if given else 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _error(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _error("whitespace_pattern", f"must be a string, got "
                                               f"{self.whitespace_pattern!r}")
        if self.kind not in ("json", "json_object") and (
                self.whitespace_pattern is not None or self.disable_any_whitespace
                or self.disable_additional_properties):
            raise _error(self.kind, "whitespace and additional-property options apply to "
                                    "json and json_object only")
        getattr(self, f"_check_{self.kind}")()

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json_lib.loads(schema)
            except json_lib.JSONDecodeError as e:
                raise _error("json", f"is not valid JSON ({e})") from None
        if isinstance(schema, bool):  # JSON Schema's true / false
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise _error("json", f"must be a JSON schema object (a dict or its JSON text), "
                                 f"got {type(schema).__name__}")
        try:  # a private copy: later changes to the caller's dict change nothing
            schema = json_lib.loads(json_lib.dumps(schema))
        except (TypeError, ValueError) as e:
            raise _error("json", f"is not JSON-serializable ({e})") from None
        if self.disable_additional_properties:
            schema = _closed_objects(schema)
        object.__setattr__(self, "_schema", schema)

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise _error("regex", f"must be a non-empty string, got {self.regex!r}")

    def _check_choice(self) -> None:
        choice = self.choice
        if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
            raise _error("choice", f"must be a non-empty list of strings, got {choice!r}")
        if not all(isinstance(c, str) for c in choice):
            raise _error("choice", f"every choice must be a string, got {list(choice)!r}")
        object.__setattr__(self, "choice", tuple(choice))

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise _error("grammar", f"must be a non-empty grammar text, got {self.grammar!r}")

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise _error("json_object", f"must be True when given, got {self.json_object!r}")
        object.__setattr__(self, "_schema", {"type": "object"})

    @property
    def kind(self) -> str:
        """Which constraint: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def field(self) -> str:
        """The constraint's field name, for errors: "structured_outputs.<kind>"."""
        return f"{_PREFIX}.{self.kind}"

    @property
    def schema(self) -> dict | None:
        """The JSON schema a json / json_object constraint compiles (options applied)."""
        return self._schema

    def key(self) -> str:
        """The constraint as canonical text: equal constraints, equal keys (the compile
        cache's key)."""
        if self.kind in ("json", "json_object"):
            body = {"schema": self._schema, "flexible": not self.disable_any_whitespace,
                    "whitespace": self.whitespace_pattern}
        else:
            body = getattr(self, self.kind)
        return json_lib.dumps([self.kind, body], sort_keys=True, separators=(",", ":"))

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams | None":
        """`value` as params: None, an instance, or a mapping of its fields.

        Raises:
          StructuredOutputsError: an unknown field or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise StructuredOutputsError(_PREFIX, f"must be a StructuredOutputsParams or a "
                                                  f"mapping of its fields, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise _error(str(unknown[0]), f"unknown field; fields are {sorted(names)}")
        return cls(**value)
