"""Typed errors of the scheduler: the root of arcjax's error hierarchy.

Every rejection of user input is an `InputError` (a `ValueError`) that names the field it broke in
`.field` (and the limit in `.limit`, where there is one), so callers (the engine, an HTTP layer) can
report it precisely; nothing else in the state is disturbed. `arcjax.errors` re-exports these
classes and adds its own subclasses; it never wraps them.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: `field` names what was wrong, `limit` the bound it broke (None if none)."""

    def __init__(self, field: str, message: str, *, limit: int | float | None = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.limit = limit

    def __reduce__(self):  # pickles with its attributes (keyword-only limit)
        return _rebuild, (type(self), self.field, self.message, self.limit)


def _rebuild(cls, field, message, limit):
    return cls(field, message, limit=limit)


class ConfigError(InputError):
    """An invalid `SchedulerConfig` value (or environment variable feeding one)."""


class RequestError(InputError):
    """A request refused at submission; the state it was offered to is unchanged."""


class DuplicateRequestError(RequestError):
    """The request id is already waiting or running."""


class RequestTooLargeError(RequestError):
    """Prompt plus max_tokens can never fit in the KV cache; retrying would never succeed."""


class UnknownRequestError(RequestError, KeyError):
    """`abort` named a request id that is neither waiting nor running (field "request_id")."""

    def __init__(self, request_id: object, message: str | None = None):
        super().__init__("request_id", message or f"unknown request id {request_id!r}")
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would quote the message
        return ValueError.__str__(self)

    def __reduce__(self):
        return type(self), (self.request_id, self.message)


class StepOrderError(RuntimeError):
    """schedule/commit called out of order: a plan is already in flight, or the plan is stale."""


class CommitError(InputError):
    """`commit` got results that do not match the plan (wrong number of sampled tokens, bad ids)."""
