"""One task of `scripts/gpu_check.py`, in its own process (run by it, not by hand).

  python scripts/gpu_child.py --task='{"section": "correctness", "name": "triton", ...}'

The parent starts one child per task, each with its own timeout and with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, so a crash, a hang or a CUDA fault costs that
task only. The child reports through a JSON-lines file (`Task.rows`), flushed line by
line so that whatever it finished survives it:

    {"event": "start", "case": NAME}    before each case (a crash names its case)
    {"event": "row", "row": {...}}      each result, as it finishes
    {"event": "done", "info": {...}}    the task ended by itself

`Task.inject` makes the task fail on purpose (the CPU smoke test of the isolation):
"crash" aborts the process at its first event (as a CUDA fault does), "hang" sleeps there
forever, "over_budget" sleeps past the deadline after its first row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

INJECTIONS = ("crash", "hang", "over_budget")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    section: str  # the report section: "environment", "correctness", "kernel_table", ...
    name: str  # the task within it: an implementation, "ceilings", "e2e", ...
    kind: str  # which function runs it (`RUNNERS`)
    rows: str  # the JSON-lines file it reports through
    deadline: float  # time.time() by which it must have finished (the parent kills it then)
    smoke: bool = False  # tiny shapes on the CPU, kernels interpreted
    params: dict = dataclasses.field(default_factory=dict)
    inject: str | None = None  # one of INJECTIONS

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    def seconds_left(self) -> float:
        return self.deadline - time.time()


class Emitter:
    """Writes a task's events to its rows file, one flushed line each."""

    def __init__(self, task: Task):
        self.task = task
        self._file = open(task.rows, "a", buffering=1)
        self._rows = 0

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self.task.inject in ("crash", "hang"):  # at its first case (or skipped row)
            what = event.get("case") or event.get("row", {}).get("case")
            print(f"[{self.task.key}] injected {self.task.inject} at {what}", flush=True)
            if self.task.inject == "crash":
                os.abort()
            time.sleep(10**6)

    def start(self, case: str) -> None:
        self._write({"event": "start", "case": case})

    def row(self, row: dict) -> None:
        self._write({"event": "row", "row": row})
        self._rows += 1
        if self.task.inject == "over_budget":
            print(f"[{self.task.key}] injected overrun after {self._rows} row(s)", flush=True)
            time.sleep(max(0.0, self.task.seconds_left()) + 10**6)

    def done(self, info: dict) -> None:
        self._write({"event": "done", "info": info})
        self._file.close()


def environment(task: Task, emit: Emitter) -> dict:
    """What JAX sees: versions, devices, free memory, the GPU backends, what "auto" picks."""
    emit.start("jax")
    import jax
    import jaxlib

    from pallas_kernels import backends, choose_impl

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        devices = jax.devices()
        info = dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
                    backend=jax.default_backend(), device_kind=devices[0].device_kind,
                    devices=[f"{d.platform}:{d.device_kind}" for d in devices])
        try:
            stats = devices[0].memory_stats() or {}
            info["memory"] = {k: stats[k] for k in ("bytes_limit", "bytes_in_use")
                              if k in stats}
        except Exception as e:  # noqa: BLE001 - a CPU device has none
            info["memory"] = f"unavailable: {type(e).__name__}"
        info["attention"] = dict(
            pallas_triton=backends.pallas_triton_state(),
            triton=backends.triton_unavailable() or "available",
            mosaic_gpu=backends.mosaic_gpu_unavailable() or "available")
        # What "auto" runs for Llama-8B's heads, and whether a record vouches for it.
        for name, max_q_len, opts in (("auto_mixed", None, None), ("auto_decode", 1, None),
                                      ("auto_fp8_window", None, frozenset(
                                          {"sliding_window", "k_scale", "v_scale"}))):
            choice = choose_impl("auto", head_dim=128, block_size=16, max_q_len=max_q_len,
                                 num_heads=32, num_kv_heads=8, plain=opts is None,
                                 options=opts, pallas_gpu_ok=True,
                                 kv_dtype="float8_e4m3fn" if opts else None)
            info["attention"][name] = dict(impl=choice.impl, verified=choice.verified,
                                           shape_class=choice.shape_class)
    info["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
    emit.row(info)
    return info


def rehearsal(task: Task, emit: Emitter) -> dict:
    """A placeholder task (`--rehearsal`): two rows on a short timer, no JAX, so the
    schedule, the isolation and the report are checked in seconds."""
    for i, part in enumerate(("throughput", "burst")):
        emit.start(f"rehearsal_{i}")
        time.sleep(0.05)
        emit.row(dict(case=f"rehearsal_{i}", impl=task.name, part=part, ok=True,
                      shape_class="d64-p16-g2", rehearsal=True))
    return dict(backend="rehearsal", device_kind="rehearsal")


def _runners(kind: str):
    if kind == "rehearsal":
        return rehearsal
    import gpu_bench
    import gpu_e2e
    import gpu_invariance
    import gpu_kernels

    return {"environment": environment, "correctness": gpu_kernels.correctness,
            "table": gpu_kernels.table, "ceilings": gpu_bench.ceilings,
            "cudnn": gpu_bench.cudnn_reference, "moe": gpu_bench.moe_grouped_gemm,
            "w4a16": gpu_bench.w4a16_decode, "mla": gpu_bench.mla_decode,
            "invariance": gpu_invariance.invariance,
            "e2e": gpu_e2e.run}[kind]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].startswith("--task="):
        print(__doc__, file=sys.stderr)
        return 2
    task = Task(**json.loads(argv[1][len("--task="):]))
    if task.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    emit = Emitter(task)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        info = _runners(task.kind)(task, emit) or {}
    info.setdefault("warnings", sorted({f"{w.category.__name__}: {w.message}" for w in seen}))
    emit.done(info)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
