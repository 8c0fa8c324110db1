"""Typed errors of the scheduler.

Every rejection of user input is a `ValueError` subclass that names the field it broke (and the limit,
where there is one), so callers can report it precisely and nothing else in the state is disturbed.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid `SchedulerConfig` value (or environment variable feeding one)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestError(ValueError):
    """A request refused by `add_request`; the state it was offered to is unchanged."""

    def __init__(self, field: str, message: str, *, limit: int | None = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.limit = limit


class DuplicateRequestError(RequestError):
    """The request id is already waiting or running."""


class RequestTooLargeError(RequestError):
    """Prompt plus max_tokens can never fit in the KV cache; retrying would never succeed."""


class UnknownRequestError(KeyError):
    """`abort` named a request id that is neither waiting nor running."""

    def __init__(self, request_id: object):
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"unknown request id {self.request_id!r}"


class StepOrderError(RuntimeError):
    """schedule/commit called out of order: a plan is already in flight, or the plan is stale."""


class CommitError(ValueError):
    """`commit` got results that do not match the plan (wrong number of sampled tokens, bad ids)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
