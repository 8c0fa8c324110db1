"""Where a compiled step's time goes: XLA:CPU's per-op trace events, summed by part.

1. `op_parts(hlo_text)`: every instruction of an optimized HLO module (`Compiled.as_text()`)
   gets a part (`PARTS`) from its metadata: the named scope in its `op_name` (`qkv`,
   `attention`, `o_proj`, `mlp`, `lm_head`, set by arcjax/model/layers.py) and the functions
   of its stack frames (the module's `StackFrames` table: `write_kv` is the KV scatter,
   arcjax/runtime/sampling.py the sampling, its bitmask and
   arcjax/runtime/penalties.py the token tables). Inside attention a gather of pages is
   its own part (`page_gather`): an instruction whose fused computation gathers. A matmul
   whose metadata XLA's passes dropped is `dot_unscoped` (in a decode step: the layers'
   matrix-vector products); `layer_loop` is the layer scan's own work (slicing each layer's
   weights out of the stacked arrays).
2. `profile_call(call, hlo_text, iters)` runs `call` (one step, synchronized) `iters` times
   under `jax.profiler.trace` and sums the duration of every leaf op event (XLA:CPU's
   thunks; loops and conditionals, which contain others, are left out) by part: a
   `StepProfile` with the wall time per call beside it.

NOTE: the events are XLA:CPU thunks (`hlo_op` stat). A fusion is named after its root
op's metadata, so an elementwise op fused into a matmul counts as the matmul's part. The
parts' sum can exceed the wall time when thunks run on several threads at once; the shares
are of that sum.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import re
import statistics
import tempfile
import time

import jax

PARTS = ("embed", "qkv", "kv_scatter", "page_gather", "attention", "o_proj", "mlp",
         "dot_unscoped", "lm_head", "bitmask", "token_tables", "sampling", "layer_loop",
         "other")

_CONTAINERS = {"while", "conditional", "call", "tuple", "parameter", "get-tuple-element"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = .*? ([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"calls=%([\w.-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.-]+) ")


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One executable's time by part.

    Attributes:
      wall_ms: median wall time of one synchronized call.
      part_ms: per part (`PARTS`), the summed op time of one call (ms).
      ops: op events seen per call.
      top_ops: the costliest instructions, (name, part, ms per call), costliest first.
    """

    wall_ms: float
    part_ms: dict[str, float]
    ops: float
    top_ops: tuple[tuple[str, str, float], ...] = ()

    @property
    def shares(self) -> dict[str, float]:
        """Each part's fraction of the summed op time."""
        total = sum(self.part_ms.values()) or 1.0
        return {p: self.part_ms.get(p, 0.0) / total for p in PARTS}


def _tables(lines: list[str]) -> tuple[dict, dict]:
    """(stack frame id -> [function names, innermost first], file of each frame id) from
    the module's FileNames / FunctionNames / FileLocations / StackFrames tables."""
    section, tabs = None, collections.defaultdict(dict)
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section is None:
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if m is None:
            section = None
            continue
        tabs[section][int(m.group(1))] = m.group(2)
    loc = {}
    for i, text in tabs["FileLocations"].items():
        f = int(re.search(r"file_name_id=(\d+)", text).group(1))
        fn = int(re.search(r"function_name_id=(\d+)", text).group(1))
        loc[i] = (tabs["FileNames"].get(f, "").strip('"'),
                  tabs["FunctionNames"].get(fn, "").strip('"'))
    frames, files = {}, {}
    for i, text in tabs["StackFrames"].items():
        chain, seen, j = [], set(), i
        while j in tabs["StackFrames"] and j not in seen:
            seen.add(j)
            entry = tabs["StackFrames"][j]
            file_loc = int(re.search(r"file_location_id=(\d+)", entry).group(1))
            chain.append(loc.get(file_loc, ("", "")))
            parent = int(re.search(r"parent_frame_id=(\d+)", entry).group(1))
            if parent == j:
                break
            j = parent
        frames[i] = [fn for _, fn in chain]
        files[i] = [f for f, _ in chain]
    return frames, files


def _classify(op_name: str, functions: list[str], files: list[str], gathers: bool,
              opcode: str) -> str:
    """The part of one instruction (see the module docstring)."""
    if not op_name and opcode == "dot":
        return "dot_unscoped"  # a matmul whose metadata XLA's passes dropped
    scope = "/" + op_name + "/"
    if any(f in ("write_kv", "write_kv_cpu") or f.startswith("write_kv.") for f in functions):
        return "kv_scatter"  # XLA's scatter, or the CPU kernel's copy
    if "/attention/" in scope:
        return "page_gather" if gathers else "attention"
    for name in ("qkv", "o_proj", "mlp", "lm_head"):
        if f"/{name}/" in scope:
            return name
    if any(f == "apply_bitmask" for f in functions):
        return "bitmask"
    if any(f.endswith("penalties.py") for f in files):
        return "token_tables"
    if any(f.endswith(("sampling.py", "verification.py")) for f in files):
        return "sampling"
    if any(f.startswith("Embed") for f in functions):
        return "embed"
    if "/while/body" in scope and "attention" not in scope:
        return "layer_loop"  # the scan's per-layer slicing of weights and cache
    return "other"


def op_parts(hlo_text: str) -> dict[str, str | None]:
    """Instruction name -> part (`PARTS`), or None for ops that contain others (loops,
    conditionals, calls) or move nothing (parameters, tuples)."""
    lines = hlo_text.splitlines()
    frames, files = _tables(lines)
    gathering, comp, instrs = set(), None, []
    for line in lines:
        m = _COMP.match(line)
        if m is not None and line.rstrip().endswith("{"):
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        name, opcode = m.groups()
        if opcode == "gather":
            gathering.add(comp)
        instrs.append((name, opcode, line))
    out: dict[str, str | None] = {}
    for name, opcode, line in instrs:
        if opcode in _CONTAINERS:
            out[name] = None
            continue
        op = _OP_NAME.search(line)
        frame = _FRAME.search(line)
        fid = int(frame.group(1)) if frame else -1
        calls = _CALLS.findall(line)
        gathers = opcode == "gather" or any(c in gathering for c in calls)
        out[name] = _classify(op.group(1) if op else "", frames.get(fid, []),
                              files.get(fid, []), gathers, opcode)
    return out


def _op_events(trace_dir: str, module: str):
    """(hlo_op name, duration ns) of every op event of HLO module `module` in the trace
    under `trace_dir`."""
    from jax.profiler import ProfileData

    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        data = ProfileData.from_file(path)
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if "hlo_op" in stats and str(stats.get("hlo_module")) == module:
                        yield str(stats["hlo_op"]), event.duration_ns


def profile_call(call, hlo_text: str, iters: int) -> StepProfile:
    """`call` (zero arguments, returns arrays) profiled over `iters` synchronized runs
    (see the module docstring)."""
    parts = op_parts(hlo_text)
    module = re.match(r"HloModule ([\w.-]+)", hlo_text).group(1)
    jax.block_until_ready(call())  # first-use costs out of the trace
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                walls.append(time.perf_counter() - t0)
        finally:
            jax.profiler.stop_trace()
        totals, by_op, ops = collections.Counter(), collections.Counter(), 0
        for name, ns in _op_events(trace_dir, module):
            part = parts.get(name, "other")
            if part is None:
                continue
            totals[part] += ns
            by_op[name] += ns
            ops += 1
    top = tuple((name, parts.get(name, "other"), ns / 1e6 / iters)
                for name, ns in by_op.most_common(12))
    return StepProfile(wall_ms=1e3 * statistics.median(walls),
                       part_ms={p: totals[p] / 1e6 / iters for p in PARTS},
                       ops=ops / iters, top_ops=top)
