"""transformers.js as the real client: a BiRefNet-shaped model folder (config.json of model type `birefnet`, a
preprocessor config, `onnx/model.onnx` and `onnx/model_fp16.onnx`) loaded in headless Chromium with
`pipeline('background-removal', MODEL, {device: 'webgpu', dtype})`, the way pages run BiRefNet, from a local server
with remote models off. Placement is read from ORT's own verbose log (through the pipeline's session options);
the run compares the model's output on the pipeline's preprocessed input with ORT CPU, and the returned mask with
the one ORT CPU's output gives. The patched folder is what `batch DIR OUTDIR --external-data always` writes: the
weights in `model.onnx_data`, which transformers.js fetches only because the written config.json says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES

from deform_surgeon.checks.verdict import combine, judge_outputs
from deform_surgeon.webgpu.placement.runner import ModelFolder, measure_placement

CMD = [sys.executable, "-m", "deform_surgeon"]

pytestmark = pytest.mark.webgpu

PREPROCESSOR = {"feature_extractor_type": "ImageFeatureExtractor", "do_normalize": True, "do_rescale": True,
                "do_resize": True, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
                "resample": 2, "rescale_factor": 1 / 255, "size": {"height": 64, "width": 64}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(original, patched) model folders."""
    root = tmp_path_factory.mktemp("tjs")
    original = root / "original"
    (original / "onnx").mkdir(parents=True)
    (original / "onnx" / "model.onnx").write_bytes((FIXTURES / "decoder_gathernd.onnx").read_bytes())
    (original / "onnx" / "model_fp16.onnx").write_bytes((FIXTURES / "decoder_gathernd_fp16.onnx").read_bytes())
    (original / "config.json").write_text(json.dumps({"architectures": ["BiRefNet"], "model_type": "birefnet"}))
    (original / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    patched = root / "patched"
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "batch", original, patched, "--verify",
                           "--iterations", "1", "--external-data", "always", "--no-progress"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return original, patched


def _placement(folder: Path, run: bool = False, float16: bool = False):
    """The placement through transformers.js; `float16`: on an adapter without shader-f16 (the software one) the
    session fails after ORT placed the nodes (the log has the placement), at its first float16 shader."""
    p = measure_placement(folder, runtime="browser", bundle="transformers", run=run, timeout=1200)
    no_f16 = "shader-f16" not in ((p.adapter or {}).get("features") or [])
    assert p.session_ok or (float16 and no_f16 and "requires f16 but the device does not support it" in p.error), \
        p.error
    assert p.versions.get("transformers.js") == "4.3.1", p.versions
    assert p.placement_logged, "ORT's verbose log did not come through transformers.js's session options"
    return p


def test_the_original_leaves_its_deform_blocks_on_the_cpu(folders):
    p = _placement(folders[0])
    assert p.cpu_nodes > 0 and p.memcpy > 0
    assert {"Sum", "Clip"} <= set(p.cpu_ops)


def test_the_patched_folder_loads_as_written_runs_on_the_gpu_and_agrees(folders):
    _, patched = folders
    config = json.loads((patched / "config.json").read_text())
    assert config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1, "model_fp16.onnx": 1}
    assert (patched / "onnx" / "model.onnx_data").is_file()
    p = _placement(patched, run=True)
    assert (p.cpu_nodes, p.memcpy) == (0, 0), p.cpu_ops
    assert p.run["ok"], p.run["error"]
    verdict = combine(judge_outputs(p.run["outputs"], same_runtime=False).values())
    assert verdict is not None and verdict.passed, verdict.text if verdict else p.run
    mask = p.run["mask"]
    assert mask["shape"] == [64, 64]
    assert mask["max_level_diff"] is not None and mask["max_level_diff"] <= 1, mask


@pytest.mark.parametrize("which, cpu", [(0, True), (1, False)], ids=["original", "patched"])
def test_the_float16_file_places_through_the_same_pipeline(folders, which, cpu):
    """Placement only: the software adapter has no shader-f16, so it cannot run a float16 model (transformers.js
    refuses dtype 'fp16' there before loading, so the harness names the file instead, see transformers_page.mjs; and
    its onnxruntime-web then fails the session at its first float16 shader, after the placement is logged)."""
    folder = ModelFolder.of(folders[which] / "onnx" / "model_fp16.onnx")
    assert (folder.file_name, folder.dtype) == ("model_fp16", "fp16")
    p = _placement(folder.model, float16=True)
    assert (p.cpu_nodes > 0) is cpu and (p.memcpy > 0) is cpu


def test_a_file_outside_a_model_folder_is_refused(tmp_path):
    (tmp_path / "model.onnx").write_bytes((FIXTURES / "decoder_gathernd.onnx").read_bytes())
    proc = subprocess.run([*CMD, "placement", tmp_path / "model.onnx", "--runtime",
                           "browser", "--bundle", "transformers"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"deform-surgeon: error: {tmp_path / 'model.onnx'}: not in a transformers.js "
                                   "model folder (config.json beside onnx/, the model in onnx/, as `batch DIR OUTDIR` "
                                   "writes it); --bundle transformers loads such a folder")


def test_serve_runs_both_folders_through_the_pipeline_call(folders, tmp_path):
    """`serve ORIGINAL PATCHED --bundle transformers`: the page runs each folder through transformers.js's pipeline
    (the call shown on the page) and judges the session's outputs against ORT CPU and the patched against the
    original."""
    result = tmp_path / "serve.json"
    proc = subprocess.run([*CMD, "serve", *folders, "--bundle", "transformers", "--headless", result],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(result.read_text())
    assert r["bundle"] == "transformers" and r["versions"]["transformers.js"] == "4.3.1"
    original, patched = r["models"]
    call = "pipeline('background-removal', MODEL, {device: 'webgpu', dtype: 'fp32'})"
    assert original["call"] == patched["call"] == call
    assert original["placement"]["cpu_nodes"] > 0
    assert (patched["placement"]["cpu_nodes"], patched["placement"]["memcpy"]) == (0, 0)
    assert patched["ok"] and patched["verdict_vs_cpu"]["passed"], patched["error"]
    assert patched["verdict_vs_original"]["kind"] == "byte-identical"
    assert [o["kind"] for o in patched["image_outputs"]] == ["mask", "cutout"]


def test_serve_refuses_the_transformers_bundle_for_a_plain_file(tmp_path):
    proc = subprocess.run([*CMD, "serve", FIXTURES / "decoder_gathernd.onnx", "--bundle", "transformers", "--headless",
                           tmp_path / "r.json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    named = (FIXTURES / "decoder_gathernd.onnx").resolve()
    assert proc.stderr.strip().startswith(f"deform-surgeon serve: error: {named}: --bundle transformers runs model")
    assert not (tmp_path / "r.json").exists()
