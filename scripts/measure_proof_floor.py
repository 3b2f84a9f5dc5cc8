"""What one ORT CPU run of one Conv costs at its real shape: the floor under any proof that runs that Conv whole.

A rewrite of a Conv (row bands, a split deform block's chunks) is shown exact by running the whole Conv and the
rewritten one on ORT CPU at the levels a user's ORT runs, `disable` and `all`, on the real shapes (docs/fitting.md).
The whole Conv's run is the floor of that proof's memory, whatever the proof around it. This prints, for one Conv
(by default the largest of BiRefNet-lite at 2048, HR's size: `decoder_block1`'s 7x7 deform block, 64 -> 256
channels, 7x7 stride 7, reading its 3584x3584 gathers), the peak RSS of a fresh process that makes the Conv's
input and runs the Conv once:

- `disable`: the Conv as it is (MLAS's SGEMM on the plain input);
- `all`: what ORT makes of it at level `all` (its NCHWc Conv, after a copy of the input into the NCHWc layout);
- `all, fed in NCHWc`: ORT's own level-`all` graph with that copy cut off, the input given in the NCHWc layout
  (the least a level-`all` run of the Conv can hold: the input once, and the output);

each against a target (`--target`, default 4 GB: issue 39's for HR's size) in the same run.

    .venv/bin/python scripts/measure_proof_floor.py
    .venv/bin/python scripts/measure_proof_floor.py --shape 1,64,1792,1792 --out-channels 256 --kernel 7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("disable", "all", "all, fed in NCHWc")


def _child(mode: str, shape: list[int], out_channels: int, kernel: int, folder: str) -> dict:
    import re

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    h = shape[2] // kernel
    w = numpy_helper.from_array(np.random.default_rng(0).random((out_channels, shape[1], kernel, kernel),
                                                                dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kernel, kernel], strides=[kernel, kernel])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [shape[0], out_channels, h, shape[3] // kernel])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    feed = "x"
    if mode == "disable":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    else:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if mode == "all, fed in NCHWc":  # ORT's own level-all graph, run as it is, without its input's reorder
        options.optimized_model_filepath = f"{folder}/all.onnx"
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        model = onnx.load(options.optimized_model_filepath)
        reorder = next(n for n in model.graph.node if n.op_type == "ReorderInput")
        model.graph.node.remove(reorder)
        feed = reorder.output[0]
        model.graph.input[0].name = feed
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).random(shape, dtype=np.float32)  # (its values do not change what is held)
    session.run(None, {feed: x})
    status = Path("/proc/self/status").read_text()
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1000
    return {"peak": peak, "input": x.nbytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,64,3584,3584", help="the Conv's input shape (N,C,H,W)")
    parser.add_argument("--out-channels", type=int, default=256)
    parser.add_argument("--kernel", type=int, default=7, help="kernel size, the same as its stride")
    parser.add_argument("--target", type=float, default=4.0, help="GB (1e9 bytes)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = [int(v) for v in args.shape.split(",")]
    if args.child:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(_child(args.child, shape, args.out_channels, args.kernel, folder)))
        return 0
    print(f"Conv {shape} -> {args.out_channels} channels, {args.kernel}x{args.kernel} stride {args.kernel}: "
          f"one ORT CPU run in a fresh process, peak RSS against {args.target:.2f} GB")
    for mode in MODES:
        run = subprocess.run([sys.executable, __file__, "--child", mode, "--shape", args.shape, "--out-channels",
                              str(args.out_channels), "--kernel", str(args.kernel)],
                             capture_output=True, text=True, check=True)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"  {mode:<18} {got['peak'] / 1e9:6.2f} GB  ({got['peak'] / 1e9 / args.target:.2f}x the target; the "
              f"input alone {got['input'] / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
