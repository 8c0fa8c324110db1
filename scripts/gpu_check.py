"""The H200 check behind `scripts/gpu_check.sh`: one run that verifies every GPU kernel,
times them against the machine's own ceilings and serves a burst, whatever breaks.

Sections, in order (each flushed to `--out`/gpu_check.json and .md as it changes):
  1. environment: python, packages, `nvidia-smi`, then what JAX sees (versions, devices,
     free memory, the GPU backends, what "auto" picks and whether it is verified).
  2. correctness: every implementation (pallas_gpu, triton, mosaic_gpu) against the oracle
     (scripts/gpu_kernels.py); on a GPU, an implementation whose every case passed is
     recorded per shape class where `$ARCJAX_VERIFIED_KERNELS` says
     (`pallas_kernels.verified`).
  3. kernel_table: the machine's ceilings (matmul, copy), each implementation's default
     tiling, cuDNN on the prefill shapes, the MoE grouped GEMM, the W4A16 kernel, the
     MLA kernel on DeepSeek-V2-Lite decode batches (scripts/gpu_bench.py); each GPU
     kernel's batch-invariant plan, a probe's rows bitwise their lone decodes
     (scripts/gpu_invariance.py).
  4. end_to_end: one throughput row and one token_budget burst arm (scripts/gpu_e2e.py).
  5. alt_tilings: the Pallas and Triton kernels' alternative tilings, if time is left.
  6. gpu_tests: `pytest -m gpu` over the GPU test files only, last.
The closing lines printed are the summary table (also at the top of gpu_check.md).

Isolation: every task is its own process (scripts/gpu_child.py) with its own timeout and
`XLA_PYTHON_CLIENT_PREALLOCATE=false`; a crash, a hang or a CUDA fault costs that task,
recorded with its error and the case it was in. This process never initialises a device.

Budget: each task is allotted min(its timeout, what is left of `--budget_s` less what the
protected tasks after it expect: end to end and the GPU tests); a task whose allotment is
under its minimum is skipped and says so. `--inject=SECTION.NAME:crash|hang|over_budget`
makes a task fail on purpose; `--timeout=SECTION.NAME=S` overrides a task's timeout.

  scripts/gpu_check.sh --out /tmp/gpu_check          # on the H200
  scripts/gpu_check.sh --out /tmp/smoke --cpu-smoke  # anywhere (CPU, interpret mode)
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_report  # noqa: E402  (scripts beside this one)
import gpu_summary  # noqa: E402
from gpu_child import INJECTIONS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TEST_FILES = ("tests/test_kernels_pallas_gpu.py", "tests/test_kernels_triton.py",
                  "tests/test_gpu_lowering_mosaic.py")
IMPLS = ("pallas_gpu", "triton", "mosaic_gpu")
GPU_BUDGET_S = 555.0  # the whole run on the H200 (scripts/gpu_check.sh's budget table)

_OUT = flags.DEFINE_string("out", None, "directory for gpu_check.json, gpu_check.md, rows/")
_CPU_SMOKE = flags.DEFINE_boolean("cpu_smoke", False,
                                  "tiny shapes on the CPU, kernels in interpret mode")
_BUDGET_S = flags.DEFINE_float("budget_s", None, f"seconds for the whole run (default: "
                               f"{GPU_BUDGET_S:.0f} on the GPU; 1,700 for --cpu_smoke, whose "
                               f"interpreters are slow)")
_INJECT = flags.DEFINE_list("inject", [], "SECTION.NAME:MODE tasks that fail on purpose")
_TIMEOUT = flags.DEFINE_list("timeout", [], "SECTION.NAME=SECONDS timeout overrides")
_REHEARSAL = flags.DEFINE_boolean(
    "rehearsal", False, "every task a placeholder (rows on a timer, no JAX): the schedule, "
    "isolation and report in seconds (with --cpu_smoke; tests/test_kernels_gpu_check.py)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    section: str
    name: str
    kind: str  # gpu_child.py's runner, or "pytest"
    expect_s: float  # what it takes on an H200 (the note's table; reserves use it)
    timeout_s: float  # its own cap
    min_s: float  # not started with less allotted
    protected: bool = False  # later tasks' allotments leave its expect_s
    params: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def plan() -> list[TaskSpec]:
    """Every task in order, with its expected seconds on the H200 and its cap."""
    t = TaskSpec
    alt = {"tilings": "alternatives"}
    return [
        t(section="environment", name="jax", kind="environment", expect_s=12, timeout_s=60,
          min_s=20),
        *(t(section="correctness", name=i, kind="correctness", expect_s=e, timeout_s=90,
            min_s=30) for i, e in zip(IMPLS, (45, 45, 25))),
        t(section="kernel_table", name="ceilings", kind="ceilings", expect_s=12, timeout_s=45,
          min_s=15),
        *(t(section="kernel_table", name=i, kind="table", expect_s=e, timeout_s=75, min_s=25)
          for i, e in zip(IMPLS, (35, 35, 20))),
        t(section="kernel_table", name="cudnn", kind="cudnn", expect_s=15, timeout_s=45,
          min_s=15),
        t(section="kernel_table", name="moe", kind="moe", expect_s=25, timeout_s=60, min_s=20),
        t(section="kernel_table", name="w4a16", kind="w4a16", expect_s=25, timeout_s=50,
          min_s=15),
        t(section="kernel_table", name="mla", kind="mla", expect_s=15, timeout_s=40,
          min_s=12),
        t(section="kernel_table", name="invariance", kind="invariance", expect_s=20,
          timeout_s=60, min_s=15),
        t(section="end_to_end", name="e2e", kind="e2e", expect_s=170, timeout_s=220, min_s=90,
          protected=True),
        *(t(section="alt_tilings", name=i, kind="table", expect_s=25, timeout_s=60, min_s=20,
            params=alt) for i in IMPLS[:2]),
        t(section="gpu_tests", name="pytest", kind="pytest", expect_s=50, timeout_s=90,
          min_s=30, protected=True),
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    out: str
    cpu_smoke: bool
    budget_s: float
    inject: dict[str, str]  # task key -> mode
    timeouts: dict[str, float]  # task key -> seconds
    rehearsal: bool = False

    @property
    def margin_s(self) -> float:
        """Kept free at the end of the budget (the summary, the transfers)."""
        return 0.5 if self.cpu_smoke else 3.0

    def timeout(self, spec: TaskSpec) -> float:
        default = (20.0 if self.rehearsal else 150.0) if self.cpu_smoke else spec.timeout_s
        return self.timeouts.get(spec.key, default)

    def min_s(self, spec: TaskSpec) -> float:
        return 1.0 if self.cpu_smoke else min(spec.min_s, self.timeout(spec))

    def expect(self, spec: TaskSpec) -> float:
        if self.cpu_smoke:
            return 0.5 if self.rehearsal else 5.0
        return min(spec.expect_s, self.timeout(spec))


def allotment(cfg: CheckConfig, specs: list[TaskSpec], index: int, elapsed: float) -> float:
    """Seconds task `index` may run: its timeout, or what is left of the budget less the
    protected tasks after it expect and the closing margin (under `cfg.min_s`: skipped)."""
    later = sum(cfg.expect(s) for s in specs[index + 1:] if s.protected)
    return min(cfg.timeout(specs[index]), cfg.budget_s - elapsed - later - cfg.margin_s)


def parse_config(*, out: str, cpu_smoke: bool, budget_s: float, inject: list[str],
                 timeout: list[str], rehearsal: bool = False) -> CheckConfig:
    keys = {s.key for s in plan()}
    injections, timeouts = {}, {}
    for item in inject:
        key, _, mode = item.partition(":")
        if key not in keys or mode not in INJECTIONS:
            raise app.UsageError(f"--inject={item}: expected SECTION.NAME:MODE with a task "
                                 f"of {sorted(keys)} and a mode of {INJECTIONS}")
        injections[key] = mode
    for item in timeout:
        key, _, seconds = item.partition("=")
        if key not in keys:
            raise app.UsageError(f"--timeout={item}: no task {key!r}; tasks: {sorted(keys)}")
        timeouts[key] = float(seconds)
    if rehearsal and not cpu_smoke:
        raise app.UsageError("--rehearsal runs placeholder tasks: only with --cpu_smoke")
    return CheckConfig(out=out, cpu_smoke=cpu_smoke, budget_s=budget_s, inject=injections,
                       timeouts=timeouts, rehearsal=rehearsal)


def child_env(cfg: CheckConfig) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env["JAX_PLATFORMS"] = "cpu" if cfg.cpu_smoke else "cuda,cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def spawn(cmd: list[str], env: dict, *, timeout_s: float, key: str, poll=None) -> dict:
    """Runs `cmd` in its own process group, its output prefixed into this log; kills the
    group at `timeout_s`. Returns {"returncode", "timed_out", "seconds", "tail"}."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"    [{key}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    while True:
        try:
            proc.wait(timeout=2.0)
            break
        except subprocess.TimeoutExpired:
            if poll is not None:
                poll()
            if time.monotonic() - start > timeout_s:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    reader.join(timeout=5)
    return dict(returncode=proc.returncode, timed_out=timed_out,
                seconds=round(time.monotonic() - start, 1), tail=list(tail))


def read_events(path: str) -> tuple[list[dict], str | None, dict | None]:
    """(rows, the case started and not finished, the done info or None) of a rows file."""
    rows, open_case, done = [], None, None
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return rows, None, None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if event["event"] == "start":
            open_case = event["case"]
        elif event["event"] == "row":
            rows.append(event["row"])
            open_case = None
        elif event["event"] == "done":
            done = event["info"]
    return rows, open_case, done


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_task(cfg: CheckConfig, report: gpu_report.Report, spec: TaskSpec,
             allotted_s: float) -> dict:
    """One task in its own process; its result (also in the report, rows as they come)."""
    os.makedirs(os.path.join(cfg.out, "rows"), exist_ok=True)
    path = os.path.join(cfg.out, "rows", f"{spec.key}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    base = dict(kind=spec.kind, allotted_s=round(allotted_s, 1))
    task = dict(section=spec.section, name=spec.name,
                kind="rehearsal" if cfg.rehearsal else spec.kind, rows=path,
                deadline=time.time() + allotted_s - cfg.margin_s, smoke=cfg.cpu_smoke,
                params=spec.params, inject=cfg.inject.get(spec.key))

    def partial():
        rows, case, _ = read_events(path)
        if rows != report.rows(spec.section, spec.name):
            report.task(spec.section, spec.name, base | dict(status="running", rows=rows,
                                                             running=case))

    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_child.py"),
           f"--task={json.dumps(task)}"]
    res = spawn(cmd, child_env(cfg), timeout_s=allotted_s, key=spec.key, poll=partial)
    rows, case, done = read_events(path)
    result = base | dict(seconds=res["seconds"], rows=rows, info=done or {})
    if res["timed_out"]:
        result |= dict(status="timeout", error=f"killed at its {allotted_s:.0f} s allotment"
                       + (f" in case {case}" if case else ""))
    elif done is None or res["returncode"] != 0:
        how = (_signal_name(res["returncode"]) if res["returncode"] < 0
               else f"exit code {res['returncode']}")
        result |= dict(status="crashed", error=f"{how}" + (f" in case {case}" if case else "")
                       + f": {' / '.join(res['tail'][-3:])}"[:600])
    else:
        result["status"] = "ok"
    if case is not None and result["status"] != "ok":  # the case it died in
        rows.append(dict(case=case, impl=spec.name, ok=False, error=result["error"]))
    report.task(spec.section, spec.name, result)
    return result


def gpu_tests(cfg: CheckConfig, report: gpu_report.Report, spec: TaskSpec,
              allotted_s: float) -> dict:
    """`pytest -m gpu` over the GPU test files; on the GPU every selected test must run,
    or skip naming a package the device lacks."""
    base = dict(kind="pytest", allotted_s=round(allotted_s, 1))
    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:  # the test modules cannot import: a package the device lacks, not a failure
        result = base | dict(status="skipped", seconds=0, rows=[], missing_package=True, error=(
            f"{' and '.join(missing)} not installed (bash scripts/gpu_wheels.sh puts "
            f"hypothesis in .whl/)"))
        report.task(spec.section, spec.name, result)
        return result
    junit = os.path.join(cfg.out, "pytest_gpu.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "-rs", f"--junitxml={junit}", *GPU_TEST_FILES]
    res = spawn(cmd, child_env(cfg), timeout_s=allotted_s, key=spec.key)
    counts = gpu_report.junit_counts(junit)
    bad_skips = [s for s in counts["skips"] if not gpu_report.MISSING_PACKAGE.search(s[1])]
    failed = counts["failed"] + counts["error"]
    if res["timed_out"]:
        status, error = "timeout", f"killed at its {allotted_s:.0f} s allotment"
    elif res["returncode"] not in (0, 1) or (res["returncode"] == 1 and not failed):
        status, error = "crashed", f"pytest exit code {res['returncode']}: {res['tail'][-1:]}"
    elif failed:
        status, error = "failed", f"{failed} failed or errored"
    elif not cfg.cpu_smoke and (bad_skips or not counts["passed"]):
        status, error = "failed", f"skipped on the GPU: {bad_skips[:3] or 'nothing passed'}"
    else:
        status, error = "ok", None
    result = base | dict(status=status, seconds=res["seconds"], error=error,
                         rows=[dict(test=t, skipped=r) for t, r in counts["skips"]])
    report.set(spec.section, command=" ".join(cmd[1:]),
               counts={k: v for k, v in counts.items() if k != "skips"})
    report.task(spec.section, spec.name, result)
    return result


def host_facts(cfg: CheckConfig) -> dict:
    """The parent's view: python, packages (metadata only: no import), nvidia-smi."""
    wanted = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt",
              "jax-cuda13-pjrt", "triton", "jax-triton", "hypothesis", "numpy", "pytest",
              "torch")
    packages = {}
    for name in wanted:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    facts = dict(python=platform.python_version(), machine=platform.machine(),
                 packages=packages, wheels=os.environ.get("GPU_CHECK_WHEELS", ""),
                 records=os.environ.get("ARCJAX_VERIFIED_KERNELS", ""))
    if not cfg.cpu_smoke:
        query = ("name,memory.total,memory.used,memory.free,driver_version,clocks.max.sm,"
                 "power.limit")
        try:
            res = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                                 capture_output=True, text=True, timeout=20, check=False)
            facts["nvidia_smi"] = (res.stdout or res.stderr).strip().splitlines()
        except (OSError, subprocess.TimeoutExpired) as e:
            facts["nvidia_smi"] = f"unavailable: {e}"
    return facts


def main(argv):
    del argv
    if not _OUT.value:
        raise app.UsageError("--out DIR is required")
    budget = _BUDGET_S.value or (1700.0 if _CPU_SMOKE.value else GPU_BUDGET_S)
    cfg = parse_config(out=_OUT.value, cpu_smoke=_CPU_SMOKE.value, budget_s=budget,
                       inject=_INJECT.value, timeout=_TIMEOUT.value, rehearsal=_REHEARSAL.value)
    report = gpu_report.Report(cfg.out, dataclasses.asdict(cfg))
    report.set("environment", host=host_facts(cfg))
    specs = plan()
    for i, spec in enumerate(specs):
        allotted = allotment(cfg, specs, i, report.elapsed())
        if allotted < cfg.min_s(spec):
            report.task(spec.section, spec.name, dict(
                status="skipped", seconds=0, rows=[], allotted_s=round(max(allotted, 0), 1),
                error=f"time budget: {max(allotted, 0):.0f} s for it, needs "
                      f"{cfg.min_s(spec):.0f}"))
        elif spec.kind == "pytest" and not cfg.rehearsal:
            gpu_tests(cfg, report, spec, allotted)
        else:
            run_task(cfg, report, spec, allotted)
        gpu_summary.close_section(cfg, report, spec)
        status = report.sections[spec.section]["tasks"][spec.name]["status"]
        print(f"[{report.elapsed():6.1f}s] {spec.key}: {status}", flush=True)
        if spec.section == "environment" and not gpu_summary.environment_ok(cfg, report):
            print(f"gpu_check: no GPU backend here; see {cfg.out}/gpu_check.md "
                  f"(use --cpu-smoke off the GPU)", flush=True)
            break
    ok = gpu_summary.finish(cfg, report)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
