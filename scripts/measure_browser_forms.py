"""Every given model in headless Chromium, as a page loads it: session creation (and optionally one run) on each
onnxruntime-web bundle, with the placement, what is over the device profile and Chromium's peak memory by process.
Prints one Markdown row per (model, bundle): the table of docs/real-exports.md ("In a browser page").

Usage:
    python scripts/measure_browser_forms.py LABEL=MODEL [LABEL=MODEL ...] [--bundles webgpu jsep]
        [--run LABEL ...] [--timeout 3600] [--device-profile spec-default] [--json OUT.json]

MODEL is a .onnx file (its external data beside it, found by `placement`), or with `--bundles transformers` a
model folder. Each session is the machine's only browser; run it niced beside other work and read the times as
the software adapter's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import onnx

from deform_surgeon.checks.verdict import combine, judge_outputs
from deform_surgeon.webgpu.placement.runner import ModelFolder, external_data_files, measure_placement


def _size(model: Path) -> str:
    """The model's files as a page fetches them: one file, or the model and its external data."""
    data = external_data_files(onnx.load(model, load_external_data=False))
    mib = [os.path.getsize(model) / 2**20] + [os.path.getsize(model.parent / d) / 2**20 for d in data]
    return f"{mib[0]:,.0f} MiB" if len(mib) == 1 else f"{mib[0]:,.0f} + {sum(mib[1:]):,.0f} MiB (external data)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", metavar="LABEL=MODEL")
    ap.add_argument("--bundles", nargs="+", default=["webgpu", "jsep"])
    ap.add_argument("--run", nargs="*", default=[], metavar="LABEL", help="also run these once")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--device-profile", default="spec-default")
    ap.add_argument("--json", metavar="OUT.json")
    args = ap.parse_args()
    rows, records = [], []
    print("| model | files | bundle | session | CPU / Memcpy | over spec-default | run vs ORT CPU | peak RSS renderer "
          "/ GPU process |\n| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for item in args.models:
        label, _, path = item.partition("=")
        for bundle in args.bundles:
            model = ModelFolder.of(path).model if bundle == "transformers" else Path(path)
            p = measure_placement(path, runtime="browser", bundle=bundle, run=label in args.run,
                                  timeout=args.timeout, profile=args.device_profile)
            t = p.timings.get("session_create_s")
            session = (f"ok, {t:.0f} s" if p.session_ok else f"FAILED after {t or 0:.0f} s: "
                       f"{(p.error or '').splitlines()[0][:90]}")
            counts = f"{p.cpu_nodes} / {p.memcpy}" if p.placement_logged else "-"
            over = str(len(p.limit_violations)) if p.limit_violations else "none"
            run = "-"
            if p.run is not None:
                verdict = combine(judge_outputs(p.run.get("outputs") or {}, same_runtime=False).values())
                run = (f"{verdict.text if verdict else '?'}, {p.timings.get('run_s', 0):.0f} s"
                       if p.run.get("ok") else f"FAILED: {(p.run.get('error') or '')[:80]}")
            mem = p.peak_rss_mib
            renderer = mem.get("renderer", 0) + mem.get("zygote", 0)  # a renderer not yet renamed counts as zygote
            memory = f"{renderer / 1024:.1f} / {mem.get('gpu-process', 0) / 1024:.1f} GiB" if mem else "-"
            row = f"| {label} | {_size(model)} | {bundle} | {session} | {counts} | {over} | {run} | {memory} |"
            print(row, flush=True)
            rows.append(row)
            records.append({"label": label, "bundle": bundle, **p.to_dict()})
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
