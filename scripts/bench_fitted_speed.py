#!/usr/bin/env python
"""Inference time of the fitted model (plain `patch`: fitted to spec-default) against the unfitted one
(`patch --device-profile adapter`) on one runtime, side by side, with their ratio.

    .venv/bin/python scripts/bench_fitted_speed.py MODEL.onnx [--runtime cpu|node|browser] [--bundle webgpu|jsep]
        [--runs 3] [--rounds 2] [--fitted F.onnx --unfitted U.onnx] [--keep DIR] [--profile-nodes]

Without --fitted/--unfitted both are patched from MODEL first (the adapter profile needs `deform-surgeon setup`).
When the two files are byte-identical (nothing over the spec-default profile), the ratio is 1 by construction and
nothing is run.

- `cpu` (ORT CPU, level all): each model in a subprocess of its own, one at a time (a real 1024 session holds
  ~8 GB), rounds alternating unfitted/fitted so that a change in the machine's load hits both alike; each
  subprocess makes one warm-up run and then `--runs` timed runs; the figure is the median of all timed runs.
  The process CPU time of the runs is printed too: on a loaded machine it moves less than the wall time.
  `--profile-nodes`: ORT's `enable_profiling` in every subprocess; the last round's per-node kernel times (the
  warm-up left out) are summed by op type and by nodes the other model does not have (where the extra time goes;
  ORT's own node names, e.g. `Transpose_token_N` of its layout transformer, need not match between the models).
- `node` / `browser`: `deform-surgeon placement MODEL --run --device-profile adapter` (onnxruntime-node's native
  WebGPU EP, or onnxruntime-web in headless Chromium): one inference per model and round, shader compilation
  included (the harness runs once); on a software adapter these are CPU times, not GPU times. The output is
  compared with ORT CPU as placement does.

The ratio is fitted / unfitted; the target of issue 23 is <= 1.15. Measures; does not gate (exit 0 unless a
model fails to run).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

BIN = Path(sys.executable).parent
SURGEON = [str(BIN / "deform-surgeon")] if (BIN / "deform-surgeon").exists() else [sys.executable, "-m",
                                                                                     "deform_surgeon"]
TARGET = 1.15

# One model on ORT CPU: a warm-up run, then timed runs; prints JSON. With a profile path: ORT's profile instead.
CPU_CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
from deform_surgeon.webgpu.placement.runner import make_inputs
import onnx
model, runs, prof, feeds_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
opts = ort.SessionOptions()
if prof:
    opts.enable_profiling = True
    opts.profile_file_prefix = prof
s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
if feeds_file:
    feeds = dict(np.load(feeds_file))
else:
    feeds, _ = make_inputs(onnx.load(model, load_external_data=False), seed=0)
s.run(None, feeds)
times, cpu = [], []
for _ in range(runs):
    t0, c0 = time.perf_counter(), time.process_time()
    s.run(None, feeds)
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
out = {"times": times, "cpu": cpu}
if prof:
    out["profile"] = s.end_profiling()
print(json.dumps(out))
"""


def patch_both(model: Path, work: Path) -> tuple[Path, Path]:
    """The fitted (plain patch) and unfitted (--device-profile adapter) versions of `model`, in `work`."""
    fitted, unfitted = work / f"{model.stem}.fitted.onnx", work / f"{model.stem}.unfitted.onnx"
    for out, extra in ((fitted, []), (unfitted, ["--device-profile", "adapter"])):
        cmd = [*SURGEON, "patch", str(model), str(out), *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        print(f"patched {out.name} in {time.perf_counter() - t0:.1f} s: {' '.join(cmd[1:])}", flush=True)
    return fitted, unfitted


def cpu_child(model: Path, runs: int, profile_prefix: str = "", feeds_file: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", CPU_CHILD, str(model), str(runs), profile_prefix, feeds_file],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ORT CPU run of {model} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def node_times(profile_json: str) -> dict[str, tuple[str, float]]:
    """Node name -> (op type, kernel seconds per run) from an ORT CPU profile, the warm-up run left out."""
    events = json.loads(Path(profile_json).read_text())
    starts = sorted(ev["ts"] for ev in events if ev.get("cat") == "Session" and ev.get("name") == "model_run")
    first, runs = (starts[1], len(starts) - 1) if len(starts) > 1 else (0, 1)
    out: dict[str, tuple[str, float]] = {}
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time") and ev["ts"] >= first:
            name = ev["name"][: -len("_kernel_time")]
            op = ev.get("args", {}).get("op_name", "?")
            out[name] = (op, out.get(name, (op, 0.0))[1] + ev["dur"] / 1e6 / runs)
    return out


def print_profile(unfitted: dict[str, tuple[str, float]], fitted: dict[str, tuple[str, float]]) -> None:
    """Kernel seconds by op type side by side, and the time of nodes only one model has."""
    ops_u, ops_f = Counter(), Counter()
    for op, s in unfitted.values():
        ops_u[op] += s
    for op, s in fitted.values():
        ops_f[op] += s
    print("\nORT CPU kernel time by op type (s per run, warm-up left out; ORT's node names after fusion)")
    print(f"  {'op':<22}{'unfitted':>10}{'fitted':>10}{'delta':>10}")
    for op in sorted(set(ops_u) | set(ops_f), key=lambda o: -abs(ops_f[o] - ops_u[o]))[:12]:
        print(f"  {op:<22}{ops_u[op]:10.3f}{ops_f[op]:10.3f}{ops_f[op] - ops_u[op]:+10.3f}")
    print(f"  {'(all)':<22}{sum(ops_u.values()):10.3f}{sum(ops_f.values()):10.3f}"
          f"{sum(ops_f.values()) - sum(ops_u.values()):+10.3f}")
    only_u = {k: v for k, v in unfitted.items() if k not in fitted}
    only_f = {k: v for k, v in fitted.items() if k not in unfitted}
    common = set(unfitted) & set(fitted)
    print(f"  nodes only in unfitted: {len(only_u)}, {sum(s for _, s in only_u.values()):.3f} s; "
          f"only in fitted: {len(only_f)}, {sum(s for _, s in only_f.values()):.3f} s; "
          f"in both: {len(common)}, {sum(unfitted[k][1] for k in common):.3f} s -> "
          f"{sum(fitted[k][1] for k in common):.3f} s")
    for title, nodes in (("unfitted only", only_u), ("fitted only", only_f)):
        top = sorted(nodes.items(), key=lambda kv: -kv[1][1])[:8]
        for name, (op, s) in top:
            print(f"    {title:<14}{s:8.3f} s  {op:<14} {name[-90:]}")


def _differing(model: onnx.ModelProto, other: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of `model` that `other` has not, byte for byte (the rewrites' nodes)."""
    theirs = {n.SerializeToString() for n in other.graph.node}
    return [n for n in model.graph.node if n.SerializeToString() not in theirs]


def _boundary(model: onnx.ModelProto, region: list[onnx.NodeProto]) -> tuple[set[str], set[str]]:
    """The tensors `region` reads from the rest of the model (constants left out: the cut pulls them in) and the
    tensors it makes that the rest of the model or the graph's outputs read."""
    made = {o for n in region for o in n.output}
    constant = {i.name for i in model.graph.initializer}
    constant |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    ins = {i for n in region for i in n.input if i and i not in made and i not in constant}
    inside = {id(n) for n in region}
    read = {o.name for o in model.graph.output} | {i for n in model.graph.node if id(n) not in inside for i in n.input}
    return ins, made & read


def _cut(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str]) -> onnx.ModelProto:
    """The part of `model` that makes `outputs` from `feeds` (and constants): a model of its own."""
    producer = {o: n for n in model.graph.node for o in n.output}
    keep: set[int] = set()
    todo = list(outputs)
    while todo:
        name = todo.pop()
        n = producer.get(name)
        if name in feeds or n is None or id(n) in keep:
            continue
        keep.add(id(n))
        todo += [i for i in n.input if i]
    nodes = [n for n in model.graph.node if id(n) in keep]
    read = {i for n in nodes for i in n.input}
    inits = [t for t in model.graph.initializer if t.name in read]
    inputs = [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    graph = onnx.helper.make_graph(nodes, "region", inputs, [], inits)
    cut = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    known = {v.name: v for v in onnx.shape_inference.infer_shapes(cut).graph.value_info}
    elem = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    cut.graph.output.extend(known[o] if o in known else onnx.helper.make_tensor_value_info(
        o, elem.get(o, onnx.TensorProto.FLOAT), None) for o in outputs)
    return cut


def cut_regions(fitted: Path, unfitted: Path, work: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """The nodes where the two models differ, cut out of each with the same inputs and outputs, and the real values
    of those inputs (one ORT CPU run of the unfitted model on the seeded input): timing the two cuts on a runtime
    shows what the fitting costs there without a whole inference (a software adapter takes minutes per model)."""
    import onnxruntime as ort

    from deform_surgeon.webgpu.placement.runner import make_inputs

    f_model, u_model = onnx.load(str(fitted)), onnx.load(str(unfitted))
    f_in, f_out = _boundary(f_model, _differing(f_model, u_model))
    u_in, u_out = _boundary(u_model, _differing(u_model, f_model))
    if (f_in, f_out) != (u_in, u_out):
        sys.exit(f"the differing nodes have other inputs/outputs in the two models: fitted {sorted(f_in ^ u_in)}, "
                 f"{sorted(f_out ^ u_out)}")
    probe = onnx.ModelProto()
    probe.CopyFrom(u_model)
    del u_model
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in sorted(u_in))
    feeds, _ = make_inputs(probe, seed=0)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    del probe
    values = dict(zip(sorted(u_in), session.run(sorted(u_in), feeds), strict=True))
    del session
    paths = []
    for label, m in (("fitted", f_model), ("unfitted", onnx.load(str(unfitted)))):
        path = work / f"region.{label}.onnx"
        onnx.save(_cut(m, values, sorted(f_out)), str(path))
        paths.append(path)
    print(f"region: {len(f_in)} input(s) ({sum(v.nbytes for v in values.values()) / 1e6:.1f} MB), "
          f"{len(f_out)} output(s): {', '.join(sorted(f_out))[:300]}")
    return paths[0], paths[1], values


def bench_cpu(fitted: Path, unfitted: Path, runs: int, rounds: int, profile: bool,
              work: Path, feeds_file: str = "") -> tuple[float, float]:
    """Median wall seconds (unfitted, fitted); prints the process CPU seconds too (less sensitive to the load)."""
    wall: dict[str, list[float]] = {"unfitted": [], "fitted": []}
    cpu: dict[str, list[float]] = {"unfitted": [], "fitted": []}
    prof: dict[str, dict[str, tuple[str, float]]] = {}
    for r in range(rounds):
        for label, m in (("unfitted", unfitted), ("fitted", fitted)):
            prefix = str(work / f"prof_{label}_{r}") if profile else ""
            got = cpu_child(m, runs, prefix, feeds_file)
            wall[label] += got["times"]
            cpu[label] += got["cpu"]
            if profile and r == rounds - 1:
                prof[label] = node_times(got["profile"])
            print(f"  round {r + 1} {label:<9} wall " + " ".join(f"{t:7.2f}" for t in got["times"]) +
                  " s; CPU " + " ".join(f"{t:7.2f}" for t in got["cpu"]) + " s", flush=True)
    c_u, c_f = statistics.median(cpu["unfitted"]), statistics.median(cpu["fitted"])
    print(f"\nprocess CPU time (median): unfitted {c_u:.2f} s, fitted {c_f:.2f} s: ratio {c_f / c_u:.3f} "
          f"({'within' if c_f / c_u <= TARGET else 'OVER'} the {TARGET}x target)")
    if profile:
        print_profile(prof["unfitted"], prof["fitted"])
    return statistics.median(wall["unfitted"]), statistics.median(wall["fitted"])


def bench_webgpu(fitted: Path, unfitted: Path, runtime: str, bundle: str, rounds: int,
                 timeout: float, feeds: dict[str, np.ndarray] | None = None) -> tuple[float, float]:
    from deform_surgeon.webgpu.placement.runner import measure_placement

    times: dict[str, list[float]] = {"unfitted": [], "fitted": []}
    for r in range(rounds):
        for label, m in (("unfitted", unfitted), ("fitted", fitted)):
            p = measure_placement(m, runtime=runtime, bundle=bundle, run=True, timeout=timeout, profile="adapter",
                                  feeds=feeds)
            run = p.run or {}
            if not p.session_ok or not run.get("ok"):
                sys.exit(f"{label} {m} failed on {runtime}: {p.error or run.get('error')}")
            diffs = [o.get("max_abs_diff") for o in (run.get("outputs") or {}).values()]
            t = p.timings["run_s"]
            times[label].append(t)
            print(f"  round {r + 1} {label:<9}{t:9.2f} s  (session {p.timings.get('session_create_s', 0):.1f} s, "
                  f"{p.log.cpu_nodes} CPU nodes, max |diff| vs ORT CPU {diffs})", flush=True)
    return statistics.median(times["unfitted"]), statistics.median(times["fitted"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="the model as exported (patched both ways unless given below)")
    ap.add_argument("--fitted", type=Path, help="the plain `patch` output")
    ap.add_argument("--unfitted", type=Path, help="the `patch --device-profile adapter` output")
    ap.add_argument("--runtime", choices=("cpu", "node", "browser"), default="cpu")
    ap.add_argument("--bundle", choices=("webgpu", "jsep"), default="webgpu", help="browser only")
    ap.add_argument("--runs", type=int, default=3, help="cpu: timed runs per subprocess (default 3)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 2 cpu, 1 webgpu)")
    ap.add_argument("--profile-nodes", action="store_true", help="cpu: per-node kernel times by op type")
    ap.add_argument("--region", action="store_true",
                    help="time only the nodes where the two models differ, cut out of each with the real values of "
                         "their inputs (seconds where a whole inference takes minutes)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the patched models (and --region's cuts) here (default: temporary)")
    ap.add_argument("--timeout", type=float, default=5400.0, help="node/browser: seconds per run (default 5400)")
    args = ap.parse_args()
    if (args.fitted is None) != (args.unfitted is None) or (args.fitted is None and args.model is None):
        ap.error("give MODEL, or both --fitted and --unfitted")
    rounds = args.rounds or (2 if args.runtime == "cpu" else 1)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.fitted is None:
            keep = args.keep or work
            keep.mkdir(parents=True, exist_ok=True)
            fitted, unfitted = patch_both(Path(args.model), keep)
        else:
            fitted, unfitted = args.fitted, args.unfitted
        for m in (fitted, unfitted):
            if not m.is_file():
                sys.exit(f"{m}: no such file")
        where = {"cpu": "ORT CPU (level all)", "node": "onnxruntime-node native WebGPU EP",
                 "browser": f"headless Chromium, onnxruntime-web '{args.bundle}' bundle"}[args.runtime]
        print(f"fitted:   {fitted} ({os.path.getsize(fitted) / 1e6:.1f} MB)")
        print(f"unfitted: {unfitted} ({os.path.getsize(unfitted) / 1e6:.1f} MB)")
        if filecmp.cmp(fitted, unfitted, shallow=False):
            print("the two files are byte-identical (nothing over the spec-default profile): ratio 1.00 by "
                  "construction, nothing run")
            return
        feeds, feeds_file = None, ""
        if args.region:
            cuts = args.keep or work
            cuts.mkdir(parents=True, exist_ok=True)
            fitted, unfitted, feeds = cut_regions(fitted, unfitted, cuts)
            feeds_file = str(cuts / "region_inputs.npz")
            np.savez(feeds_file, **feeds)
        print(f"runtime: {where}")
        if args.runtime == "cpu":
            t_u, t_f = bench_cpu(fitted, unfitted, args.runs, rounds, args.profile_nodes, work, feeds_file)
        else:
            t_u, t_f = bench_webgpu(fitted, unfitted, args.runtime, args.bundle, rounds, args.timeout, feeds)
    ratio = t_f / t_u
    print(f"wall time (median): unfitted {t_u:.2f} s, fitted {t_f:.2f} s: ratio {ratio:.3f} "
          f"({'within' if ratio <= TARGET else 'OVER'} the {TARGET}x target)")


if __name__ == "__main__":
    main()
