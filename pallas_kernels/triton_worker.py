"""The Triton interpreter process behind `triton_interpret.launch` (run as a script).

Started with `TRITON_INTERPRET=1`, so every `triton.jit` function is Triton's interpreted
one. It imports neither jax nor the `pallas_kernels` package (a fast start): the kernel
module is loaded from its file. Requests and replies are pickled over stdin / stdout:

    request: (kernel name, grid, input arrays, [(shape, dtype name)] of outputs, constexprs)
    reply:   (True, output arrays) or (False, the traceback of the failure)
"""

import importlib.util
import os
import pickle
import sys
import traceback

import ml_dtypes
import numpy as np
import torch

_BITS = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16)}  # raw-bit carriers
# Dtypes torch.from_numpy does not take: they travel as raw bits.
_SPECIAL = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
            np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
            np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    special = _SPECIAL.get(a.dtype)
    if special is None:
        return torch.from_numpy(a.copy())
    return torch.from_numpy(a.view(_BITS[a.dtype.itemsize][0]).copy()).view(special)


def _poisoned(shape: tuple[int, ...], name: str) -> torch.Tensor:
    """An output buffer full of NaN: a row the kernel fails to write shows up."""
    dtype = _dtype(name)
    target = _SPECIAL.get(dtype) or getattr(torch, dtype.name)
    return torch.full(shape, float("nan"), dtype=torch.float32).to(target)


def _to_numpy(t: torch.Tensor, name: str) -> np.ndarray:
    dtype = _dtype(name)
    if dtype in _SPECIAL:
        return t.view(_BITS[dtype.itemsize][1]).numpy().view(dtype)
    return t.numpy()


def _numpy_scalar_shim() -> None:
    """Triton < 3.7's interpreter turns a scalar tensor into an index with
    `int(<1-element array>)`, which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed in
    3.7 by squeezing first). Same fix, for the worker of such a Triton only."""
    import triton
    from triton.runtime import interpreter

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) >= (3, 7):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _load_kernels():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_kernel.py")
    spec = importlib.util.spec_from_file_location("triton_kernel_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(requests, replies) -> None:
    _numpy_scalar_shim()
    kernels = _load_kernels()
    while True:
        try:
            kernel_name, grid, arrays, specs, params = pickle.load(requests)
        except EOFError:
            return
        try:
            outputs = [_poisoned(shape, name) for shape, name in specs]
            getattr(kernels, kernel_name)[grid](*map(_to_torch, arrays), *outputs, **params)
            reply = (True, [_to_numpy(o, name) for o, (_, name) in zip(outputs, specs)])
        except Exception:  # noqa: BLE001 - every failure goes back to the caller
            reply = (False, traceback.format_exc())
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("started by pallas_kernels.triton_interpret, with TRITON_INTERPRET=1")
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not hit the pipe
    serve(sys.stdin.buffer, replies)
