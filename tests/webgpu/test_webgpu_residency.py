"""The project's claim on the real WebGPU runtimes: patched exporter fixtures are fully GPU-resident, run, match
ORT CPU, and give the *same bytes* as the original model on the same runtime.

Runtimes: onnxruntime-node 1.30.0 (native WebGPU EP), onnxruntime-web 1.30.0 in headless Chromium with
``ort.webgpu.min.mjs`` (native EP) and ``ort.min.mjs`` (JSEP), all on SwiftShader
(`docs/runtime-facts.md`, cited here as "runtime facts N").

(a) placement, read from ORT's verbose log: every original falls back to the CPU EP with Memcpy nodes; every
    patched model has no CPU node and no Memcpy, and ORT's whole optimised graph is on the GPU EP (on node this
    is cross-checked against the optimised model onnxruntime-node itself saves, ``optimizedModelFilePath``).
(b) fp32 runs: the patched model runs on all three runtimes without an error or an uncaught WebGPU error and
    matches ORT CPU within 1e-5 (Conv on a GPU is not byte-identical to Conv on the CPU, ~9e-7); and on every
    runtime where the original runs, patched and original outputs are byte-identical. The original GatherND
    form does not run on JSEP (rank-5 GatherND shader): that must be reported as a failure.
(c) runtime facts 3, JSEP's mid-run-upload hazard: a minimal graph that JSEP computes wrongly without any error,
    while the native EP is exact; the patched fixtures have no MemcpyFromHost at all, so they cannot hit it.

fp16 fixtures are measured for placement only: SwiftShader has no ``shader-f16``, so session creation fails on
the native EP after partitioning (the placement log is complete) and JSEP, which compiles shaders lazily,
creates the session but could not run it.

Cost: every measurement is a real session (a Chromium per browser measurement), ~25 of them; they are all
started once, in a module-scoped pool of ``DS_WEBGPU_JOBS`` (default 2) workers, and every test reads the shared
results. Raw GPU outputs are not part of :class:`Placement` (its ``run`` holds only the comparison with ORT CPU),
so the pool captures them by wrapping ``outcome.compare_outputs``, which receives them (placement/outcome.py's
``finish_run`` calls it).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import deform_surgeon as ds
from deform_surgeon.base import js_runtimes as runtimes
from deform_surgeon.webgpu.placement import Placement, measure_placement, missing_setup
from deform_surgeon.webgpu.placement import outcome as outcome_mod
from deform_surgeon.webgpu.placement import runner as runner_mod

FIXTURES = Path(__file__).parents[1] / "fixtures"
_SETUP = missing_setup()
pytestmark = [
    pytest.mark.webgpu,
    pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}"),
]

FP32 = ["decoder_gathernd", "decoder_gatherelements"]
FP16 = ["decoder_gathernd_fp16", "decoder_gatherelements_fp16"]
FIXTURE_NAMES = FP32 + FP16
RUNTIMES = {  # id -> (runtime, bundle, GPU EP in ORT's log)
    "node": ("node", None, "WebGpuExecutionProvider"),
    "browser/webgpu": ("browser", "webgpu", "WebGpuExecutionProvider"),
    "browser/jsep": ("browser", "jsep", "JsExecutionProvider"),
}
SEED = 1
CPU_TOLERANCE = 1e-5
TIMEOUT = 420.0  # per measurement; a loaded 2-core machine makes a browser run take up to ~35 s
JOBS = max(1, int(os.environ.get("DS_WEBGPU_JOBS", "2")))


# ------------------------------------------------------------------------------------------ measurement pool


@dataclass(frozen=True)
class Measured:
    placement: Placement
    outputs: dict[str, np.ndarray] | None  # raw outputs of the GPU run (None: no run, or it failed)
    seconds: float


_captured = threading.local()


def _capturing(real: Callable[..., Any]) -> Callable[..., Any]:
    def compare_outputs(got: dict[str, np.ndarray | None], ref: dict[str, np.ndarray]) -> Any:
        _captured.outputs = {k: None if v is None else np.array(v, copy=True) for k, v in got.items()}
        return real(got, ref)

    return compare_outputs


def _measure(model: Path, runtime_id: str, **kw: Any) -> Measured:
    runtime, bundle, _ = RUNTIMES[runtime_id]
    _captured.outputs = None
    t0 = time.monotonic()
    p = measure_placement(model, runtime=runtime, bundle=bundle or "webgpu", timeout=TIMEOUT, **kw)
    outputs = _captured.outputs if p.run is not None and p.run.get("ok") else None
    if p.run is not None and p.run.get("ok") and outputs is None:
        raise AssertionError("the run succeeded but its outputs were not captured: outcome.compare_outputs moved?")
    return Measured(p, outputs, time.monotonic() - t0)


_SAVE_OPTIMISED_MJS = """
import { createRequire } from 'node:module';
const [pkgDir, model, out] = process.argv.slice(2);
const ort = createRequire(pkgDir + '/package.json')('onnxruntime-node');
try {
  const s = await ort.InferenceSession.create(model, { executionProviders: ['webgpu'], optimizedModelFilePath: out });
  await s.release();
} catch (e) {
  console.error(String(e));
  process.exit(1);
}
"""


def _optimised_node_count(model: Path, work: Path) -> int | str:
    """Nodes of the graph onnxruntime-node's WebGPU session ended up with (Memcpy included), from the
    optimised model ORT itself writes: an independent count to hold the log's per-provider counts against.
    Returns the error text when ORT wrote nothing (fp16 on SwiftShader fails before it saves)."""
    script = work / "save_optimised.mjs"
    script.write_text(_SAVE_OPTIMISED_MJS)
    out = work / f"{model.stem}.ort_optimised.onnx"
    r = subprocess.run(
        ["node", str(script), str(runtimes.node_modules().parent), str(model.resolve()), str(out)],
        env=runtimes.harness_env(work),
        cwd=str(runner_mod.PKG_DIR),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if r.returncode != 0 or not out.exists():
        return f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
    return len(onnx.load(str(out), load_external_data=False).graph.node)


class Lab:
    """All measurements of this module, started at once and shared by the tests."""

    def __init__(self, work: Path, models: dict[tuple[str, str], Path], repro: tuple[Path, dict[str, np.ndarray]]):
        self.models = models
        self.repro_feeds = repro[1]
        self._pool = ThreadPoolExecutor(JOBS, thread_name_prefix="webgpu")
        self._jobs: dict[tuple, Future] = {}
        browser = [r for r in RUNTIMES if r != "node"]
        # heaviest first, so that the pool's tail is short
        for rid in [*browser, "node"]:
            for name in FP32:
                for kind in ("original", "patched"):
                    self._submit(("run", name, kind, rid), _measure, models[name, kind], rid, run=True, seed=SEED)
        for rid in [*browser, "node"]:
            for name in FP16:
                for kind in ("original", "patched"):
                    self._submit(("placement", name, kind, rid), _measure, models[name, kind], rid)
        for rid in RUNTIMES:
            self._submit(("repro", rid), _measure, repro[0], rid, run=True, feeds=repro[1])
        for name in FIXTURE_NAMES:
            for kind in ("original", "patched"):
                sub = work / f"opt_{name}_{kind}"
                sub.mkdir()
                self._submit(("optimised", name, kind), _optimised_node_count, models[name, kind], sub)

    def _submit(self, key: tuple, fn: Callable[..., Any], *a: Any, **kw: Any) -> None:
        self._jobs[key] = self._pool.submit(fn, *a, **kw)

    def measured(self, name: str, kind: str, runtime_id: str) -> Measured:
        key = ("run" if name in FP32 else "placement", name, kind, runtime_id)
        return self._jobs[key].result()

    def repro(self, runtime_id: str) -> Measured:
        return self._jobs["repro", runtime_id].result()

    def optimised_nodes(self, name: str, kind: str) -> int | str:
        return self._jobs["optimised", name, kind].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def repro_model(path: Path) -> Path:
    """runtime facts 3: table float32[660,8]; two int64[560] index vectors, each Cast(to=int32) -- on the CPU
    EP under JSEP, which has no int64 Cast -- feeding its own Gather(axis=0) on the GPU."""
    nodes = [
        helper.make_node("Cast", ["idx0"], ["i0"], name="cast0", to=TensorProto.INT32),
        helper.make_node("Gather", ["table", "i0"], ["y0"], name="gather0", axis=0),
        helper.make_node("Cast", ["idx1"], ["i1"], name="cast1", to=TensorProto.INT32),
        helper.make_node("Gather", ["table", "i1"], ["y1"], name="gather1", axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "jsep_upload_hazard",
        [
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [660, 8]),
            helper.make_tensor_value_info("idx0", TensorProto.INT64, [560]),
            helper.make_tensor_value_info("idx1", TensorProto.INT64, [560]),
        ],
        [
            helper.make_tensor_value_info("y0", TensorProto.FLOAT, [560, 8]),
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, [560, 8]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # read by onnxruntime 1.30 (JS) and 1.32 (Python)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("webgpu_residency")
    models: dict[tuple[str, str], Path] = {}
    for name in FIXTURE_NAMES:
        original = FIXTURES / f"{name}.onnx"
        patched = work / f"{name}.patched.onnx"
        report = ds.patch(original, patched)  # once per module
        assert report.written and patched.is_file(), report.format()
        models[name, "original"], models[name, "patched"] = original, patched
    rng = np.random.default_rng(4)
    feeds = {
        "table": rng.random((660, 8), dtype=np.float32),
        "idx0": rng.integers(0, 660, 560).astype(np.int64),
        "idx1": rng.integers(0, 660, 560).astype(np.int64),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outcome_mod, "compare_outputs", _capturing(outcome_mod.compare_outputs))
        lab = Lab(work, models, (repro_model(work / "repro.onnx"), feeds))
        try:
            yield lab
        finally:
            lab.close()


def _where(p: Placement) -> str:
    return p.runtime if p.runtime == "node" else f"browser/{p.bundle}"


def _numbers(p: Placement) -> str:
    return (
        f"{_where(p)} {Path(p.model).name}: session_ok={p.session_ok} logged={p.placement_logged} "
        f"cpu_nodes={p.cpu_nodes} memcpy={p.memcpy} {p.memcpy_by_kind} total={p.total_nodes} "
        f"{p.nodes_by_provider} cpu_ops={p.cpu_ops} error={(p.error or '')[:200]}"
    )


def _assert_expected_session_outcome(p: Placement, name: str, runtime_id: str) -> None:
    """fp32 sessions must be created; fp16 ones may fail only for SwiftShader's missing shader-f16."""
    if p.session_ok:
        return
    assert name in FP16, f"session creation failed: {_numbers(p)}"
    assert runtime_id != "browser/jsep", f"JSEP compiles shaders lazily; its fp16 session should exist: {_numbers(p)}"
    assert p.error and "requires f16 but the device does not support it" in p.error, _numbers(p)
    assert p.adapter is not None and "shader-f16" not in p.adapter.get("features", []), p.adapter


ALL_CASES = [pytest.param(n, r, id=f"{n}-{r}") for n in FIXTURE_NAMES for r in RUNTIMES]
FP32_CASES = [pytest.param(n, r, id=f"{n}-{r}") for n in FP32 for r in RUNTIMES]

# ------------------------------------------------------------------------------------------------ (a) placement


@pytest.mark.parametrize("name, runtime_id", ALL_CASES)
def test_original_falls_back_to_cpu_with_memcpy(lab: Lab, name: str, runtime_id: str) -> None:
    p = lab.measured(name, "original", runtime_id).placement
    print(_numbers(p))
    _assert_expected_session_outcome(p, name, runtime_id)
    assert p.placement_logged, _numbers(p)
    assert p.gpu_provider == RUNTIMES[runtime_id][2]
    assert p.cpu_nodes > 0 and p.memcpy > 0, _numbers(p)
    assert p.memcpy_by_kind.get("MemcpyFromHost", 0) > 0, _numbers(p)  # mid-run uploads: the JSEP hazard's trigger
    assert p.memcpy == len(p.memcpy_tensors) == sum(p.memcpy_by_kind.values())
    assert p.total_nodes == sum(p.nodes_by_provider.values()) > p.cpu_nodes


@pytest.mark.parametrize("name, runtime_id", ALL_CASES)
def test_patched_is_entirely_on_the_gpu(lab: Lab, name: str, runtime_id: str) -> None:
    p = lab.measured(name, "patched", runtime_id).placement
    print(_numbers(p))
    _assert_expected_session_outcome(p, name, runtime_id)
    ep = RUNTIMES[runtime_id][2]
    assert p.placement_logged, _numbers(p)
    assert p.cpu_nodes == 0 and p.memcpy == 0, _numbers(p)
    assert p.memcpy_by_kind == {} and p.memcpy_tensors == [] and p.cpu_ops == {}, _numbers(p)
    assert p.kernel_not_found == [], p.kernel_not_found
    # every node of ORT's optimised graph is counted, and all on the GPU EP
    assert p.total_nodes > 0 and p.nodes_by_provider == {ep: p.total_nodes}, _numbers(p)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logged_node_counts_are_the_whole_optimised_graph(lab: Lab, name: str) -> None:
    """Nothing silently missing: the log's per-provider counts add up to the optimised graph's node count.

    On node that count is read from the optimised model onnxruntime-node writes itself (fp16: it fails before
    writing, see the module doc). The browser runtimes cannot write files; the same ORT build gives the same
    graph there (measured: equal on all three runtimes for the patched models)."""
    counts = {}
    for kind in ("original", "patched"):
        saved = lab.optimised_nodes(name, kind)
        totals = {rid: lab.measured(name, kind, rid).placement.total_nodes for rid in RUNTIMES}
        counts[kind] = (saved, totals)
        print(f"{name} {kind}: ORT-saved optimised graph {saved}, logged totals {totals}")
        if isinstance(saved, int):
            assert totals["node"] == saved, counts
        else:  # only an fp16 model on an adapter without shader-f16 may fail before ORT writes the file
            assert name in FP16 and "requires f16 but the device does not support it" in saved, saved
    saved_patched, totals_patched = counts["patched"]
    assert len(set(totals_patched.values())) == 1, totals_patched
    if isinstance(saved_patched, int):
        assert set(totals_patched.values()) == {saved_patched}, counts


# ---------------------------------------------------------------------------------------------------- (b) runs


def _diff_text(a: np.ndarray, b: np.ndarray) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return f"max|diff| {np.nanmax(d):.3g}, {int(np.count_nonzero(a != b))} of {a.size} elements differ"


@pytest.mark.parametrize("name, runtime_id", FP32_CASES)
def test_patched_runs_and_matches_ort_cpu(lab: Lab, name: str, runtime_id: str, record_property) -> None:
    m = lab.measured(name, "patched", runtime_id)
    p = m.placement
    assert p.session_ok, _numbers(p)
    assert p.run is not None and p.run["ok"] and p.run["error"] is None, p.run
    assert p.run["gpu_errors"] == [] and p.run["reference_error"] is None, p.run
    assert p.run["outputs"] and m.outputs is not None and set(m.outputs) == set(p.run["outputs"])
    for out, o in p.run["outputs"].items():
        record_property(f"max_abs_diff[{out}]", o["max_abs_diff"])
        print(
            f"{name} patched on {runtime_id}: {out} {o['dtype']}{o['shape']} max|diff| vs ORT CPU "
            f"{o['max_abs_diff']:.3g} ({o['mismatched_elements']} elements differ; identical={o['identical']}) "
            f"in {m.seconds:.1f} s"
        )
        assert o["max_abs_diff"] is not None and o["nonfinite_mismatch"] == 0, o
        assert o["max_abs_diff"] <= CPU_TOLERANCE, o
        assert np.ptp(m.outputs[out]) > 0, "a constant output would make every comparison here meaningless"


@pytest.mark.parametrize(
    "name, runtime_id",
    [
        pytest.param(n, r, id=f"{n}-{r}")
        for n in FP32
        for r in RUNTIMES
        if not (n == "decoder_gathernd" and r == "browser/jsep")  # the original cannot run there (next test)
    ],
)
def test_patched_is_byte_identical_to_original_on_the_same_runtime(lab: Lab, name: str, runtime_id: str) -> None:
    """The project's claim, on the GPU itself: same runtime, same input -> the same bytes as the original."""
    orig = lab.measured(name, "original", runtime_id)
    patched = lab.measured(name, "patched", runtime_id)
    assert orig.placement.run is not None and orig.placement.run["ok"], orig.placement.run
    assert orig.placement.run["gpu_errors"] == []
    assert orig.outputs is not None and patched.outputs is not None
    assert orig.outputs.keys() == patched.outputs.keys()
    for out, a in orig.outputs.items():
        b = patched.outputs[out]
        o_cpu = orig.placement.run["outputs"][out]["max_abs_diff"]
        print(
            f"{name} on {runtime_id}: {out} original vs patched: {_diff_text(a, b)}; "
            f"bytes identical {a.tobytes() == b.tobytes()}; original vs ORT CPU {o_cpu:.3g}"
        )
        assert a.dtype == b.dtype and a.shape == b.shape, _diff_text(a, b)
        assert a.tobytes() == b.tobytes(), f"{out}: {_diff_text(a, b)}"
        assert o_cpu is not None and o_cpu <= CPU_TOLERANCE  # and the original is as close to ORT CPU


def test_original_gathernd_form_fails_on_jsep_and_says_so(lab: Lab) -> None:
    """runtime facts 2 and 3: JSEP's GatherND shader does not compile for rank-5 data; with ort.env.debug the run is
    rejected, and the failure must reach Placement.run instead of a wrong mask."""
    m = lab.measured("decoder_gathernd", "original", "browser/jsep")
    p = m.placement
    assert p.session_ok, _numbers(p)  # the session is created: the shader compiles only at run time
    assert p.cpu_ops.get("GatherND", 0) == 0  # the GatherNDs are "placed" on JSEP ...
    assert p.run is not None and not p.run["ok"] and not p.ok, p.run  # ... and cannot run there
    assert "Error while parsing WGSL" in p.run["error"], p.run["error"]
    assert "no matching constructor for 'i32(vec4<u32>)'" in p.run["error"], p.run["error"]
    assert "GatherND" in p.run["error"]
    assert m.outputs is None and p.run["outputs"] == {}


# --------------------------------------------------------------------------------- (c) the JSEP upload hazard


def test_jsep_mid_run_upload_hazard_is_still_there(lab: Lab) -> None:
    """runtime facts 3, measured: JSEP runs the repro without any error and returns table[idx0] as the second
    output. If this fails because JSEP got it right, onnxruntime-web fixed the hazard: update docs/runtime-facts.md."""
    f = lab.repro_feeds
    want0, want1 = f["table"][f["idx0"]], f["table"][f["idx1"]]
    assert np.count_nonzero((want0 != want1).any(axis=1)) > 500  # the two gathers really differ
    m = lab.repro("browser/jsep")
    p = m.placement
    assert p.session_ok, _numbers(p)
    assert p.cpu_ops == {"Cast": 2} and p.memcpy_by_kind == {"MemcpyFromHost": 2}, _numbers(p)
    assert p.run is not None and p.run["ok"] and p.run["error"] is None and p.run["gpu_errors"] == [], p.run
    assert m.outputs is not None
    assert m.outputs["y0"].tobytes() == want0.tobytes()
    assert m.outputs["y1"].tobytes() == want0.tobytes(), "JSEP read idx1 correctly: the hazard is gone?"
    assert not p.run["outputs"]["y1"]["identical"]  # and the comparison with ORT CPU flags it


@pytest.mark.parametrize("runtime_id", ["node", "browser/webgpu"])
def test_native_ep_gets_the_hazard_repro_right(lab: Lab, runtime_id: str) -> None:
    f = lab.repro_feeds
    m = lab.repro(runtime_id)
    p = m.placement
    assert p.session_ok and p.memcpy_by_kind == {"MemcpyFromHost": 2}, _numbers(p)  # the same CPU Casts ...
    assert p.run is not None and p.run["ok"] and p.run["identical"] is True, p.run  # ... but exact
    assert m.outputs is not None
    assert m.outputs["y0"].tobytes() == f["table"][f["idx0"]].tobytes()
    assert m.outputs["y1"].tobytes() == f["table"][f["idx1"]].tobytes()


@pytest.mark.parametrize("name, runtime_id", ALL_CASES)
def test_patched_fixtures_upload_nothing_mid_run(lab: Lab, name: str, runtime_id: str) -> None:
    """What makes the patched models exact on JSEP: no MemcpyFromHost at all (the originals have them)."""
    patched = lab.measured(name, "patched", runtime_id).placement
    original = lab.measured(name, "original", runtime_id).placement
    assert patched.placement_logged and original.placement_logged
    assert original.memcpy_by_kind.get("MemcpyFromHost", 0) > 0, _numbers(original)
    assert patched.memcpy_by_kind.get("MemcpyFromHost", 0) == 0, _numbers(patched)
    assert not any(t for t in patched.memcpy_tensors), patched.memcpy_tensors


@pytest.mark.parametrize("name, runtime_id", ALL_CASES)
def test_cpu_fallback_is_inside_every_deform_block_and_gone_after_the_patch(lab: Lab, name: str,
                                                                            runtime_id: str) -> None:
    """Per deform block (found from the graph, deform_surgeon.graph.blocks): each of the 8 blocks of the original
    has CPU nodes and Memcpy nodes and nothing outside the blocks does; the patched blocks have none."""
    from deform_surgeon.graph.blocks import OUTSIDE
    from deform_surgeon.webgpu.placement.command import per_block

    before = per_block(lab.measured(name, "original", runtime_id).placement)
    after = per_block(lab.measured(name, "patched", runtime_id).placement)
    blocks = [k for k in before if k != OUTSIDE]
    assert len(blocks) == 8 and sorted(blocks) == sorted(k for k in after if k != OUTSIDE)
    assert all(before[k][0] > 0 and before[k][1] > 0 for k in blocks), before
    assert before[OUTSIDE] == (0, 0), before[OUTSIDE]
    assert set(after.values()) == {(0, 0)}, after


# ------------------------------------------------------------------------ NaN / inf offsets on the GPU ----------
def poisoned_model(path: Path) -> Path:
    """exporter_like's gathers (no Sum: the outputs are the gathered values themselves) with offsets that are NaN,
    +inf, -inf or 1e30 at a quarter of the sampling points each, at run time (an Add of a constant to the input)."""
    from helpers import graphs

    model = graphs.exporter_like(H=6, W=7, C=4, P=64, with_sum=False)
    poison = np.zeros((1, 1, 64, 2), np.float32)
    poison[0, 0, 0::4, 0] = np.nan
    poison[0, 0, 1::4, 1] = np.inf
    poison[0, 0, 2::4, :] = -np.inf
    poison[0, 0, 3::4, 0] = 1e30
    for node in model.graph.node:
        node.input[:] = ["offset_poisoned" if i == "offset" else i for i in node.input]
    model.graph.initializer.append(onnx.numpy_helper.from_array(poison, "poison"))
    model.graph.node.insert(0, helper.make_node("Add", ["offset", "poison"], ["offset_poisoned"], name="poison"))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("runtime_id", list(RUNTIMES))
def test_nan_and_inf_offsets_gather_the_same_elements_on_the_gpu_as_on_ort_cpu(tmp_path: Path, runtime_id: str):
    """The float chain's NaN guard (`Where(x >= lo, Clip(x), lo)`) on the real WebGPU EPs: the patched model stays
    entirely on the GPU, and its gathered values are the bytes ORT CPU gathers (where an index out of range is an
    error), so every index the GPU used is the in-range one ORT CPU used."""
    original = poisoned_model(tmp_path / "poisoned.onnx")
    patched = tmp_path / "poisoned.patched.onnx"
    report = ds.patch(original, patched)
    assert report.written and not report.refused
    runtime, bundle, _ = RUNTIMES[runtime_id]
    p = measure_placement(patched, runtime=runtime, bundle=bundle or "webgpu", timeout=TIMEOUT, run=True)
    assert p.session_ok and p.cpu_nodes == 0 and p.memcpy == 0, _numbers(p)
    assert p.run is not None and p.run["ok"], p.run
    assert p.run["outputs"] and all(o["identical"] for o in p.run["outputs"].values()), p.run["outputs"]
