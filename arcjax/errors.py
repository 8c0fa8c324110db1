"""Typed errors for bad requests: each is a ValueError naming the field and the limit."""


class RequestError(ValueError):
    """A request rejected at submission; nothing else in the engine is affected."""


class UnknownRequestError(RequestError, KeyError):
    """abort() of an id that is not an unfinished request."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class EngineConfigError(ValueError):
    """An engine option out of range (names the option and the limit)."""
