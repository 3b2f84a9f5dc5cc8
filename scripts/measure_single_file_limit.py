#!/usr/bin/env python
"""Measure the model size above which onnxruntime-web (headless Chromium) cannot create a session from a
single-file ONNX model (weights embedded in the protobuf), and whether external data avoids the limit.

For every size S (MiB) it builds a synthetic model whose float32 initializers total S MiB, in tensors of
--tensor-mb each ([rows, 1024] tables, each read by a Gather with a tiny index input and summed by Adds, so
that session creation, not compute, is what is measured), saved as one .onnx file ("single") and/or as a small
.onnx beside one NAME.onnx_data file ("external"). Then it runs
`deform-surgeon placement MODEL --runtime browser --bundle B` on each and prints a table of the outcome,
the session-creation time, the largest resident memory of one browser process, and the runtime's error.

    nice -n 10 .venv/bin/python scripts/measure_single_file_limit.py --sizes 256,512,768 \
        [--forms single,external] [--bundles webgpu,jsep] [--tensor-mb 32] [--workdir /tmp/sizelimit] \
        [--timeout 300] [--keep]

Single files must stay below protobuf's 2 GB limit. Models are deleted after each measurement unless --keep.
Nothing in these models is constant-folded, so this measures the bare cost of embedded weights (about twice
the file in the 4 GiB wasm heap); a real model whose folded constants grow at session creation fails
earlier (docs/browser-loading.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

COLS = 1024  # floats per row: 4 KiB rows
SURGEON = Path(sys.executable).with_name("deform-surgeon")


def build(path: Path, size_mb: float, tensor_mb: float, external: bool) -> int:
    """Writes the model to `path` (weights in `path`.name + '_data' if `external`); returns the tensor count."""
    rows_total = round(size_mb * 2**20 / (4 * COLS))
    rows_each = max(1, round(tensor_mb * 2**20 / (4 * COLS)))
    sizes = [rows_each] * (rows_total // rows_each) + ([rows_total % rows_each] if rows_total % rows_each else [])
    data_name = path.name + "_data"
    inits, nodes, offset = [], [], 0
    with open(path.with_name(data_name), "wb") if external else open(os.devnull, "wb") as data:
        for i, rows in enumerate(sizes):
            raw = np.full(rows * COLS, (i + 1) * 1e-3, np.float32).tobytes()
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[rows, COLS])
            if external:
                data.write(raw)
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                    t.external_data.add(key=k, value=v)
                offset += len(raw)
            else:
                t.raw_data = raw
            inits.append(t)
            nodes.append(helper.make_node("Gather", [f"w{i}", "idx"], [f"g{i}"], axis=0))
            if i:
                nodes.append(helper.make_node("Add", [f"s{i - 1}" if i > 1 else "g0", f"g{i}"], [f"s{i}"]))
    out = f"s{len(sizes) - 1}" if len(sizes) > 1 else "g0"
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(nodes, "sizelimit", [helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, COLS])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(model.SerializeToString())
    return len(sizes)


def _rss_mb(root: int) -> float:
    """Largest resident set (MiB) of one process among `root`'s descendants (the Chromium renderer, in practice)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            status = (d / "status").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
        rss[int(d.name)] = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    todo, best = [root], 0
    while todo:
        p = todo.pop()
        best = max(best, rss.get(p, 0))
        todo += children.get(p, [])
    return best / 1024


def measure(model: Path, bundle: str, timeout: float) -> dict:
    out = model.with_suffix(f".{bundle}.json")
    cmd = [str(SURGEON), "placement", str(model), "--runtime", "browser", "--bundle", bundle,
           "--timeout", str(timeout), "--json", str(out)]
    t0, peak = time.monotonic(), 0.0
    with open(model.with_suffix(f".{bundle}.stderr"), "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        while proc.poll() is None:
            peak = max(peak, _rss_mb(proc.pid))
            time.sleep(1.0)
    r = json.loads(out.read_text()) if out.exists() else {}
    error = r.get("error") or ("" if r else f"no result (exit {proc.returncode}, see {err.name})")
    return {"ok": bool(r.get("session_ok")), "create_s": (r.get("timings") or {}).get("session_create_s"),
            "total_s": time.monotonic() - t0, "rss_mb": peak, "error": " ".join(str(error).split())[:160]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", required=True, help="comma-separated total initializer sizes in MiB")
    ap.add_argument("--forms", default="single,external", help="single, external or both (default both)")
    ap.add_argument("--bundles", default="webgpu", help="comma-separated: webgpu, jsep, all (default webgpu)")
    ap.add_argument("--tensor-mb", type=float, default=32.0, help="size of each initializer in MiB (default 32)")
    ap.add_argument("--workdir", default="/tmp/sizelimit", help="where the models are written")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per session creation (default 300)")
    ap.add_argument("--keep", action="store_true", help="keep the models")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    head = f"{'MiB':>6} {'tensor MiB':>10} {'n':>4} {'form':<8} {'bundle':<6} {'outcome':<7} {'create s':>8} " \
           f"{'total s':>7} {'max RSS MiB':>11}  error"
    print(head, flush=True)
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        for form in args.forms.split(","):
            model = work / f"s{size:g}_t{args.tensor_mb:g}_{form}.onnx"
            n = build(model, size, args.tensor_mb, external=form == "external")
            for bundle in args.bundles.split(","):
                m = measure(model, bundle, args.timeout)
                create = f"{m['create_s']:.1f}" if m["create_s"] is not None else "-"
                row = f"{size:>6g} {args.tensor_mb:>10g} {n:>4} {form:<8} {bundle:<6} " \
                      f"{'ok' if m['ok'] else 'FAILED':<7} {create:>8} {m['total_s']:>7.1f} {m['rss_mb']:>11.0f}  " \
                      f"{m['error']}"
                rows.append(row)
                print(row, flush=True)
            if not args.keep:
                for f in (model, model.with_name(model.name + "_data")):
                    f.unlink(missing_ok=True)
    print("\n" + head + "\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
