#!/usr/bin/env python
"""Does `model_io.FastGraph` still pay? CPU time of patch's lift (load, check, fold, region, passes, export) on a
model, with FastGraph's cleanup/toposort and with onnx-graphsurgeon's own, alternating runs in one process.

    .venv/bin/python scripts/bench_fastgraph.py MODEL.onnx [--runs 5]

CPU time (`time.process_time`) rather than wall time, so that other work on the machine moves both sides alike.
Prints each run, the medians and their ratio (gs / FastGraph); FastGraph is worth keeping while the ratio is well
above the run-to-run spread. It measures; it does not gate.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import onnx_graphsurgeon as gs

from deform_surgeon import model_io, surgeon
from deform_surgeon.passes.split import SplitPlan
from deform_surgeon.pipeline import Options


def _gs_graph(model, weights):
    graph = model_io.import_graph(model, weights)
    graph.__class__ = gs.Graph  # undo FastGraph: gs's own cleanup() and toposort()
    return graph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=5, help="runs of each side (default 5)")
    args = ap.parse_args()
    seconds: dict[str, list[float]] = {"FastGraph": [], "gs.Graph": []}
    for k in range(2 * args.runs):
        side = "FastGraph" if k % 2 == 0 else "gs.Graph"
        surgeon.import_graph = model_io.import_graph if side == "FastGraph" else _gs_graph
        gc.collect()
        t0 = time.process_time()
        lifted = surgeon._run(args.model, Options(), SplitPlan())
        lifted.patched()
        seconds[side].append(time.process_time() - t0)
        print(f"{side:<9} {seconds[side][-1]:6.2f} s CPU  (region of {len(lifted.graph.nodes)} nodes)", flush=True)
    fast, plain = (statistics.median(seconds[s]) for s in ("FastGraph", "gs.Graph"))
    spread = max(max(v) - min(v) for v in seconds.values())
    print(f"median: FastGraph {fast:.2f} s, gs.Graph {plain:.2f} s; ratio {plain / fast:.2f}x; "
          f"largest run-to-run spread {spread:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
