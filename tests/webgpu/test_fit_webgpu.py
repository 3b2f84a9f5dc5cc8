"""Device fit on the real WebGPU runtimes: a model over the spec's 8 storage buffers per shader stage fails at run
time exactly where a user's GPU with those limits fails, placement names the node and the limit, and after
`patch` the same model runs, with outputs equal to ORT CPU's.

Runtimes: onnxruntime-node 1.30.0 (native WebGPU EP) and onnxruntime-web 1.30.0 in headless Chromium with both
bundles, all on SwiftShader. SwiftShader offers 12 storage buffers per stage; the browser page requests its
device with the profile's limits (spec-default: 8), so the browser runs fail at 8. onnxruntime-node creates its
own device with the adapter's 12: there a Split into 32 still fails (ORT binds 13), and the static check names
every node over 8.

Models: `wide_split` (one Split into 32 outputs, the smallest failing case) and `legacy_patches` at a quarter of
BiRefNet's size (image 256, patches 8..256: the same Split widths 32/16/8/4/1 and Concat widths 1024/256/64/16 as
BiRefNet's 2024 export at 1024, with 16x less data so that a run takes seconds; the full-size form is measured in
development and recorded in docs/device-profiles.md).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx
import pytest
from helpers.graphs import legacy_patches, wide_split

import deform_surgeon as ds
from deform_surgeon.base import js_runtimes as runtimes
from deform_surgeon.webgpu.placement import measure_placement, missing_setup
from deform_surgeon.webgpu.placement import runner as runner_mod

_SETUP = missing_setup()
pytestmark = [
    pytest.mark.webgpu,
    pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}"),
]

RUNTIMES = {"node": ("node", None), "browser/webgpu": ("browser", "webgpu"), "browser/jsep": ("browser", "jsep")}
MODELS = {"wide_split": wide_split, "legacy_patches": lambda: legacy_patches(image=256, levels=(8, 16, 32, 64, 256))}
GPU_ATOL = 1e-4  # Conv on a GPU sums its 3072 products in another order than ORT CPU (measured up to 4.6e-6)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Every measurement of this module, started at once on two workers; GPU outputs captured on the way."""
    tmp = tmp_path_factory.mktemp("fit_webgpu")
    paths = {}
    for name, build in MODELS.items():
        src, out = tmp / f"{name}.onnx", tmp / f"{name}.patched.onnx"
        onnx.save(build(), src)
        assert ds.patch(src, out, verify=True).written
        paths[name] = (src, out)
    eight = tmp / "split8.onnx"
    onnx.save(wide_split(n=8), eight)
    twelve = tmp / "twelve.json"
    twelve.write_text(json.dumps({"limits": {"maxStorageBuffersPerShaderStage": 12}}))

    jobs = {}
    with ThreadPoolExecutor(2) as pool:
        for name, (src, out) in paths.items():
            for rt, (runtime, bundle) in RUNTIMES.items():
                for kind, path in (("original", src), ("patched", out)):
                    jobs[(name, rt, kind)] = pool.submit(measure_placement, path, runtime, bundle, run=True,
                                                         timeout=300)
        for key, profile in (("spec-default", "spec-default"), ("twelve", str(twelve))):
            jobs[("split8", key)] = pool.submit(measure_placement, eight, "browser", "jsep", run=True,
                                                timeout=300, profile=profile)
        return {k: f.result() for k, f in jobs.items()}


@pytest.mark.parametrize("rt", RUNTIMES)
@pytest.mark.parametrize("name", MODELS)
def test_as_exported_fails_and_names_the_node_and_the_limit(measured, name, rt):
    p = measured[(name, rt, "original")]
    assert p.session_ok and not p.ok  # ORT places every node on the GPU ...
    assert p.cpu_nodes == 0 and p.memcpy == 0
    assert p.run is not None and not p.run["ok"]  # ... and the run fails on the limit
    assert "storage buffers" in p.run["error"]
    widest = max(p.limit_violations, key=lambda v: v.get("count", 0))
    assert widest["kind"] == "storage_buffers" and widest["limit"] == "maxStorageBuffersPerShaderStage 8"
    expected = {"wide_split": "wide_split", "legacy_patches": "Concat_l0_patches"}[name]
    assert widest["node"] == expected
    assert p.device_profile["name"] == "spec-default"


@pytest.mark.parametrize("rt", RUNTIMES)
@pytest.mark.parametrize("name", MODELS)
def test_patched_runs_and_matches_ort_cpu(measured, name, rt):
    p = measured[(name, rt, "patched")]
    assert p.ok, (p.error, p.run and p.run.get("error"))
    assert p.cpu_nodes == 0 and p.memcpy == 0 and p.limit_violations == []
    outputs = p.run["outputs"]
    assert outputs and all(o["max_abs_diff"] is not None for o in outputs.values())
    if name == "wide_split":  # data movement only: the same bytes as ORT CPU
        assert all(o["identical"] for o in outputs.values())
    else:
        assert max(o["max_abs_diff"] for o in outputs.values()) < GPU_ATOL
    if rt.startswith("browser"):
        assert p.applied_limits["maxStorageBuffersPerShaderStage"] == 8
        assert p.applied_limits["maxBufferSize"] == 256 * 2**20


def test_the_browser_device_gets_the_profiles_limits(measured):
    """A Split into 8 (9 buffers) runs under a 12-buffer profile (clamped to what Chromium's SwiftShader adapter
    offers: 10) and fails under spec-default: the profile, not the adapter, decides."""
    strict, generous = measured[("split8", "spec-default")], measured[("split8", "twelve")]
    assert not strict.ok and "exceeds the maximum per-stage limit (8)" in strict.run["error"]
    assert strict.limit_violations[0]["count"] == 9
    assert generous.ok and generous.limit_violations == []
    offered = generous.adapter["limits"]["maxStorageBuffersPerShaderStage"]
    assert offered >= 9 and generous.applied_limits["maxStorageBuffersPerShaderStage"] == min(12, offered)
    assert generous.run["identical"]


def test_limit_violations_are_read_from_the_graph(tmp_path):
    """The static check needs no runtime: it is what placement reports next to ORT's log."""
    src = tmp_path / "w.onnx"
    onnx.save(wide_split(), src)
    (v,) = runner_mod.limit_violations(Path(src), ds.resolve_profile("spec-default"), "node", None)
    assert v == {"kind": "storage_buffers", "node": "wide_split", "op": "Split", "count": 33,
                 "limit": "maxStorageBuffersPerShaderStage 8"}


def test_adapter_profile_is_this_machines_adapter():
    """`--device-profile adapter` reads the limits of the adapter the node runtime gets (SwiftShader here)."""
    adapter, error = runtimes.probe_adapter()
    assert error is None and adapter is not None
    profile = ds.resolve_profile("adapter")
    assert profile.name == "adapter" and profile.adapter == adapter
    assert profile.storage_buffers == adapter["limits"]["maxStorageBuffersPerShaderStage"] >= 8
    assert profile.max_buffer == adapter["limits"]["maxBufferSize"]
