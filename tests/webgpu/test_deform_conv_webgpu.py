"""A lowered ONNX `DeformConv` on the real WebGPU runtimes: the original runs on the CPU EP with Memcpy (no WebGPU EP
has a DeformConv kernel), the patched model has no CPU node and no Memcpy, and its outputs stay within the
tolerance of a GPU Conv against ORT CPU (docs/deformconv.md has the measured differences).

The model is a `DeformableConv2d` layer as torch's dynamo exporter writes it (offset and mask Convs, Sigmoid,
DeformConv, Relu; tests/helpers/graphs.py `deform_conv(offset_conv=True)`), with groups and offset groups, its
weights in `<name>.onnx.data` as torch writes them.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from helpers.graphs import deform_conv

import deform_surgeon as ds
from deform_surgeon.webgpu.placement import measure_placement, missing_setup
from deform_surgeon.webgpu.placement.command import per_block

_SETUP = missing_setup()
pytestmark = [
    pytest.mark.webgpu,
    pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}"),
]
TIMEOUT = 420.0
CPU_TOLERANCE = 1e-5
BLOCK = "DeformConv 'node_deform_conv2d' (deform.weight)"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("deform_conv_webgpu")
    original = folder / "dynamo.onnx"
    onnx.save(deform_conv(c=8, m=8, h=16, w=16, group=2, offset_group=2, offset_conv=True), original,
              save_as_external_data=True, location="dynamo.onnx.data", size_threshold=0)
    report = ds.patch(original, folder / "patched.onnx")
    assert report.written and [a.action for a in report.actions] == ["rewritten"]
    assert (folder / "patched.onnx.data").is_file()
    return original, folder / "patched.onnx"


def test_original_deform_conv_runs_on_the_cpu_ep(models: tuple[Path, Path]) -> None:
    p = measure_placement(models[0], runtime="node", timeout=TIMEOUT)
    assert p.session_ok and p.cpu_ops == {"DeformConv": 1} and p.memcpy > 0, p.to_dict()
    assert per_block(p)[BLOCK] == (1, p.memcpy)


@pytest.mark.parametrize("runtime, bundle", [("node", None), ("browser", "webgpu"), ("browser", "jsep")])
def test_patched_deform_conv_is_gpu_resident(models: tuple[Path, Path], runtime: str, bundle: str | None) -> None:
    run = runtime == "node"  # the browsers' sessions are enough for placement; node also runs it
    p = measure_placement(models[1], runtime=runtime, bundle=bundle or "webgpu", timeout=TIMEOUT, run=run)
    assert p.session_ok and p.cpu_nodes == 0 and p.memcpy == 0 and p.cpu_ops == {}, p.to_dict()
    assert per_block(p)[BLOCK] == (0, 0)
    if run:
        assert p.run is not None and p.run["ok"], p.run
        diffs = [o["max_abs_diff"] for o in p.run["outputs"].values()]
        assert diffs and all(d is not None and d <= CPU_TOLERANCE for d in diffs), p.run["outputs"]
