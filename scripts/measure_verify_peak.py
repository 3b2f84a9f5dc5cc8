"""Peak memory of `verify` against its floor, one ORT CPU inference of the larger of the two models, measured in the
same run (so the ratio compares across machines and loads).

    python scripts/measure_verify_peak.py [ORIGINAL [PATCHED]] [--iterations 1]

Without PATCHED the original is patched first (into a temporary folder); without ORIGINAL the 1024x1024 fixture is
used. Each measurement is a fresh interpreter, so no run inherits another's memory:
- `base`: the interpreter with onnxruntime, numpy and polygraphy imported, nothing run;
- `floor A` / `floor B`: one ORT CPU session of that model, created and run once on seeded inputs of its own shapes
  (floats in [0, 1), integers in [0, 8]), as `verify` runs it;
- `verify`: `deform_surgeon.verify(ORIGINAL, PATCHED)`, its process's peak RSS and its children's (a run in a forked
  child is counted there), and the peak the result reports.
Printed: each peak RSS, and verify / max(floor A, floor B), also with the base taken off both. Why a script and not a
test: a peak depends on the machine and its load; a timed or sized unit test would fail on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "decoder_gathernd_1024.onnx"

_PEAK = """
import json, resource
def peak():
    s = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    c = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"self": s, "children": c, "max": max(s, c)}
"""

_IMPORTS = """
import numpy, onnx, onnxruntime, polygraphy.backend.onnxrt, polygraphy.comparator  # noqa: F401
import deform_surgeon.checks.verify  # noqa: F401  (what verify's process holds before it runs anything)
"""

_BASE = _PEAK + _IMPORTS + """
print(json.dumps(peak()))
"""

_FLOOR = _PEAK + _IMPORTS + """
import sys
import numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
rng = np.random.default_rng(1)
feeds = {}
for i in session.get_inputs():
    shape = [d if isinstance(d, int) else 1 for d in i.shape]
    dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32}[i.type]
    feeds[i.name] = (rng.random(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                     else rng.integers(0, 9, shape).astype(dtype))
session.run(None, feeds)
print(json.dumps(peak()))
"""

_VERIFY = _PEAK + """
import sys
import deform_surgeon as ds
r = ds.verify(sys.argv[1], sys.argv[2], iterations=int(sys.argv[3]))
print(json.dumps({**peak(), "identical": r.identical, "reported": getattr(r, "peak_rss", None)}))
"""


def _run(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _large_activations(path: str) -> None:
    """x [1, 8, 256, 256] -> Resize x4 -> Conv 8->32 3x3 -> Relu -> Conv 32->8 3x3 -> ReduceMean: tensors of 32 and
    128 MiB, a peak of live activations of about 300 MiB against 4 MiB of output."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "scales"),
             numpy_helper.from_array(rng.standard_normal((32, 8, 3, 3)).astype(np.float32) * 0.1, "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 32, 3, 3)).astype(np.float32) * 0.1, "w2")]
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["up"], mode="nearest"),
             helper.make_node("Conv", ["up", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c2"], ["y"], axes=[1], keepdims=1)]
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 256, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1024, 1024])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("original", nargs="?", default=str(FIXTURE))
    parser.add_argument("patched", nargs="?", default=None)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--synthetic", action="store_true",
                        help="instead of ORIGINAL: a model of large activations (Resize to 1024x1024, Convs of 32 "
                             "channels: 128 MiB tensors), compared with a copy of itself")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        patched = args.patched
        if args.synthetic:
            args.original, patched = str(Path(tmp) / "large.onnx"), str(Path(tmp) / "large.copy.onnx")
            _large_activations(args.original)
            Path(patched).write_bytes(Path(args.original).read_bytes())
        elif patched is None:
            import deform_surgeon as ds

            patched = str(Path(tmp) / "patched.onnx")
            ds.patch(args.original, patched)
        base = _run(_BASE)["max"]
        floors = [_run(_FLOOR, path)["max"] for path in (args.original, patched)]
        measured = _run(_VERIFY, args.original, patched, str(args.iterations))
    floor = max(floors)
    print(f"base (imports only)     {_gb(base)}")
    print(f"floor A (original, 1x)  {_gb(floors[0])}")
    print(f"floor B (patched, 1x)   {_gb(floors[1])}")
    print(f"verify                  {_gb(measured['max'])} (process {_gb(measured['self'])}, children "
          f"{_gb(measured['children'])}; identical: {measured['identical']}; reported: {measured['reported']})")
    print(f"verify / floor          {measured['max'] / floor:.2f}x; above the base: "
          f"{(measured['max'] - base) / max(floor - base, 1):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
