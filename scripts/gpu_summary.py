"""What `scripts/gpu_check.py` concludes from its tasks: whether each section passed, the
GPU passes it records (`pallas_kernels.verified`), and the closing summary table.

No JAX is initialised here (the records module imports jax, which touches no device).
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING

import gpu_report

if TYPE_CHECKING:
    from gpu_check import CheckConfig, TaskSpec


def task_ok(cfg: CheckConfig, section: str, result: dict) -> bool:
    """Whether one task's result counts as a pass of its section."""
    status, rows = result["status"], result.get("rows", [])
    if status == "skipped":  # for time, or a package the device lacks (GPU tests)
        return section == "alt_tilings" or result.get("missing_package", False)
    if status != "ok":
        return False
    if section == "environment":
        return cfg.cpu_smoke or bool(rows) and rows[0].get("backend") == "gpu"
    if section == "correctness":
        # on the GPU an implementation that could not run at all is a check not made
        unrun = [r for r in rows if r.get("blocks_record")]
        return (cfg.cpu_smoke or not unrun) and all(
            r.get("ok") for r in rows if "skipped" not in r)
    if section == "end_to_end":
        return len(rows) == 2 and not any("skipped" in r or "error" in r for r in rows)
    return not any("error" in r for r in rows)


def environment_ok(cfg: CheckConfig, report: gpu_report.Report) -> bool:
    """False only when the JAX probe ran and saw no GPU (off --cpu_smoke)."""
    rows = report.rows("environment", "jax")
    return cfg.cpu_smoke or not rows or rows[0].get("backend") == "gpu"


def passes(rows: list[dict]) -> dict[str, int] | None:
    """Shape class -> cases passed, when every case the implementation takes ran and
    passed (None otherwise: nothing may be recorded)."""
    ran = [r for r in rows if "skipped" not in r]
    if not ran or any(r.get("blocks_record") for r in rows) or not all(r.get("ok") for r in ran):
        return None
    return dict(collections.Counter(r["shape_class"] for r in ran))


def record(cfg: CheckConfig, report: gpu_report.Report, impl: str, result: dict) -> None:
    """Records the GPU passes of one implementation's finished correctness task."""
    found = passes(result.get("rows", [])) if result["status"] == "ok" else None
    sec = report.sections["correctness"]
    records = sec.setdefault("records", [])
    if found is None:
        return
    if cfg.cpu_smoke:  # never recorded off the GPU: say what a GPU run would record
        records += [dict(impl=impl, shape_class=k, cases=n, written=False)
                    for k, n in sorted(found.items())]
        return
    from pallas_kernels import verified

    kind = result.get("info", {}).get("device_kind")
    if result.get("info", {}).get("backend") != "gpu" or not kind:
        return
    try:
        entries = verified.record_pass(impl, kind, {verified.ShapeClass.from_key(k): n
                                                    for k, n in found.items()})
    except verified.RecordPathError as e:
        sec["records_error"] = str(e)
        return
    records += [dict(impl=impl, shape_class=e["shape_class"], cases=e["cases"], written=True,
                     path=verified.local_path()) for e in entries]


def close_section(cfg: CheckConfig, report: gpu_report.Report, spec: TaskSpec) -> None:
    """After a task: its rows' fractions of the ceilings, records, the section's ok."""
    sec = report.sections[spec.section]
    result = sec["tasks"][spec.name]
    if spec.section in ("kernel_table", "alt_tilings") and spec.name != "ceilings":
        result["rows"] = gpu_report.with_fractions(result.get("rows", []),
                                                   gpu_report.ceilings(report))
    if spec.section == "correctness":
        record(cfg, report, spec.name, result)
    result["ok"] = task_ok(cfg, spec.section, result)
    sec["ok"] = all(t.get("ok", False) for t in sec["tasks"].values())
    report.write()


# --- the closing table ----------------------------------------------------------------------

def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _best(rows: list[dict], kind: str, key: str) -> dict | None:
    rows = [r for r in rows if r.get("kind") == kind and key in r]
    return max(rows, key=lambda r: r[key]) if rows else None


def _pct(row: dict, key: str) -> str:
    measured, sheet = row.get(f"{key}_of_measured"), row.get(f"{key}_of_sheet")
    parts = ([f"{measured:.0%} of measured"] if measured is not None else []) + (
        [f"{sheet:.0%} of sheet"] if sheet is not None else [])
    return f" ({', '.join(parts)})" if parts else ""


def figures(section: str, name: str, result: dict) -> str:
    rows = result.get("rows", [])
    if rows and all(r.get("rehearsal") for r in rows):
        return f"{len(rows)} placeholder rows"
    if section == "environment" and rows:
        r = rows[0]
        mem = r.get("memory", {})
        free = (f", {(mem['bytes_limit'] - mem.get('bytes_in_use', 0)) / 2**30:.1f} GiB free"
                if isinstance(mem, dict) and "bytes_limit" in mem else "")
        auto = r.get("attention", {})
        return (f"{r.get('device_kind')}, jax {r.get('jax')}{free}; auto: mixed "
                f"{auto.get('auto_mixed', {}).get('impl')}, decode "
                f"{auto.get('auto_decode', {}).get('impl')}")
    skips = sorted({r["skipped"] for r in rows if "skipped" in r})
    if rows and len(skips) == len(rows) or rows and all("skipped" in r for r in rows):
        return f"nothing ran: {skips[0]}" + (f" (+{len(skips) - 1} more)" if len(skips) > 1
                                              else "")
    if section == "correctness":
        ran = [r for r in rows if "skipped" not in r and "ok" in r]
        errs = [r["max_rel_err"] for r in ran if "max_rel_err" in r]
        worst = f", max rel err {max(errs):.2g}" if errs else ""
        return f"{sum(r['ok'] for r in ran)}/{len(ran)} cases passed{worst}"
    if name == "ceilings":
        parts = [f"matmul {_num(r['tflops'])} TFLOP/s" for r in rows if "tflops" in r]
        parts += [f"copy {_num(r['tbps'])} TB/s" for r in rows if "tbps" in r]
        return ", ".join(parts)
    if section in ("kernel_table", "alt_tilings"):
        parts = []
        for kind, key, unit in (("prefill", "tflops", "TFLOP/s"), ("decode", "tbps", "TB/s")):
            best = _best(rows, kind, key)
            if best is not None:
                parts.append(f"{best['case']} {_num(best[key])} {unit}{_pct(best, key)}")
        if name == "invariance":
            ran = [r for r in rows if "bitwise" in r]
            parts = [f"{sum(r['bitwise'] for r in ran)}/{len(ran)} bitwise"] if ran else []
        if name == "moe":
            parts = [f"{r['impl']} t{r['tokens']} {_num(r['tflops'])} TFLOP/s"
                     for r in rows if "tflops" in r]
        if name == "w4a16":  # the kernel's rows (xla and bf16 beside them in the table)
            parts = [f"{r['shape']} {r['zero']} {_num(r['tbps'])} TB/s{_pct(r, 'tbps')}"
                     for r in rows if r.get("impl") == "w4a16" and "tbps" in r]
        if name == "mla":  # the kernel's rows (xla's beside them in the table)
            parts = [f"{r['seqs']}x{r['context']} {_num(r['tbps'])} TB/s{_pct(r, 'tbps')}"
                     for r in rows if r.get("impl") == "pallas_gpu" and "tbps" in r]
        return "; ".join(parts)
    if section == "end_to_end":
        parts = []
        for r in rows:
            att = r.get("attention", {})
            ran = (f" [{'/'.join(att.get('prefill', []))} prefill, "
                   f"{'/'.join(att.get('decode', []))} decode, verified "
                   f"{att.get('verified')}]" if att else "")
            if r.get("part") == "throughput" and "output_tok_s" in r:
                parts.append(f"throughput {r['output_tok_s']:.0f} out tok/s{ran}")
            elif r.get("part") == "burst" and "ttft_p50_s" in r:
                parts.append(f"burst TTFT p50 {r['ttft_p50_s']:.2f} s, "
                             f"{r['users_first_token_within_2s']}/{r['users']} within 2 s{ran}")
            elif "skipped" in r:
                parts.append(f"{r.get('part')}: {r['skipped']}")
        return "; ".join(parts)
    return ""


def finish(cfg: CheckConfig, report: gpu_report.Report) -> bool:
    """Prints the summary table (the run's last lines) and writes it; True if all passed."""
    mode = ("cpu smoke rehearsal: placeholder tasks" if cfg.rehearsal
            else "cpu smoke" if cfg.cpu_smoke else "GPU")
    lines = [f"gpu_check summary ({mode}): "
             f"{report.elapsed():.0f} s of the {cfg.budget_s:.0f} s budget",
             f"{'task':26s} {'status':9s} {'secs':>6s}  figures"]
    for section, sec in report.sections.items():
        for name, res in sec.get("tasks", {}).items():
            status = res["status"] if res.get("ok") or res["status"] != "ok" else "FAILED"
            text = figures(section, name, res) or (res.get("error") or "")
            if res.get("error") and text != res["error"]:
                text = f"{text}; {res['error']}" if text else res["error"]
            lines.append(f"{section + '.' + name:26s} {status:9s} "
                         f"{res.get('seconds', 0):6.0f}  {text}"[:240])
    records = report.sections.get("correctness", {}).get("records", [])
    written = [r for r in records if r["written"]]
    lines.append(f"verified records: {len(written)} written"
                 + (f" to {written[0]['path']}" if written else "")
                 + "".join(f"; {r['impl']} {r['shape_class']}" for r in written))
    ok = all(sec.get("ok", False) for sec in report.sections.values())
    lines.append("ALL SECTIONS OK" if ok else "SOME SECTIONS FAILED: " + ", ".join(
        name for name, sec in report.sections.items() if not sec.get("ok", False)))
    report.summary = lines
    report.write()
    print(f"wrote {os.path.join(cfg.out, 'gpu_check.json')} and gpu_check.md", flush=True)
    print("\n".join(lines), flush=True)
    return ok
