#!/usr/bin/env python3
"""What patching changes on the real WebGPU runtimes: CPU-EP nodes, Memcpy nodes and the bytes that cross the
CPU/GPU boundary per inference, before and after, for each fixture on onnxruntime-node (native WebGPU EP) and
onnxruntime-web in headless Chromium (``ort.webgpu.min.mjs`` = native EP, ``ort.min.mjs`` = JSEP).

    .venv/bin/python scripts/bench_residency.py [--json FILE] [--fixtures NAME ...] [--runtimes ID ...] [--jobs N]

Placement comes from ORT's own verbose log (``deform_surgeon.webgpu.placement.measure_placement``, session creation
only, no inference). Bytes crossing = the sum over the Memcpy nodes ORT inserted of the size of the tensor each
one copies (each Memcpy node runs once per inference); graph inputs and outputs, which cross in both models
alike, are left out and printed once per fixture below the table.

Tensor sizes: the log names the tensor of every ``MemcpyFromHost``/``MemcpyToHost``, as it is called in the
graph ORT partitioned, i.e. after ORT's graph optimisations. Those names are looked up in the model file given
to ORT, shapes and dtypes from ONNX shape inference (with data propagation). Why that works: ORT's optimisers
keep the name of every tensor they do not fold or fuse away, and a name they create themselves (a fused or
layout-transformed node's new output, an inserted Cast) is simply not found -- it is never mistaken for another
tensor; constant folding makes initializers, which are copied once at session creation and have no Memcpy node.
On these fixtures every Memcpy tensor on all three runtimes is a tensor of the model file. A name that
shape inference leaves without a static shape is sized by running the model on ORT CPU (Python, graph
optimisations off so that names survive) with that tensor added as an output. A name that is not in the model
file at all is *not* guessed: the row is marked ``+?`` and the names are printed (and listed in the JSON). The
alternative -- have ORT write its optimised graph (``optimizedModelFilePath``) and read shapes there -- does not
work: that file has no value_info, contains ORT-internal ops (``com.ms.internal.nhwc``) that ONNX shape
inference cannot type, cannot be written in the browser, and is not written at all when session creation fails
(fp16 on SwiftShader).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_FIXTURES = [
    "decoder_gathernd",
    "decoder_gatherelements",
    "decoder_gathernd_fp16",
    "decoder_gatherelements_fp16",
]
RUNTIMES = {"node": ("node", None), "browser/webgpu": ("browser", "webgpu"), "browser/jsep": ("browser", "jsep")}
MB = 1e6


# --------------------------------------------------------------------------------------------- tensor sizes


@dataclass
class TensorInfo:
    dtype: str
    shape: list[int]
    nbytes: int
    source: str  # "shape inference" | "ORT CPU run"


@dataclass
class Sizer:
    """Sizes of a model's tensors by name: ONNX shape inference, then an ORT CPU run for what it leaves open."""

    model_path: Path
    static: dict[str, TensorInfo] = field(default_factory=dict)
    known_names: set[str] = field(default_factory=set)
    _cache: dict[str, TensorInfo | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        model = onnx.load(str(self.model_path))
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        g = inferred.graph
        self.known_names = {o for n in g.node for o in n.output} | {i.name for i in g.input}
        self.known_names |= {i.name for i in g.initializer}
        for vi in [*g.input, *g.value_info, *g.output]:
            tt = vi.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if tt.elem_type and tt.HasField("shape") and all(d is not None for d in dims):
                self.static[vi.name] = _info(tt.elem_type, dims, "shape inference")
        for init in g.initializer:
            self.static[init.name] = _info(init.data_type, list(init.dims), "shape inference")

    def resolve(self, names: list[str]) -> dict[str, TensorInfo | None]:
        todo = [n for n in dict.fromkeys(names) if n not in self._cache]
        for n in todo:
            if n in self.static:
                self._cache[n] = self.static[n]
        dynamic = [n for n in todo if n not in self._cache and n in self.known_names]
        if dynamic:
            self._cache.update(self._run_ort(dynamic))
        for n in todo:
            self._cache.setdefault(n, None)  # not a tensor of this model file: ORT made or renamed it
        return {n: self._cache[n] for n in names}

    def _run_ort(self, names: list[str]) -> dict[str, TensorInfo]:
        import onnxruntime as ort

        from deform_surgeon.webgpu.placement import make_inputs

        model = onnx.load(str(self.model_path))
        present = {o.name for o in model.graph.output}
        for n in names:
            if n not in present:
                model.graph.output.append(helper.make_empty_tensor_value_info(n))
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds, _ = make_inputs(model, seed=0)
        values = sess.run(names, feeds)
        out = {}
        for n, v in zip(names, values, strict=True):
            a = np.asarray(v)
            out[n] = TensorInfo(str(a.dtype), list(a.shape), int(a.nbytes), "ORT CPU run")
        return out


def _info(elem_type: int, dims: list[int], source: str) -> TensorInfo:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    return TensorInfo(str(dtype), [int(d) for d in dims], int(np.prod(dims, dtype=np.int64)) * dtype.itemsize, source)


# --------------------------------------------------------------------------------------------- measurement


_COPY = re.compile(r"AddCopyNode\] Add (MemcpyFromHost|MemcpyToHost) (?:after|before) (.+?) for \S+\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def measure(model: Path, runtime_id: str, timeout: float, work: Path) -> tuple[Any, list[tuple[str, str]]]:
    """Placement of one model on one runtime, and (kind, tensor) of every copy node from the raw log (the
    Placement lists the tensors but not which direction each one goes)."""
    from deform_surgeon.webgpu.placement import measure_placement

    runtime, bundle = RUNTIMES[runtime_id]
    log = work / f"{model.stem}.{runtime_id.replace('/', '_')}.log"
    p = measure_placement(model, runtime=runtime, bundle=bundle or "webgpu", timeout=timeout, log_out=log)
    copies = []
    for line in log.read_text("utf-8", "replace").splitlines() if log.exists() else []:
        m = _COPY.search(_ANSI.sub("", line))
        if m:
            copies.append((m[1], m[2]))
    if [t for _, t in copies] != p.memcpy_tensors:
        raise RuntimeError(f"{model} on {runtime_id}: copy nodes in the log disagree with the Placement")
    return p, copies


def side(p: Any, copies: list[tuple[str, str]], sizer: Sizer) -> dict[str, Any]:
    """One model on one runtime: counts from the log, bytes from the sizes of the Memcpy tensors."""
    d: dict[str, Any] = {
        "session_ok": p.session_ok,
        "error": p.error,
        "placement_logged": p.placement_logged,
        "total_nodes": p.total_nodes,
        "cpu_nodes": p.cpu_nodes,
        "memcpy": p.memcpy,
        "memcpy_by_kind": p.memcpy_by_kind,
        "cpu_ops": p.cpu_ops,
    }
    sizes = sizer.resolve([t for _, t in copies])
    up = down = 0
    unresolved: list[str] = []
    sources: set[str] = set()
    d["copies"] = [{"kind": kind, "tensor": t, **({} if sizes[t] is None else vars(sizes[t]))} for kind, t in copies]
    for kind, t in copies:
        info = sizes[t]
        if info is None:
            unresolved.append(t)
            continue
        sources.add(info.source)
        if kind == "MemcpyFromHost":
            up += info.nbytes
        else:
            down += info.nbytes
    d.update(bytes=up + down, bytes_up=up, bytes_down=down, unresolved=unresolved, size_sources=sorted(sources))
    return d


def io_bytes(model_path: Path) -> tuple[int, int]:
    from deform_surgeon.webgpu.placement import make_inputs

    model = onnx.load(str(model_path), load_external_data=False)
    feeds, _ = make_inputs(model, seed=0)
    sizer = Sizer(model_path)
    outs = sizer.resolve([o.name for o in model.graph.output])
    return sum(int(a.nbytes) for a in feeds.values()), sum(i.nbytes for i in outs.values() if i is not None)


# -------------------------------------------------------------------------------------------------- output


def _mb(d: dict[str, Any]) -> str:
    if not d["placement_logged"]:
        return "n/a"
    s = f"{d['bytes'] / MB:.3f}"
    return s + " +?" if d["unresolved"] else s


def _n(d: dict[str, Any], key: str) -> str:
    return str(d[key]) if d["placement_logged"] else "n/a"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["fixture", "runtime", "CPU nodes before", "after", "Memcpy before", "after", "MB crossing before", "after"]
    body = [
        [
            r["fixture"],
            r["runtime"],
            _n(r["before"], "cpu_nodes"),
            _n(r["after"], "cpu_nodes"),
            _n(r["before"], "memcpy"),
            _n(r["after"], "memcpy"),
            _mb(r["before"]),
            _mb(r["after"]),
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    right = [False, False] + [True] * 6

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))
            + " |"
        )

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if r else "-" * w for w, r in zip(widths, right, strict=True)) + " |"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", metavar="FILE", help="also write every number (and the raw counts) to FILE")
    ap.add_argument(
        "--fixtures",
        nargs="+",
        default=DEFAULT_FIXTURES,
        metavar="NAME",
        help="fixture names under tests/fixtures (without .onnx), or paths to .onnx files",
    )
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    ap.add_argument("--jobs", type=int, default=2, help="measurements in parallel (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per measurement, seconds (default 600)")
    args = ap.parse_args(argv)

    import deform_surgeon as ds
    from deform_surgeon.webgpu.placement import missing_setup

    msg = missing_setup()
    if msg:
        print(f"bench_residency: {msg}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    paths = {f: (Path(f) if f.endswith(".onnx") else FIXTURES / f"{f}.onnx") for f in args.fixtures}
    for p in paths.values():
        if not p.is_file():
            print(f"bench_residency: fixture not found: {p}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="bench-residency-") as tmp:
        models: dict[tuple[str, str], Path] = {}
        for f, p in paths.items():
            out = Path(tmp) / f"{p.stem}.patched.onnx"
            ds.patch(p, out)
            models[f, "before"], models[f, "after"] = p, out
        keys = [(f, kind, rid) for rid in args.runtimes for f in paths for kind in ("before", "after")]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {k: pool.submit(measure, models[k[0], k[1]], k[2], args.timeout, Path(tmp)) for k in keys}
            placements = {k: fut.result() for k, fut in futures.items()}
        sizers = {k: Sizer(p) for k, p in models.items()}
        rows = []
        for f in paths:
            for rid in args.runtimes:
                rows.append(
                    {
                        "fixture": Path(f).stem,
                        "runtime": rid,
                        "before": side(*placements[f, "before", rid], sizers[f, "before"]),
                        "after": side(*placements[f, "after", rid], sizers[f, "after"]),
                    }
                )
        io = {Path(f).stem: io_bytes(p) for f, p in paths.items()}
        versions: dict[str, str] = {}
        for p, _ in placements.values():
            versions.update(p.versions)
    seconds = time.monotonic() - t0

    print(format_table(rows))
    print()
    print("MB = 10^6 bytes copied per inference by the Memcpy nodes ORT inserts (MemcpyFromHost + MemcpyToHost);")
    print("tensor sizes from ONNX shape inference on the model file given to ORT (see the script's docstring).")
    for f, (i, o) in io.items():
        print(
            f"not counted, the same before and after: {f} graph inputs {i / MB:.3f} MB up, outputs {o / MB:.3f} MB down"
        )
    for r in rows:
        for when in ("before", "after"):
            d = r[when]
            if d["unresolved"]:
                print(
                    f"{r['fixture']} {r['runtime']} {when}: {len(d['unresolved'])} Memcpy tensor(s) not in the model "
                    f"file (renamed or made by ORT), not counted: {', '.join(d['unresolved'][:10])}"
                )
            if not d["session_ok"]:
                why = (d["error"] or "").split("ERROR_MESSAGE: ")[-1][:120]
                logged = "placement log complete" if d["placement_logged"] else "NO placement in the log"
                print(f"{r['fixture']} {r['runtime']} {when}: session creation failed ({logged}): {why}")
    sources = sorted({s for r in rows for w in ("before", "after") for s in r[w]["size_sources"]})
    print(
        f"sizes resolved by: {', '.join(sources) or '-'}; versions: "
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    )
    print(f"{len(keys)} measurements in {seconds:.0f} s (--jobs {args.jobs})")
    if args.json:
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "seconds": round(seconds, 1),
            "versions": versions,
            "mb": MB,
            "io_bytes": {f: {"inputs": i, "outputs": o} for f, (i, o) in io.items()},
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
