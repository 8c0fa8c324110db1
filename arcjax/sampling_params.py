"""The request's sampling parameters (vLLM's path: `arcjax.sampling_params`).

`SamplingParams`: how one request samples, what it returns, when it stops (vLLM's names).
Validated once, on the host, when the object is built: every field is type-checked and a
bad value raises `SamplingParamsError` whose `.field` names it.

`StructuredOutputsParams`: what a request's output must match (vLLM's names and meanings).

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
import enum
import json as json_lib
import math
from collections.abc import Mapping, Sequence

import numpy as np

from arcjax.errors import SamplingParamsError, StructuredOutputsError

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


INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top-k log-probabilities per position: the device always computes 20


class RequestOutputKind(enum.IntEnum):
    """What each output of a request carries (vLLM's kinds).

    CUMULATIVE: everything generated so far (text, token ids, logprobs), in every output.
    DELTA: only what is new since the previous output of that request (the text, token ids
      and logprobs of this step); whoever wants the whole text accumulates it.
    FINAL_ONLY: one output, when the request finishes, carrying everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return _is_int(x) or (isinstance(x, (float, np.floating)) and not isinstance(x, bool))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and meanings).

    Every field is checked when the object is built: a wrong type or an out-of-range value
    raises `SamplingParamsError` whose `.field` names it (bool is not accepted as an int,
    floats must be finite, integers must fit the device's int32 arrays; `top_k` larger than
    the vocabulary simply keeps every token). `stop` may be a string, a sequence of
    strings, or None (no stop strings).

    Semantics (vLLM's):
      n: completions of the prompt; completion i samples with seed `seed + i` (or its own
        derived seed when `seed` is None).
      presence_penalty / frequency_penalty (in [-2, 2]): over OUTPUT tokens only,
        `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
      repetition_penalty (> 0): over tokens in the prompt OR the output, a positive logit is
        divided by it, a negative one multiplied.
      min_tokens: the stop token ids (and EOS unless ignore_eos) are masked, and stop strings
        are not checked, until this many tokens have been generated.
      logprobs: None = none; k in [0, 20] = the sampled token's log-probability plus the k
        most likely tokens'. prompt_logprobs: the same for every prompt position after the
        first. Both are RAW: log_softmax of the model's logits, before penalties,
        temperature and filters (vLLM's default `logprobs_mode="raw_logprobs"`); with
        structured_outputs, of the logits after the grammar's mask (as vLLM: tokens the
        grammar forbids have -inf).
      skip_special_tokens / spaces_between_special_tokens: detokenization of the output.
      include_stop_str_in_output: the stop string that ended the request stays in the text
        (and the stop token's own text, as vLLM); nothing is held back for stop strings then.
      logit_bias: {token id: bias in [-100, 100]} added to the logits before penalties,
        temperature and filters (OpenAI's -100 bans a token in practice, +100 all but forces
        it); greedy rows too. Raw logprobs are taken before it (vLLM).
      allowed_token_ids: None, or the only token ids the request may sample (every other
        id gets -inf, as logit_bias does).
      bad_words: words never generated: each is tokenized with and without a leading
        space (vLLM's rule); a one-token word is banned at every position, a longer one's
        last token is banned right after the output ends with its other tokens.
      truncate_prompt_tokens: None, or keep only the last k prompt tokens (-1: the last
        max_model_len); applied when the request is submitted, before the length checks.
      output_kind: a `RequestOutputKind` (CUMULATIVE, DELTA or FINAL_ONLY; its int value is
        accepted too).
      structured_outputs: None, or a `StructuredOutputsParams` (or a mapping of its fields)
        the output must match: a JSON schema, a regex, a choice, a grammar. Tokens the
        grammar does not allow are masked before penalties, temperature and filters; a
        request whose grammar is complete and admits nothing more finishes with "stop".
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] = ()
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
            stop_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise SamplingParamsError("stop", "stop and stop_token_ids must be sequences") from None
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) if _is_int(t) else t
                                                         for t in stop_ids))
        self._check_int("max_tokens", 1, INT32_MAX)
        self._check_float("temperature", 0.0, None)
        self._check_int("top_k", 0, INT32_MAX)
        self._check_float("top_p", 0.0, 1.0, low_open=True)
        self._check_float("min_p", 0.0, 1.0)
        if self.seed is not None:
            self._check_int("seed", 0, 2**32 - 1)
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", f"stop strings must be str, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise SamplingParamsError("stop_token_ids",
                                          f"token ids must be ints >= 0, got {t!r}")
        self._check_int("n", 1, 1024)
        self._check_float("presence_penalty", -2.0, 2.0)
        self._check_float("frequency_penalty", -2.0, 2.0)
        self._check_float("repetition_penalty", 0.0, None, low_open=True)
        self._check_int("min_tokens", 0, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._check_int(name, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise SamplingParamsError(name, f"must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        kind = self.output_kind
        if not _is_int(kind) or int(kind) not in RequestOutputKind._value2member_map_:
            raise SamplingParamsError("output_kind", "must be a RequestOutputKind (CUMULATIVE, "
                                      f"DELTA, FINAL_ONLY), got {kind!r}")
        object.__setattr__(self, "output_kind", RequestOutputKind(int(kind)))
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputsParams.coerce(self.structured_outputs))
        self._check_token_fields()

    def _check_token_fields(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens (the vocabulary
        and max_model_len are the engine's checks)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise SamplingParamsError("logit_bias", f"must be a mapping of token id to "
                                          f"bias, got {bias!r}")
            clean = {}
            for token, value in bias.items():
                if not _is_int(token) or not 0 <= token <= INT32_MAX:
                    raise SamplingParamsError("logit_bias", f"keys must be token ids (ints "
                                              f">= 0), got {token!r}")
                if not _is_number(value) or not -100 <= value <= 100:
                    raise SamplingParamsError("logit_bias", f"biases must be numbers in "
                                              f"[-100, 100], got {value!r} for token {token}",
                                              limit=100)
                clean[int(token)] = float(value)
            object.__setattr__(self, "logit_bias", clean or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Sequence) or not (
                    all(_is_int(t) and 0 <= t <= INT32_MAX for t in allowed)):
                raise SamplingParamsError("allowed_token_ids", f"must be a list of token ids "
                                          f"(ints >= 0), got {allowed!r}")
            if not allowed:
                raise SamplingParamsError("allowed_token_ids", "must not be empty", limit=1)
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in allowed))
        words = self.bad_words
        if isinstance(words, str) or not isinstance(words, Sequence) or not all(
                isinstance(w, str) and w.strip() for w in words):
            raise SamplingParamsError("bad_words", f"must be a list of non-empty strings, got "
                                      f"{words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= INT32_MAX)):
            raise SamplingParamsError("truncate_prompt_tokens", f"must be -1 or an int >= 1, "
                                      f"got {k!r}", limit=1)
        if k is not None:
            object.__setattr__(self, "truncate_prompt_tokens", int(k))

    @property
    def uses_token_bias(self) -> bool:
        """Whether sampling adds the request's bias row (logit_bias, allowed_token_ids,
        bad_words) to the logits."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def uses_penalty_state(self) -> bool:
        """Whether sampling reads the request's token counts (penalties or min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_tokens > 0)

    def _check_int(self, name: str, low: int, high: int) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise SamplingParamsError(name, f"must be an int, got {value!r}")
        if not low <= value <= high:
            raise SamplingParamsError(name, f"must be in [{low}, {high}], got {value}",
                                      limit=low if value < low else high)
        object.__setattr__(self, name, int(value))

    def _check_float(self, name: str, low: float, high: float | None,
                     low_open: bool = False) -> None:
        value = getattr(self, name)
        if not _is_number(value) or not math.isfinite(value):
            raise SamplingParamsError(name, f"must be a finite number, got {value!r}")
        bad_low = value <= low if low_open else value < low
        if bad_low or (high is not None and value > high):
            span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
            raise SamplingParamsError(name, f"must be in {span}, got {value}",
                                      limit=low if bad_low else high)
        object.__setattr__(self, name, float(value))
