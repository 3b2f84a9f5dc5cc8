"""Tests of deform_surgeon.webgpu.placement.

Parser tests run everywhere, on real logs committed under tests/fixtures/ (captured with
``measure_placement(..., log_out=...)`` on SwiftShader):

* ``placement_node_chain.log`` (onnxruntime-node 1.30.0, native WebGPU EP),
  ``placement_browser_webgpu_chain.log`` (onnxruntime-web 1.30.0 ``ort.webgpu.min.mjs``, Chromium 156) and
  ``placement_browser_jsep_chain.log`` (``ort.min.mjs``, JSEP): the chain model of :func:`chain_model`,
  ``Add(x0,x1)=a; Sum(a,x2,x3,x0)=s`` (node ``/dec/Sum (4 inputs)``) ``; Add(s,x1)=y``. Expected on every
  runtime: 1 CPU node (the Sum), 5 GPU nodes (2 Add + 3 Memcpy), MemcpyFromHost after x0 and s, MemcpyToHost
  before a.
* ``placement_node_all_gpu.log``: a single rank-5 GatherND; ORT prints only "All nodes placed on [...]".

Tests marked ``webgpu`` create real sessions (node and headless Chromium on SwiftShader); they skip, with the
reason, only when :func:`missing_setup` reports that ``deform-surgeon setup`` has not been run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import run
from onnx import TensorProto, helper

import deform_surgeon as ds
from deform_surgeon.base import js_runtimes as runtimes
from deform_surgeon.webgpu.placement import (
    Placement,
    PlacementTool,
    compare_outputs,
    make_inputs,
    measure_placement,
    missing_setup,
    parse_ort_log,
)
from deform_surgeon.webgpu.placement import harness as harness_mod
from deform_surgeon.webgpu.placement.command import format_comparison, format_placement

FIXTURES = Path(__file__).parents[1] / "fixtures"
REQUIRED_KEYS = {
    "runtime",
    "bundle",
    "session_ok",
    "error",
    "cpu_nodes",
    "memcpy",
    "nodes_by_provider",
    "cpu_ops",
    "cpu_node_names",
    "memcpy_tensors",
    "kernel_not_found",
    "adapter",
    "run",
}
_SETUP = missing_setup()


# ------------------------------------------------------------------------------------------------ models


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8  # onnxruntime 1.30 (JS) and 1.32 (Python) both read IR 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def sum_model(path: Path) -> Path:
    """Sum of 4 inputs then an Add: Sum has no WebGPU kernel in either EP (docs/runtime-facts.md section 2)."""
    ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 3]) for i in range(4)]
    nodes = [
        helper.make_node("Sum", [f"x{i}" for i in range(4)], ["s"], name="the_sum"),
        helper.make_node("Add", ["s", "x0"], ["y"], name="the_add"),
    ]
    graph = helper.make_graph(
        nodes, "sum4", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def chain_model(path: Path) -> Path:
    """The model of the committed chain logs (a CPU Sum between two GPU Adds: copies in both directions)."""
    ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 3]) for i in range(4)]
    nodes = [
        helper.make_node("Add", ["x0", "x1"], ["a"], name="/pre/Add"),
        helper.make_node("Sum", ["a", "x2", "x3", "x0"], ["s"], name="/dec/Sum (4 inputs)"),
        helper.make_node("Add", ["s", "x1"], ["y"], name="/post/Add"),
    ]
    graph = helper.make_graph(
        nodes, "chain", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def gathernd5_model(path: Path, p: int = 8) -> Path:
    """Rank-5 GatherND(batch_dims=2), the exporter's [B,G,Hp,Wp,C] layout: JSEP's shader fails to compile."""
    graph = helper.make_graph(
        [helper.make_node("GatherND", ["data", "idx"], ["y"], name="gnd", batch_dims=2)],
        "gathernd5",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 1, 6, 6, 4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 1, p, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, p, 4])],
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


# ------------------------------------------------------------------------------------------------ parser


@pytest.mark.parametrize(
    "fixture, gpu_ep",
    [
        ("placement_node_chain.log", "WebGpuExecutionProvider"),
        ("placement_browser_webgpu_chain.log", "WebGpuExecutionProvider"),
        ("placement_browser_jsep_chain.log", "JsExecutionProvider"),
    ],
)
def test_parse_chain_logs(fixture: str, gpu_ep: str) -> None:
    s = parse_ort_log((FIXTURES / fixture).read_text().splitlines())
    assert s.placement_logged and s.nodes_listed
    assert s.gpu_provider == gpu_ep
    assert s.nodes_by_provider == {"CPUExecutionProvider": 1, gpu_ep: 5}
    assert s.cpu_nodes == 1 and s.total_nodes == 6
    assert s.cpu_ops == {"Sum": 1}
    # the node name contains a space and parentheses: the outermost parentheses delimit it
    assert s.cpu_node_names == ["/dec/Sum (4 inputs)"]
    assert s.nodes_by_provider_op[gpu_ep] == {"Add": 2, "MemcpyFromHost": 2, "MemcpyToHost": 1}
    assert s.memcpy == 3
    assert s.memcpy_by_kind == {"MemcpyFromHost": 2, "MemcpyToHost": 1}
    assert s.memcpy_tensors == ["x0", "s", "a"]
    assert s.memcpy_provider == gpu_ep
    # GetCapability runs twice per session: the repeated report is deduplicated
    assert s.kernel_not_found == [{"op": "Sum", "node": "/dec/Sum (4 inputs)"}]


def test_parse_memcpy_count_matches_listed_memcpy_nodes() -> None:
    """``memcpy`` counts AddCopyNode lines; on a listed log it must equal the Memcpy nodes in the lists."""
    for f in FIXTURES.glob("placement_*chain.log"):
        s = parse_ort_log(f.read_text())
        listed = sum(
            n for ops in s.nodes_by_provider_op.values() for op, n in ops.items() if op.startswith("Memcpy")
        )
        assert listed == s.memcpy, f


def test_parse_all_nodes_on_one_ep() -> None:
    s = parse_ort_log((FIXTURES / "placement_node_all_gpu.log").read_text().splitlines())
    assert s.placement_logged and not s.nodes_listed
    assert s.nodes_by_provider == {"WebGpuExecutionProvider": 1}
    assert s.cpu_nodes == 0 and s.memcpy == 0 and s.cpu_ops == {} and s.kernel_not_found == []
    assert s.gpu_provider == "WebGpuExecutionProvider"


def test_parse_strips_ansi_and_ignores_noise() -> None:
    lines = [
        "[V,2026-11-30T13:45:45.802Z][WebGPU] GpuDataManager.create(size=24) => id=1",
        "        index += i32(uniforms.input_dims[input_dim_idx]);",  # shader source from JSEP debug output
        "\x1b[0;93m2026-11-30 13:50:19.976 [V:onnxruntime:, session_state.cc:1377 "
        "VerifyEachNodeIsAssignedToAnEp] Node placements\x1b[m",
        "2026-11-30 13:50:19.976 [V:onnxruntime:, session_state.cc:1383 VerifyEachNodeIsAssignedToAnEp]  "
        "Node(s) placed on [CPUExecutionProvider]. Number of nodes: 2",
        "2026-11-30 13:50:19.976 [V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   "
        "Clip (/m/Clip)",
        "2026-11-30 13:50:19.976 [V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   "
        "Clip (/m/Clip_1)",
        "\x1b[0;93m2026-11-30 13:50:19.976 [W:onnxruntime:, session_state.cc:1397 "
        "VerifyEachNodeIsAssignedToAnEp]"
        " Some nodes were not assigned to the preferred execution providers\x1b[m",
        "2026-11-30 13:50:19.976 [V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   "
        "Stray (after the list ended)",
    ]
    s = parse_ort_log(lines)
    assert s.nodes_by_provider == {"CPUExecutionProvider": 2}
    assert s.cpu_ops == {"Clip": 2}
    assert s.cpu_node_names == ["/m/Clip", "/m/Clip_1"]


def test_parse_empty_log() -> None:
    s = parse_ort_log([])
    assert not s.placement_logged and s.nodes_by_provider == {} and s.gpu_provider is None


def test_placement_keys_and_json_roundtrip() -> None:
    s = parse_ort_log((FIXTURES / "placement_node_chain.log").read_text())
    p = Placement(
        runtime="node",
        bundle=None,
        session_ok=True,
        error=None,
        log=s,
        adapter=None,
        run=None,
    )
    d = json.loads(p.to_json())
    assert REQUIRED_KEYS <= set(d)
    assert Placement.from_dict(d) == p
    assert (d["cpu_nodes"], d["memcpy"], d["total_nodes"]) == (s.cpu_nodes, s.memcpy, s.total_nodes) == (
        p.cpu_nodes, p.memcpy, p.total_nodes)
    with pytest.raises(AttributeError):
        p.cpu_nodes = 0  # type: ignore[misc]  # frozen


def test_compare_outputs_is_bytewise() -> None:
    ref = {"y": np.array([0.0, 1.0, np.nan], np.float32)}
    same = compare_outputs({"y": ref["y"].copy()}, ref)["y"]
    assert same["identical"] and same["max_abs_diff"] == 0.0
    negzero = compare_outputs({"y": np.array([-0.0, 1.0, np.nan], np.float32)}, ref)["y"]
    assert not negzero["identical"] and negzero["max_abs_diff"] == 0.0  # equal values, different bytes
    off = compare_outputs({"y": np.array([0.0, 1.5, 2.0], np.float32)}, ref)["y"]
    assert not off["identical"] and off["max_abs_diff"] == 0.5 and off["nonfinite_mismatch"] == 1
    shape = compare_outputs({"y": np.zeros((1, 3), np.float32)}, ref)["y"]
    assert not shape["identical"] and shape["max_abs_diff"] is None
    missing = compare_outputs({}, ref)["y"]
    assert missing["missing"] and not missing["identical"]


def test_make_inputs_seeded(tmp_path: Path) -> None:
    model = onnx.load(str(gathernd5_model(tmp_path / "g.onnx")))
    a, _ = make_inputs(model, seed=3)
    b, _ = make_inputs(model, seed=3)
    c, _ = make_inputs(model, seed=4)
    assert a.keys() == {"data", "idx"}
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["data"], c["data"])
    assert a["data"].dtype == np.float32 and a["data"].min() >= 0 and a["data"].max() < 1
    assert a["idx"].dtype == np.int64 and a["idx"].min() >= 0 and a["idx"].max() < 4


def test_missing_setup_names_the_setup_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(runtimes, "IN_TREE", tmp_path / "nowhere")
    msg = missing_setup("node")
    assert msg is not None and "run `deform-surgeon setup`" in msg and "\n" not in msg
    assert "deform-surgeon setup --browser" in (missing_setup("browser") or "")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="deform-surgeon")
    PlacementTool().add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.tool.run(args)


def test_cli_missing_model_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    assert _cli(["placement", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]
    assert _cli(["placement", "--compare", str(missing), str(missing)]) == 2
    assert _cli(["placement"]) == 2


def test_cli_not_an_onnx_file_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert _cli(["placement", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- real runtimes

GPU_EP = {
    "node": "WebGpuExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "jsep": "JsExecutionProvider",
}


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
@pytest.mark.parametrize("runtime, bundle", [("node", None), ("browser", "webgpu"), ("browser", "jsep")])
def test_sum_is_on_cpu_with_memcpy(runtime: str, bundle: str | None, tmp_path: Path) -> None:
    p = measure_placement(
        sum_model(tmp_path / "sum.onnx"), runtime=runtime, bundle=bundle or "webgpu", timeout=120
    )
    assert p.session_ok, p.error
    ep = GPU_EP[bundle or "node"]
    assert p.gpu_provider == ep
    assert p.bundle == bundle
    assert p.cpu_nodes == 1 and p.cpu_ops == {"Sum": 1} and p.cpu_node_names == ["the_sum"]
    assert p.memcpy == 2 and sorted(p.memcpy_tensors) == ["s", "x0"]  # x0 feeds both EPs; s comes back
    assert p.nodes_by_provider == {"CPUExecutionProvider": 1, ep: 3}
    assert {"op": "Sum", "node": "the_sum"} in p.kernel_not_found
    assert p.adapter is not None and p.adapter["limits"]["maxBufferSize"] > 0
    assert p.adapter["limits"]["maxStorageBufferBindingSize"] > 0
    assert p.adapter["limits"]["maxComputeWorkgroupStorageSize"] > 0
    assert p.run is None


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_gathernd5_jsep_shader_failure_is_reported(tmp_path: Path) -> None:
    """With ort.env.debug = true, JSEP rejects run() on the WGSL error: it must reach Placement.run
    verbatim."""
    p = measure_placement(
        gathernd5_model(tmp_path / "g.onnx"), runtime="browser", bundle="jsep", run=True, timeout=120
    )
    assert p.session_ok, p.error
    assert p.cpu_nodes == 0 and p.nodes_by_provider == {"JsExecutionProvider": 1}  # "placed" on the GPU ...
    assert p.run is not None and not p.run["ok"]  # ... but cannot run there
    assert "Error while parsing WGSL" in p.run["error"]
    assert "no matching constructor for 'i32(vec4<u32>)'" in p.run["error"]
    assert not p.ok


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_gathernd5_jsep_without_debug_is_still_a_failure(tmp_path: Path) -> None:
    """docs/runtime-facts.md section 3: without ort.env.debug the run resolves; the uncaptured error must fail it."""
    p = measure_placement(
        gathernd5_model(tmp_path / "g.onnx"),
        runtime="browser",
        bundle="jsep",
        run=True,
        jsep_debug=False,
        timeout=120,
    )
    assert p.session_ok, p.error
    assert p.run is not None and not p.run["ok"]
    assert "uncaptured WebGPU error" in p.run["error"] and "Error while parsing WGSL" in p.run["error"]
    assert any("no matching constructor" in e for e in p.run["gpu_errors"])


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
@pytest.mark.parametrize("runtime, bundle", [("node", None), ("browser", "webgpu")])
def test_gathernd5_native_ep_matches_cpu(runtime: str, bundle: str | None, tmp_path: Path) -> None:
    p = measure_placement(
        gathernd5_model(tmp_path / "g.onnx"),
        runtime=runtime,
        bundle=bundle or "webgpu",
        run=True,
        seed=1,
        timeout=120,
    )
    assert p.session_ok, p.error
    assert p.nodes_by_provider == {"WebGpuExecutionProvider": 1}
    assert p.run is not None and p.run["ok"], p.run
    assert p.run["identical"] is True
    out = p.run["outputs"]["y"]
    assert out == {**out, "identical": True, "max_abs_diff": 0.0, "dtype": "float32", "shape": [1, 1, 8, 4]}


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_cli_json_and_device_limits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = sum_model(tmp_path / "sum.onnx")
    out, lim = tmp_path / "p.json", tmp_path / "limits.json"
    assert _cli(["placement", str(model), "--run", "--json", str(out), "--device-limits-out", str(lim)]) == 0
    text = capsys.readouterr()
    assert "CPU nodes: 1" in text.out and "Sum" in text.out and "identical" in text.out
    assert "creating session" in text.err  # progress on stderr
    d = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(d) and d["cpu_nodes"] == 1 and d["run"]["outputs"]["y"]["identical"]
    assert json.loads(lim.read_text())["limits"]["maxBufferSize"] > 0
    assert _cli(["placement", "--compare", str(model), str(model)]) == 0
    assert "CPU nodes" in capsys.readouterr().out


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_timeout_stops_every_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout is reported as an error and leaves no browser/harness behind (found by our temp dir)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    p = measure_placement(sum_model(tmp_path / "sum.onnx"), runtime="browser", bundle="webgpu", timeout=1.0)
    assert not p.session_ok and p.error is not None and "timed out after 1 s" in p.error
    time.sleep(0.5)
    leftovers = [pid for pid in harness_mod._pids_with_marker(str(tmp_path)) if _alive(pid)]
    assert leftovers == []
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("ds-placement-")]


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie waiting to be reaped by init."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_env_of_node_harness(tmp_path: Path) -> None:
    env = runtimes.harness_env(tmp_path)
    assert env["VK_ICD_FILENAMES"].endswith("vk_swiftshader_icd.json")
    assert os.access(env["XDG_RUNTIME_DIR"], os.W_OK)


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_lowered_gathernd5_runs_on_jsep_and_matches_cpu(tmp_path: Path) -> None:
    """The exporter's sampling step: rank-5 GatherND fails on JSEP as exported; after `patch` it runs there, fully
    on the GPU, and its outputs equal ORT CPU's byte for byte."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from helpers.graphs import exporter_like

    import deform_surgeon as ds

    original = _save(exporter_like(H=6, W=6, C=4, P=8, with_sum=False), tmp_path / "sampling.onnx")
    patched = tmp_path / "sampling.patched.onnx"
    ds.patch(original, patched, verify=True)
    before = measure_placement(original, runtime="browser", bundle="jsep", run=True, timeout=120)
    assert before.run is not None and not before.run["ok"] and "WGSL" in before.run["error"]
    after = measure_placement(patched, runtime="browser", bundle="jsep", run=True, timeout=120)
    assert after.cpu_nodes == 0 and after.memcpy == 0, after.cpu_ops
    assert after.run is not None and after.run["ok"] and after.run["identical"], after.run


@pytest.mark.webgpu
def test_placement_run_timeout_is_reported_as_what_happened(tmp_path):
    """The session is created in about a second; the original 1024 fixture's run takes 15-30 s on the software
    adapter (CPU fallback): with --timeout 8 the report says the session was created and the run timed out, and
    the run is FAILED even if its result lands while the harness is being stopped (CI once saw both)."""
    from deform_surgeon.webgpu.placement import missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    proc = run("placement", FIXTURES / "decoder_gathernd_1024.onnx", "--run", "--timeout", "8", "--json", "p.json",
               cwd=tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"^session: ok in \d+\.\d+ s$", proc.stdout, re.M), proc.stdout
    assert "session creation failed" not in proc.stdout
    assert re.search(r"session created in \d+\.\d+ s, then the run timed out after 8 s", proc.stdout), proc.stdout
    assert re.search(r"^run:\s+FAILED", proc.stdout, re.M), proc.stdout


def _expand_model(path: Path, n: int) -> Path:
    """x [1] expanded to n floats, then reduced: a run that holds n * 4 bytes at once."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["big"], name="expand"),
         helper.make_node("ReduceMax", ["big"], ["y"], name="reduce", keepdims=0)],
        "expand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [onnx.numpy_helper.from_array(np.array([n], np.int64), "shape")])
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_wasm_bundle_runs_on_the_cpu_backend_and_reads_its_heap(tmp_path: Path) -> None:
    """--bundle wasm: onnxruntime-web's CPU backend in Chromium. A patched deform fixture runs there with the
    original's bytes (and close to ORT CPU's, whose kernels sum in another order); the heap read after the run
    holds what the run needed at once (an Expand to 300 M floats: 1.2 GB)."""
    patched = tmp_path / "decoder.patched.onnx"
    ds.patch(FIXTURES / "decoder_gathernd.onnx", patched)
    runs = [measure_placement(m, runtime="browser", bundle="wasm", run=True, timeout=300)
            for m in (FIXTURES / "decoder_gathernd.onnx", patched)]
    for p in runs:
        assert p.session_ok and p.run["ok"], (p.error, p.run)
        assert p.bundle == "wasm" and p.cpu_nodes == p.total_nodes and not p.memcpy  # every node on the CPU EP
        (out,) = p.run["outputs"].values()
        assert out["max_abs_diff"] is not None and out["max_abs_diff"] < 1e-4, out
        assert 0 < p.wasm_heap["after_session"]["bytes"] <= p.wasm_heap["after_run"]["bytes"] <= 4294901760
    assert runs[0].run["outputs"]["mask"]["sha256"] == runs[1].run["outputs"]["mask"]["sha256"]
    table = format_comparison(*runs)
    assert "wasm heap after the session" in table and "wasm heap after the run" in table, table
    big = measure_placement(_expand_model(tmp_path / "expand.onnx", 300_000_000), runtime="browser",
                            bundle="wasm", run=True, timeout=300)
    assert big.run["ok"] and big.wasm_heap["after_session"]["bytes"] < 10**8 <= 1.2e9 \
        <= big.wasm_heap["after_run"]["bytes"], big.wasm_heap
    assert "wasm heap: " in format_placement(big) and "after the run" in format_placement(big)
