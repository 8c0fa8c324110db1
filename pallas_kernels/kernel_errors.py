"""Typed input errors for the attention kernels."""


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong rank, shape, dtype or value.

    Attributes:
        argument: the name of the offending argument, as spelled in the signature.
    """

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")
        self.argument = argument


def require(ok: bool, argument: str, message: str) -> None:
    """Raises `KernelArgumentError(argument, message)` unless `ok`."""
    if not ok:
        raise KernelArgumentError(argument, message)
