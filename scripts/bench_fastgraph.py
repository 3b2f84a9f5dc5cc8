#!/usr/bin/env python
"""Does `model_io.tidy` still pay? CPU time of patch's lift (load, check, fold, region, passes, export) on a
model, with tidy's linear-time cleanup/toposort and with onnx-graphsurgeon's own, alternating runs in one process.

    .venv/bin/python scripts/bench_fastgraph.py MODEL.onnx [--runs 5]

CPU time (`time.process_time`) rather than wall time, so that other work on the machine moves both sides alike.
Prints each run, the medians and their ratio (gs / tidy); tidy is worth keeping while the ratio is well
above the run-to-run spread. It measures; it does not gate.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import onnx_graphsurgeon as gs

from deform_surgeon import files as model_io
from deform_surgeon.commands.patch import PatchRun
from deform_surgeon.commands.patching import lift
from deform_surgeon.graph import pipeline
from deform_surgeon.graph.pipeline import Options


def _gs_tidy(graph: gs.Graph) -> gs.Graph:
    return graph.cleanup().toposort()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=5, help="runs of each side (default 5)")
    args = ap.parse_args()
    seconds: dict[str, list[float]] = {"tidy": [], "gs.Graph": []}
    for k in range(2 * args.runs):
        side = "tidy" if k % 2 == 0 else "gs.Graph"
        pipeline.tidy = lift.tidy = model_io.tidy if side == "tidy" else _gs_tidy
        gc.collect()
        t0 = time.process_time()
        lifted = PatchRun(args.model, Options()).lift_once()
        lifted.patched()
        seconds[side].append(time.process_time() - t0)
        print(f"{side:<8} {seconds[side][-1]:6.2f} s CPU  (region of {len(lifted.graph.nodes)} nodes)", flush=True)
    fast, plain = (statistics.median(seconds[s]) for s in ("tidy", "gs.Graph"))
    spread = max(max(v) - min(v) for v in seconds.values())
    print(f"median: tidy {fast:.2f} s, gs.Graph {plain:.2f} s; ratio {plain / fast:.2f}x; "
          f"largest run-to-run spread {spread:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
