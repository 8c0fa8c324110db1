"""Typed input errors for the attention kernels."""


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong rank, shape, dtype or value.

    Attributes:
        argument: the name of the offending argument, as spelled in the signature.
    """

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")
        self.argument = argument
