"""One model on ORT CPU at level disable, whole and in segments (`verify --segment-memory`'s way), on the same seeded
input: are the outputs the same bytes? Prints the segment count and each output's verdict; exit 1 if any differs.

    python scripts/segments_vs_whole.py MODEL.onnx [--segment-memory 300MB] [--seed 0]

For a model the machine can run whole (the real BiRefNet-lite 512 export: byte-identical in 50 segments of at most
300 MB, docs/verify.md); `tests/checks/test_run_in_segments.py` asks the same of the replicas.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import onnxruntime as ort

from deform_surgeon.checks.run_in_segments import run_in_segments, segment_graph
from deform_surgeon.graph.budget import parse_size


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--segment-memory", default="300MB")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = segment_graph(args.model)
    rng = np.random.default_rng(args.seed)
    feed = {}
    for vi in g.model.graph.input:
        if vi.name in g.graph_inputs:
            dims = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
            feed[vi.name] = rng.random(dims, dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="segments-vs-whole-") as folder:
        saved, count, disk = run_in_segments(g, [feed], parse_size(args.segment_memory), folder, session)
        pieces = {name: np.load(file) for name, file in saved[0]}
    whole = dict(zip([o.name for o in session(args.model).get_outputs()], session(args.model).run(None, feed),
                     strict=True))
    print(f"{args.model}: {count} segments of at most {args.segment_memory} of tensors, {disk / 1e9:.2f} GB on disk "
          "between them at most")
    same = True
    for name, a in whole.items():
        b = pieces[name]
        equal = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        same &= equal
        print(f"  {name}: {'byte-identical' if equal else 'DIFFERS'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
