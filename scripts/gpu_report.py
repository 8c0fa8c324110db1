"""The report of `scripts/gpu_check.py`: sections of task results, written to
`gpu_check.json` and `gpu_check.md` after every change, and the closing summary table.

A section holds its tasks' results (`TaskResult.as_dict`: status, seconds, rows, error);
kernel rows gain their fractions of the ceilings measured in the same run and of the
data sheet (`with_fractions`). No JAX here: the parent process never initialises a device.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET

from gpu_bench import DATASHEET

TARGETS = dict(prefill_tflops=430.0, decode_bw_fraction=0.8)  # issue 16, H200
# A GPU test may skip on the device only for a package it lacks, named in the reason.
MISSING_PACKAGE = re.compile(r"not installed|No module named|could not import|pip install")


class Report:
    """Sections as they change, rewritten to JSON and markdown each time."""

    def __init__(self, out: str, config: dict):
        self.out, self.config, self.start = out, config, time.monotonic()
        self.sections: dict[str, dict] = {}
        self.summary: list[str] = []
        os.makedirs(out, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def task(self, section: str, name: str, result: dict) -> None:
        sec = self.sections.setdefault(section, dict(tasks={}))
        sec["tasks"][name] = result
        sec["seconds"] = round(self.elapsed(), 1)
        self.write()

    def set(self, section: str, **fields) -> None:
        self.sections.setdefault(section, dict(tasks={})).update(fields)
        self.write()

    def rows(self, section: str, name: str) -> list[dict]:
        return self.sections.get(section, {}).get("tasks", {}).get(name, {}).get("rows", [])

    def write(self) -> None:
        body = dict(config=self.config, elapsed_s=round(self.elapsed(), 1),
                    sections=self.sections, summary=self.summary)
        for name, text in (("gpu_check.json", json.dumps(body, indent=1, default=str)),
                           ("gpu_check.md", to_markdown(self.sections, self.summary))):
            tmp = os.path.join(self.out, f".{name}.tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(self.out, name))


def ceilings(report: Report) -> dict:
    """{"tflops", "tbps"} measured in this run (missing if the task did not measure them)."""
    out = {}
    for row in report.rows("kernel_table", "ceilings"):
        for key in ("tflops", "tbps"):
            if key in row:
                out[key] = row[key]
    return out


def with_fractions(rows: list[dict], measured: dict) -> list[dict]:
    """Kernel rows with their TFLOP/s and TB/s as fractions of the measured ceilings and
    the data sheet, and whether they meet the targets."""
    out = []
    for row in rows:
        row = dict(row)
        for key in ("tflops", "tbps"):
            if key in row:
                row[f"{key}_of_sheet"] = row[key] / DATASHEET[key]
                if key in measured:
                    row[f"{key}_of_measured"] = row[key] / measured[key]
        if row.get("kind") == "prefill" and "tflops" in row:
            row["meets_target"] = row["tflops"] >= TARGETS["prefill_tflops"]
        elif row.get("kind") == "decode" and "tbps" in row and "tbps" in measured:
            row["meets_target"] = row["tbps"] >= TARGETS["decode_bw_fraction"] * measured["tbps"]
        out.append(row)
    return out


def junit_counts(path: str) -> dict:
    """{"passed", "failed", "error", "skipped", "skips": [(test, reason)]} of a junit file."""
    counts = dict(passed=0, failed=0, error=0, skipped=0, skips=[])
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
        elif "error" in kinds:
            counts["error"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            counts["skips"].append((name, kinds["skipped"].get("message", "")))
        else:
            counts["passed"] += 1
    return counts


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_cell(x)}" for k, x in v.items())
    return str(v).replace("|", "/").replace("\n", " ")[:160]


def table(rows: list[dict], keys: list[str]) -> str:
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


COLUMNS = {
    "environment": ["jax", "jaxlib", "backend", "device_kind", "memory", "attention",
                    "warnings"],
    "correctness": ["impl", "case", "shape_class", "dtype", "max_rel_err", "tolerance", "nan",
                    "padding_exact_zero", "ok", "seconds", "error", "skipped"],
    "kernel_table": ["impl", "case", "tiling", "ms", "ms_synced", "tflops", "tflops_of_measured",
                     "tflops_of_sheet", "tbps", "tbps_of_measured", "tbps_of_sheet",
                     "meets_target", "rows", "block_k", "num_splits", "num_stages", "error",
                     "skipped"],
    "end_to_end": ["part", "arm", "requests", "users", "warmup_s", "wall_s", "window_s",
                   "prefill_tok_s", "output_tok_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
                   "users_first_token_within_2s", "max_stall_s", "attention", "error",
                   "skipped"],
}
COLUMNS["alt_tilings"] = COLUMNS["kernel_table"] + ["max_diff_vs_default"]


def to_markdown(sections: dict[str, dict], summary: list[str]) -> str:
    out = ["# gpu_check", ""]
    if summary:
        out += ["```", *summary, "```", ""]
    for name, sec in sections.items():
        out += [f"## {name}: {'ok' if sec.get('ok', True) else 'FAILED'} "
                f"(at {sec.get('seconds', 0)} s)", ""]
        for key in ("host", "records", "command", "counts"):
            if key in sec:
                out += [f"- {key}: `{_cell(sec[key])}`"]
        for task, res in sec.get("tasks", {}).items():
            out += [f"- {task}: {res.get('status')} in {res.get('seconds', 0)} s "
                    f"(allotted {res.get('allotted_s', '-')} s)"
                    + (f": {_cell(res['error'])}" if res.get("error") else "")]
        rows = [r for res in sec.get("tasks", {}).values() for r in res.get("rows", [])]
        if rows:
            out += ["", table(rows, COLUMNS.get(name, sorted({k for r in rows for k in r})))]
        out += [""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """`python scripts/gpu_report.py JUNIT_XML SKIP_REASON_REGEX`: exit 0 when the tests
    passed, none failed or errored, and every skip's reason matches the regex (what
    scripts/gpu_preflight.sh allows on the CPU: "needs an NVIDIA GPU")."""
    if len(argv) != 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    counts = junit_counts(argv[1])
    bad = [s for s in counts["skips"] if not re.search(argv[2], s[1])]
    for test, reason in bad:
        print(f"skipped for another reason than {argv[2]!r}: {test}: {reason}")
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped")
    return 1 if bad or counts["failed"] or counts["error"] or not counts["passed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
