"""scripts/gpu_check.sh on the CPU: the H200 run's schedule, isolation and report.

The first GPU window must not be lost to a typo or to one stage that breaks:
- a rehearsal (placeholder tasks, no JAX: seconds) with one task made to crash, one to
  hang and one to overrun its budget: every other section and the summary are written;
- the budget: end to end and the GPU tests keep their time, the alternative tilings
  give theirs up; what the device script records, and when; the GPU-test rule;
- the real `--cpu-smoke` (tiny shapes, kernels interpreted), with the same three faults
  injected into tasks whose code paths other tasks also run.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from pallas_kernels import cpu_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402
import gpu_report  # noqa: E402
import gpu_summary  # noqa: E402

SECTIONS = ["environment", "correctness", "kernel_table", "end_to_end", "alt_tilings",
            "gpu_tests"]
FAULTS = {"correctness.triton": "crash", "kernel_table.pallas_gpu": "hang",
          "end_to_end.e2e": "over_budget"}


def _run(out, *flags, timeout):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("ARCJAX_VERIFIED_KERNELS", None)
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--out",
                           str(out), "--cpu-smoke", *flags], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def _tasks(report: dict) -> dict[str, dict]:
    return {f"{s}.{n}": t for s, sec in report["sections"].items()
            for n, t in sec["tasks"].items()}


def _check_faults(res, out, faults):
    """Each injected fault cost its own task only; everything else ran and was written."""
    report = json.loads((out / "gpu_check.json").read_text())
    assert list(report["sections"]) == SECTIONS
    tasks = _tasks(report)
    assert set(tasks) == {s.key for s in gpu_check.plan()}
    for key, mode in faults.items():
        task = tasks[key]
        if mode == "crash":  # aborted like a CUDA fault: the signal says so
            assert task["status"] == "crashed" and "SIGABRT" in task["error"], task
        else:  # killed at its allotment, rows it finished kept
            assert task["status"] == "timeout" and "killed at its" in task["error"], task
        if mode == "over_budget":
            assert [r for r in task["rows"] if "error" not in r], task
        assert not task["ok"]
    others = {k: t for k, t in tasks.items() if k not in faults}
    assert all(t["status"] == "ok" and t["ok"] for t in others.values()), others
    failed = {k.split(".")[0] for k in faults}
    assert {s for s, sec in report["sections"].items() if not sec["ok"]} == failed
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    # The summary table is what the run prints last, and heads the markdown.
    summary = report["summary"]
    assert res.stdout.rstrip().splitlines()[-len(summary):] == summary
    assert summary[-1].startswith("SOME SECTIONS FAILED")
    assert all(any(line.startswith(k) for line in summary) for k in tasks)
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## {s}:" in markdown for s in SECTIONS) and summary[0] in markdown
    assert (out / "log").read_text().rstrip().endswith(summary[-1])
    assert report["elapsed_s"] < report["config"]["budget_s"]
    return report, tasks


def test_faults_cost_only_their_task_rehearsal(tmp_path):
    out = tmp_path / "check"
    inject = ",".join(f"{k}:{m}" for k, m in FAULTS.items())
    res = _run(out, "--rehearsal", "--budget_s=60", f"--inject={inject}",
               "--timeout=kernel_table.pallas_gpu=2,end_to_end.e2e=2", timeout=60)
    _, tasks = _check_faults(res, out, FAULTS)
    # the case each died in is named, and kept as a failed row
    assert "in case rehearsal_0" in tasks["correctness.triton"]["error"]
    assert "in case rehearsal_0" in tasks["kernel_table.pallas_gpu"]["error"]
    assert tasks["correctness.triton"]["rows"][-1] == dict(
        case="rehearsal_0", impl="triton", ok=False, error=tasks["correctness.triton"]["error"])
    assert tasks["kernel_table.pallas_gpu"]["allotted_s"] == 2
    # each task's rows came back through its own file, as they were written
    assert sorted(os.listdir(out / "rows")) == sorted(f"{k}.jsonl" for k in tasks)


def _spec(**kw):
    base = dict(section="s", name="n", kind="table", expect_s=10, timeout_s=60, min_s=20)
    return gpu_check.TaskSpec(**(base | kw))


def _cfg(**kw):
    base = dict(out="/nonexistent", cpu_smoke=False, budget_s=gpu_check.GPU_BUDGET_S, inject={},
                timeouts={})
    return gpu_check.CheckConfig(**(base | kw))


def test_allotment_keeps_time_for_end_to_end_and_the_gpu_tests():
    specs, cfg = gpu_check.plan(), _cfg()
    keys = [s.key for s in specs]
    e2e, alt, tests = (keys.index(k) for k in ("end_to_end.e2e", "alt_tilings.pallas_gpu",
                                               "gpu_tests.pytest"))
    # A kernel task late in its section gets its cap only while e2e and the tests still fit.
    moe = keys.index("kernel_table.moe")
    assert gpu_check.allotment(cfg, specs, moe, elapsed=100) == 60
    budget = cfg.budget_s
    assert gpu_check.allotment(cfg, specs, moe, elapsed=300) == budget - 300 - 170 - 50 - 3
    # End to end gets its cap, less what the GPU tests need after it.
    assert gpu_check.allotment(cfg, specs, e2e, elapsed=250) == 220
    assert gpu_check.allotment(cfg, specs, e2e, elapsed=330) == budget - 330 - 50 - 3
    # Late, the alternative tilings give their time up; the GPU tests still run.
    assert gpu_check.allotment(cfg, specs, alt, elapsed=budget - 60) < cfg.min_s(specs[alt])
    assert gpu_check.allotment(cfg, specs, tests, elapsed=budget - 60) >= cfg.min_s(specs[tests])
    # The plan's expected times fit the budget with the alternatives trimmed.
    protected = sum(s.expect_s for s in specs if s.section != "alt_tilings")
    assert protected + 5 < cfg.budget_s < 600
    with pytest.raises(Exception, match="SECTION.NAME:MODE"):
        gpu_check.parse_config(out="x", cpu_smoke=True, budget_s=1, inject=["nope:crash"],
                               timeout=[])
    with pytest.raises(Exception, match="only with --cpu_smoke"):
        gpu_check.parse_config(out="x", cpu_smoke=False, budget_s=1, inject=[], timeout=[],
                               rehearsal=True)


def _rows(*oks, skipped=(), blocked=False):
    rows = [dict(impl="triton", case=f"c{i}", shape_class=cls, ok=ok)
            for i, (cls, ok) in enumerate(oks)]
    return rows + [dict(impl="triton", case=f"s{i}", shape_class="d128-p16-g4",
                        skipped="why", blocks_record=blocked) for i in range(len(skipped))]


def test_records_only_what_passed_on_a_gpu(tmp_path, monkeypatch):
    path = tmp_path / "records.json"
    monkeypatch.setenv("ARCJAX_VERIFIED_KERNELS", str(path))
    cls4, cls8 = "d128-p16-g4", "d128-p32-g8-fp8"
    assert gpu_summary.passes(_rows((cls4, True), (cls8, True), (cls4, True),
                                    skipped=[1])) == {cls4: 2, cls8: 1}
    assert gpu_summary.passes(_rows((cls4, True), (cls8, False))) is None  # one failed
    assert gpu_summary.passes(_rows((cls4, True), skipped=[1], blocked=True)) is None
    assert gpu_summary.passes(_rows(skipped=[1])) is None  # nothing ran

    def finished(rows, backend="gpu", status="ok"):
        return dict(status=status, rows=rows, info=dict(backend=backend,
                                                        device_kind="NVIDIA H200"))

    report = gpu_report.Report(str(tmp_path / "out"), {})
    report.task("correctness", "triton", finished(_rows((cls4, True), (cls8, True))))
    gpu_summary.record(_cfg(), report, "triton", report.sections["correctness"]["tasks"]["triton"])
    written = json.loads(path.read_text())
    assert [(r["impl"], r["shape_class"], r["cases"]) for r in written] == [
        ("triton", cls4, 1), ("triton", cls8, 1)]
    assert all(r["device_kind"] == "NVIDIA H200" for r in written)
    # Not from a crashed task, not off the GPU, and a smoke run only says what it would.
    for result, cfg in [(finished(_rows((cls4, True)), status="crashed"), _cfg()),
                        (finished(_rows((cls4, True)), backend="cpu"), _cfg()),
                        (finished(_rows((cls4, True))), _cfg(cpu_smoke=True))]:
        gpu_summary.record(cfg, report, "triton", result)
    assert len(json.loads(path.read_text())) == 2
    assert [r["written"] for r in report.sections["correctness"]["records"]] == [
        True, True, False]


def _mla_rows(tmp_path, name):
    from gpu_child import Emitter, Task

    task = Task(section="kernel_table", name="mla", kind="mla", rows=str(tmp_path / name),
                deadline=time.time() + 300, smoke=True)
    gpu_bench.mla_decode(task, Emitter(task))
    rows, _, _ = gpu_check.read_events(task.rows)
    return gpu_report.with_fractions(rows, {"tbps": 1.0})


def test_mla_row_checks_the_kernel_against_the_oracle_and_reports_its_bandwidth(
        tmp_path, monkeypatch):
    assert "kernel_table.mla" in {s.key for s in gpu_check.plan()}
    rows = _mla_rows(tmp_path, "ok.jsonl")  # the kernel interpreted, tiny shapes
    assert [(r["case"], r["impl"]) for r in rows] == [
        (f"mla_decode_{n}x{c}", impl) for n, c in gpu_bench.MLA_SMOKE_CASES
        for impl in ("pallas_gpu", "xla")]
    for r in rows:
        assert "error" not in r and r["max_rel_err"] <= r["tolerance"] and r["padding_exact_zero"]
        assert r["ok"] and r["shape_class"] == "d64-r16-p16-g16"  # what a GPU pass records
        assert r["kv_bytes"] == r["seqs"] * r["context"] * (r["latent_dim"] + r["rope_dim"]) * 2
        assert r["tbps_of_sheet"] == r["tbps"] / 4.8 and r["tbps_of_measured"] == r["tbps"]
    assert any(r["num_splits"] > 1 for r in rows)  # the split decode path ran
    # An oracle the kernel does not match: every row says so.
    import pallas_kernels.mla_reference as reference

    oracle = reference.mla_attention_float64
    monkeypatch.setattr(gpu_bench, "MLA_SMOKE_CASES", gpu_bench.MLA_SMOKE_CASES[:1])
    monkeypatch.setattr(reference, "mla_attention_float64", lambda x: oracle(x) + 0.1)
    bad = _mla_rows(tmp_path, "bad.jsonl")
    assert len(bad) == 2 and all("against the oracle" in r["error"] and r["ok"] is False
                                 for r in bad)


def test_gpu_tests_may_skip_only_for_a_missing_package(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="triton"><skipped message="impl=\'triton\' cannot '
        'launch: the jax_triton package is not installed (pip install \'arcjax[gpu]\')"/>'
        '</testcase><testcase classname="a" name="gpu"><skipped message="needs an NVIDIA '
        'GPU"/></testcase><testcase classname="a" name="bad"><failure/></testcase>'
        '</testsuite></testsuites>')
    counts = gpu_report.junit_counts(str(junit))
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 2)
    named = [bool(gpu_report.MISSING_PACKAGE.search(r)) for _, r in counts["skips"]]
    assert named == [True, False]  # "needs an NVIDIA GPU" on the GPU is a failure


@pytest.mark.slow
def test_cpu_smoke_writes_every_section_whatever_breaks(tmp_path):
    # The real tasks on tiny shapes; the faults go to tasks whose code paths others run
    # too (Mosaic GPU has no interpreter; the ceilings keep their matmul row; the Triton
    # alternative tilings are the Triton table's code with other plans).
    faults = {"correctness.mosaic_gpu": "crash", "alt_tilings.triton": "hang",
              "kernel_table.ceilings": "over_budget"}
    out = tmp_path / "check"
    inject = ",".join(f"{k}:{m}" for k, m in faults.items())
    res = _run(out, f"--inject={inject}",
               "--timeout=alt_tilings.triton=5,kernel_table.ceilings=25", timeout=1500)
    report, tasks = _check_faults(res, out, faults)
    assert tasks["kernel_table.ceilings"]["rows"][0]["case"].startswith("matmul")
    env = tasks["environment.jax"]["rows"][0]
    cpu_auto = "cpu" if cpu_build.kernels_unavailable() is None else "xla"
    assert env["jax"] and env["devices"] and env["attention"]["auto_decode"]["impl"] == cpu_auto
    checked = [r for k in ("correctness.pallas_gpu", "correctness.triton")
               for r in tasks[k]["rows"] if "skipped" not in r]
    assert {r["dtype"] for r in checked} == {"bfloat16", "float32"}
    assert {r["impl"] for r in checked} == {"pallas_gpu", "triton"}
    assert all(r["ok"] and r["padding_exact_zero"] and not r["nan"] for r in checked)
    assert {r["shape_class"] for r in checked} == {"d64-p16-g2", "d64-p16-g2-window-softcap-fp8"}
    # a smoke run records nothing, and says what a GPU run would
    records = report["sections"]["correctness"]["records"]
    assert records and not any(r["written"] for r in records)
    assert not (out / "verified_kernels.json").exists()
    table = [r for k in ("kernel_table.pallas_gpu", "kernel_table.triton")
             for r in tasks[k]["rows"] if "skipped" not in r]
    assert {r["impl"] for r in table} == {"pallas_gpu", "triton"}
    assert {r["case"] for r in table} >= {"prefill_c64", "decode_4x96", "mixed_c40_plus3"}
    assert all(r["ms"] > 0 and "tflops_of_sheet" in r for r in table)
    assert [r["impl"] for r in tasks["kernel_table.cudnn"]["rows"]] == ["xla"]
    assert {r["impl"] for r in tasks["kernel_table.moe"]["rows"]} == {"ragged_dot", "tiled"}
    alt = tasks["alt_tilings.pallas_gpu"]["rows"]
    assert [r["tiling"] for r in alt if "skipped" not in r] == ["stages2"]
    assert all(r["max_diff_vs_default"] < 3e-2 for r in alt if "skipped" not in r)
    e2e = tasks["end_to_end.e2e"]["rows"]
    assert [r["part"] for r in e2e] == ["throughput", "burst"]
    assert e2e[0]["output_tok_s"] > 0 and e2e[1]["users_with_first_token"] == e2e[1]["users"]
    # what ran, not "auto": the CPU's kernel, nothing unverified
    assert all(r["attention"] == {"configured": "auto", "decode": [cpu_auto],
                                  "prefill": [cpu_auto], "verified": True} for r in e2e)
    assert report["sections"]["gpu_tests"]["counts"]["failed"] == 0


def test_mla_row_records_the_kernel_when_every_case_passed_on_a_gpu(tmp_path, monkeypatch):
    from pallas_kernels import verified

    path = tmp_path / "records.json"
    monkeypatch.setenv("ARCJAX_VERIFIED_KERNELS", str(path))
    spec = next(s for s in gpu_check.plan() if s.key == "kernel_table.mla")
    cls = "d512-r64-p16-g16"

    def rows(*oks, skipped=False):
        out = [dict(case=f"mla_decode_{i}", kind="decode", impl=impl, shape_class=cls, ok=ok,
                    tbps=1.0) for i, ok in enumerate(oks) for impl in ("pallas_gpu", "xla")]
        return out + ([dict(case="late", impl="pallas_gpu", skipped="time budget spent",
                            blocks_record=True)] if skipped else [])

    def close(rows, backend="gpu"):
        report = gpu_report.Report(str(tmp_path / "out"), {})
        report.task("kernel_table", "mla", dict(status="ok", rows=rows, info=dict(
            backend=backend, device_kind="NVIDIA H200")))
        gpu_summary.close_section(_cfg(), report, spec)
        return report.sections["kernel_table"].get("records", [])

    # A failed case, a case skipped for time, or a CPU run: nothing is written.
    assert close(rows(True, False)) == [] and close(rows(True, skipped=True)) == []
    assert close(rows(True), backend="cpu") == [] and not path.exists()
    # Every kernel case passed on the GPU: one record for its shape class, its cases counted
    # (the xla rows beside them are not the kernel's).
    assert [(r["impl"], r["shape_class"], r["cases"]) for r in close(rows(True, True))] == [
        (verified.MLA_KERNEL, cls, 2)]
    written = json.loads(path.read_text())
    assert [(r["impl"], r["shape_class"], r["device_kind"]) for r in written] == [
        (verified.MLA_KERNEL, cls, "NVIDIA H200")]
    assert verified.has_passed(verified.MLA_KERNEL, "NVIDIA H200",
                               verified.ShapeClass.from_key(cls))
    assert not verified.has_passed("pallas_gpu", "NVIDIA H200", verified.ShapeClass.from_key(cls))
