"""What a batch says when it is done: each entry's JSON report, the summary table of a manifest's batch, the table
of a model folder's variants, and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

from ...files import atomic_path, external_data_path
from ...graph.budget import human
from ..report import FINDING_EXIT, OK, REFUSED, UNCHANGED
from .entry import FAILED, Entry, entry_problem


def entry_report(e: Entry) -> dict:
    """The per-model JSON report: the patch report (see PatchReport.to_dict) plus `status` and `error`."""
    base = dict(e.result) if e.result is not None else {
        "version": 1, "model": e.input, "output": e.output, "written": False, "options": e.options}
    base.update({"status": e.status, "error": e.error, "seconds": round(e.seconds, 3)})
    return base


def write_reports(entries: list[Entry]) -> None:
    for e in entries:
        if not e.ran or not e.report:
            continue
        try:
            with atomic_path(e.report, suffix=".json") as tmp:
                tmp.write_text(json.dumps(entry_report(e), indent=2) + "\n")
            e.report_written = True
        except OSError as exc:
            note = f"report {e.report} not written ({exc.strerror or exc})"
            e.error = f"{e.error}; {note}" if e.error else note
            e.status = FAILED


def summary_table(entries: list[Entry], jobs: int, seconds: float) -> str:
    rows = [("#", "status", "time", "rewritten", "refused", "model -> output, or the error")]
    for e in entries:
        s = (e.result or {}).get("summary", {})
        rewritten = s.get("rewritten", 0) + s.get("rewritten_unproven", 0) if s else None
        verified = (e.result or {}).get("verification") or {}
        if e.status == FAILED:
            what = e.error or "failed"
        else:
            what = f"{e.input} -> {e.output if e.result and e.result.get('written') else '(not written)'}"
            if verified.get("identical"):
                what += " (verified)"
        rows.append((str(e.number), e.status, f"{e.seconds:.1f}s" if e.seconds else "-",
                     "-" if rewritten is None else str(rewritten), "-" if not s else str(s.get("refused", 0)), what))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"batch: {len(entries)} model(s), {jobs} job(s), {seconds:.1f} s"]
    lines += [f"  {r[0]:>{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]:>{w[4]}}  {r[5]}" for r in rows]
    counts = {k: sum(e.status == k for e in entries) for k in (OK, UNCHANGED, REFUSED, FAILED)}
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)


def _size(e: Entry) -> str:
    """The written output's size, its external data included (the input's when nothing was written)."""
    path = Path(e.output if e.result and e.result.get("written") else e.input)
    data = external_data_path(path, e.data_files, e.options.get("data_suffix"))
    files = [path, data] if path == Path(e.output) else [path, *e.data_files]
    total = sum(f.stat().st_size for f in files if f.is_file())
    return human(total)


def variant_table(entries: list[Entry], root: str, jobs: int, seconds: float, copies: int) -> str:
    """The `batch DIR OUTDIR` table: one row per variant (the package's docstring)."""
    from ...graph.kernels import INTEGER_8BIT, NO_EXACT_LOWERING, SHIP_FOR_GPU, KernelReport

    rows = [("variant", "status", "size", "deform blocks resident", "no WebGPU kernel (CPU EP)", "verify", "time")]
    for e in entries:
        r = e.result or {}
        k = KernelReport.from_dict(r["webgpu"]) if r.get("webgpu") else None
        if k is None:
            resident = cpu = "-"
        else:
            resident = f"{k.blocks_resident}/{k.blocks}" if k.blocks else "no deform block"
            cpu = f"{k.cpu_nodes}" + (f": {KernelReport.ops_text({**k.inside, **_add(k.inside, k.outside)})}"
                                      if k.cpu_nodes else "")
            if k.jsep_only:
                cpu += f" (JSEP also: {KernelReport.ops_text(k.jsep_only)})"
        v = r.get("verification")
        verify = ("-" if e.status == FAILED else "(copy)" if e.status == UNCHANGED else
                  "not run" if v is None else "PASSED" if v.get("identical") else "FAILED")
        rows.append((str(Path(e.input).relative_to(root)), e.status, _size(e) if e.status != FAILED else "-",
                     resident, cpu, verify, f"{e.seconds:.1f}s" if e.seconds else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"batch {root}: {len(entries)} model(s), {copies} other file(s) copied unchanged, {jobs} job(s), "
             f"{seconds:.1f} s"]
    lines += ["  " + "  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r)).rstrip() for r in rows]
    lines += [f"  {e.input}: {entry_problem(e)}" for e in entries if e.error]
    eight_bit = [str(Path(e.input).relative_to(root)) for e in entries if (e.result or {}).get("webgpu")
                 and KernelReport.from_dict(e.result["webgpu"]).integer_8bit()[0]]
    if eight_bit:
        lines.append(f"  8-bit file(s) {', '.join(eight_bit)}: their {'/'.join(INTEGER_8BIT)} nodes stay on the CPU "
                     f"EP: {NO_EXACT_LOWERING}; {SHIP_FOR_GPU}")
    counts = {k: sum(e.status == k for e in entries) for k in (OK, UNCHANGED, REFUSED, FAILED)}
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in b}


def exit_code(entries: list[Entry]) -> int:
    if any(e.status == FAILED for e in entries):
        return 1
    if any(e.status == REFUSED for e in entries):
        return FINDING_EXIT
    return 0
