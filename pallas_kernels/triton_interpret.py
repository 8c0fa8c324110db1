"""Runs a kernel of `triton_kernel.py` in Triton's own interpreter, from JAX, on the CPU.

`launch` is a host callback (`jax.pure_callback`), so it works inside `jax.jit` like the
GPU launch it stands in for. The interpreter runs in a worker process started with
`TRITON_INTERPRET=1`:

1. Triton reads that setting when it is imported: it turns every `triton.jit` function
   (our kernel, its helpers and Triton's own standard library) into its interpreter's
   `InterpretedFunction`. The worker has it from its start; this process keeps compiling
   kernels for the GPU (`jax_triton`, `scripts/gpu_compile_report.py`) undisturbed.
2. Each launch sends the kernel's name, grid, input arrays (numpy), output shapes and
   constexpr parameters over a pipe to the worker (`triton_worker.py`). It makes CPU
   torch tensors of them (what the interpreter reads; bfloat16 and float8 travel as raw
   bits), allocates the outputs poisoned with NaN (a row the kernel should have written
   and did not shows up), runs the grid program by program and sends the outputs back.
3. A failure inside the kernel comes back as `TritonInterpreterError` with the worker's
   traceback; a worker that died is restarted at the next launch.

NOTE: the worker is started when the first interpreted launch is traced (its imports of
triton and torch overlap the compile of the computation that calls it) and lives until
this process exits (its stdin closing ends it). It needs `triton` and `torch` (the `test` extra).
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading

import jax
import numpy as np


class TritonInterpreterError(RuntimeError):
    """The kernel failed inside Triton's interpreter (the message holds its traceback)."""


class _Worker:
    """One interpreter process; requests are serialized by a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _running(self) -> subprocess.Popen:
        """The live process, started if there is none (the caller holds the lock)."""
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ, TRITON_INTERPRET="1")
            worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "triton_worker.py")
            self._proc = subprocess.Popen([sys.executable, worker], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env)
        return self._proc

    def start(self) -> None:
        """Starts the process unless it runs (its imports then overlap what the caller
        does next, e.g. compiling the computation that will call it)."""
        with self._lock:
            self._running()

    def call(self, request: tuple):
        with self._lock:
            self._running()
            try:
                pickle.dump(request, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self._proc.stdin.flush()
                ok, payload = pickle.load(self._proc.stdout)
            except (EOFError, BrokenPipeError, pickle.UnpicklingError) as e:
                self._proc.kill()
                self._proc = None
                raise TritonInterpreterError(f"the Triton interpreter process died: {e}") from e
        if not ok:
            raise TritonInterpreterError(payload)
        return payload

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            self._proc = None


_WORKER = _Worker()
atexit.register(_WORKER.close)


def launch(kernel_name: str, grid: tuple[int, ...], arrays, out_shapes, params: dict):
    """Runs `triton_kernel.<kernel_name>[grid](*arrays, *outputs, **params)` interpreted.

    Args:
        kernel_name: a `triton.jit` function of `triton_kernel.py`.
        grid: the launch grid.
        arrays: the kernel's array inputs (jax arrays, traced or not), in order.
        out_shapes: `jax.ShapeDtypeStruct` per output (floating dtypes), in order.
        params: the kernel's constexpr parameters.

    Returns:
        The outputs, as jax arrays of `out_shapes`.
    """
    specs = tuple((tuple(s.shape), np.dtype(s.dtype).name) for s in out_shapes)
    _WORKER.start()  # while the caller's computation compiles

    def host(*host_arrays):
        request = (kernel_name, tuple(grid), [np.asarray(a) for a in host_arrays], specs,
                   dict(params))
        return tuple(_WORKER.call(request))

    return jax.pure_callback(host, tuple(out_shapes), *arrays)
