"""`deform-surgeon serve`: the local page that runs original and patched side by side.

The server is exercised over real HTTP (what it serves and refuses, ORT's log parsed by the placement parser, the
page's outputs compared with ORT CPU in Python), the command's bad input and its clean stop on SIGINT/SIGTERM, and,
marked ``webgpu``, the page itself in headless Chromium on SwiftShader: both models run, and the test reads the
page's own result JSON (not pixels).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from deform_surgeon.base import js_runtimes as runtimes
from deform_surgeon.graph.device import SPEC_DEFAULT_LIMITS, resolve_profile
from deform_surgeon.webgpu.placement.logparse import parse_ort_log
from deform_surgeon.webgpu.serve.server import GPU_TOLERANCE, ServeApp, ServedModel, make_server

FIXTURES = Path(__file__).parents[1] / "fixtures"
ORIGINAL = FIXTURES / "decoder_gathernd.onnx"


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deform_surgeon import patch

    out = tmp_path_factory.mktemp("serve") / "decoder_gathernd.patched.onnx"
    patch(str(ORIGINAL), str(out))
    return out


@pytest.fixture
def server(tmp_path: Path, patched: Path):
    """A server for the fixture and its patched model, with a stand-in onnxruntime-web folder (two files)."""
    web = tmp_path / "onnxruntime-web"
    (web / "dist").mkdir(parents=True)
    (web / "dist" / "ort.min.mjs").write_text("export const x = 1;\n")
    (web / "package.json").write_text('{"version": "1.30.0"}')
    app = ServeApp([ServedModel.load("original", ORIGINAL), ServedModel.load("patched", patched)],
                   resolve_profile("spec-default"), ort_web=web)
    srv = make_server(app)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _request(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             host: str | None = None) -> tuple[int, bytes]:
    port = srv.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", host or f"127.0.0.1:{port}")
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body or b"")))
    conn.endheaders(body)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def test_serves_its_page_models_and_runtime_files(server, patched: Path) -> None:
    for path in ("/", "/serve_page.mjs", "/browser_device.mjs", "/harness_node_and_page.mjs", "/sample.png",
                 "/ort/ort.min.mjs"):
        status, _ = _request(server, "GET", path)
        assert status == 200, path
    assert _request(server, "GET", "/model/original.onnx") == (200, ORIGINAL.read_bytes())
    assert _request(server, "GET", "/model/patched.onnx") == (200, patched.read_bytes())
    config = json.loads(_request(server, "GET", "/config.json")[1])
    assert [m["label"] for m in config["models"]] == ["original", "patched"]
    assert config["models"][0]["inputs"] == [{"name": "image", "dtype": "float32", "dims": [1, 3, 64, 64]}]
    assert config["profile"]["name"] == "spec-default" and config["profile"]["limits"] == SPEC_DEFAULT_LIMITS
    assert config["bundles"] == ["webgpu", "jsep", "wasm"] and config["tolerance"] == GPU_TOLERANCE


def test_default_profile_is_the_browser_adapters_own(tmp_path: Path) -> None:
    """The page, not the server, knows the adapter: `limits: null` tells it to request every limit it offers."""
    web = tmp_path / "onnxruntime-web"
    web.mkdir()
    app = ServeApp([ServedModel.load("original", ORIGINAL)], None, ort_web=web)
    assert app.config()["profile"]["name"] == "adapter" and app.config()["profile"]["limits"] is None
    assert app.versions["onnxruntime-web (served)"] == "?"


@pytest.mark.parametrize("path", ["/ort/..%2f..%2fsetup.cfg", "/external/original/../../setup.cfg",
                                  "/external/original/decoder_gathernd.onnx", "/model/other.onnx",
                                  "/etc/passwd", "/ort/"])
def test_serves_nothing_else(server, path: str) -> None:
    status, _ = _request(server, "GET", path)
    assert status in (403, 404)


def test_refuses_other_hosts(server) -> None:
    """A page of another site reaching 127.0.0.1 through its own DNS name gets nothing."""
    port = server.server_address[1]
    assert _request(server, "GET", "/config.json", host=f"attacker.example:{port}")[0] == 403
    assert _request(server, "POST", "/logparse", b"", host=f"attacker.example:{port}")[0] == 403


def test_log_is_parsed_by_the_placement_parser(server) -> None:
    log = (FIXTURES / "placement_browser_jsep_chain.log").read_text()
    status, body = _request(server, "POST", "/logparse", log.encode())
    assert status == 200
    got, want = json.loads(body), parse_ort_log(log)
    assert got["cpu_nodes"] == want.cpu_nodes > 0 and got["memcpy"] == want.memcpy > 0
    assert got["total_nodes"] == want.total_nodes and got["gpu_provider"] == want.gpu_provider


def _compare(server, label: str, image: np.ndarray, output: np.ndarray) -> dict:
    layout = {"input": {"name": "image", "dtype": "float32", "dims": list(image.shape)},
              "outputs": [{"name": "mask", "dtype": "float32", "dims": list(output.shape)}]}
    status, body = _request(server, "POST", f"/compare/{label}", image.tobytes() + output.tobytes(),
                            {"X-Layout": json.dumps(layout)})
    assert status == 200, body
    return json.loads(body)


def test_outputs_are_compared_with_ort_cpu_and_the_original(server, patched: Path) -> None:
    image = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    cpu = ort.InferenceSession(str(ORIGINAL), providers=["CPUExecutionProvider"]).run(None, {"image": image})[0]
    r = _compare(server, "original", image, cpu)
    assert r["vs_cpu"]["mask"]["identical"] and r["vs_cpu"]["mask"]["max_abs_diff"] == 0
    assert r["within_tolerance"] and "vs_original" not in r

    off = cpu.copy()
    off.flat[7] += 0.25
    r = _compare(server, "patched", image, off)
    assert r["vs_cpu"]["mask"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert r["vs_cpu"]["mask"]["mismatched_elements"] == 1 and not r["within_tolerance"]
    assert r["identical_to_original"] is False and r["vs_original"]["mask"]["mismatched_elements"] == 1

    r = _compare(server, "patched", image, cpu)
    assert r["identical_to_original"] is True and r["within_tolerance"]


def test_compare_refuses_a_body_that_does_not_match_its_layout(server) -> None:
    layout = {"input": {"name": "image", "dtype": "float32", "dims": [1, 3, 64, 64]}, "outputs": []}
    status, body = _request(server, "POST", "/compare/original", b"\0" * 12,
                            {"X-Layout": json.dumps(layout)})
    assert status == 400 and "too short" in json.loads(body)["error"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = _cli(str(FIXTURES / "no_deform.onnx"))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"deform-surgeon serve: error: {(FIXTURES / 'no_deform.onnx').resolve()}: input 'x' "
                                "has shape [2, 3]; an image input is 1x3xHxW")
    r = _cli(str(tmp_path / "missing.onnx"))
    assert r.returncode == 2 and "missing.onnx: no such file" in r.stderr
    (tmp_path / "text.onnx").write_text("not a model")
    r = _cli(str(tmp_path / "text.onnx"))
    assert r.returncode == 2 and "not a readable ONNX model" in r.stderr
    r = _cli(str(ORIGINAL), "--headless", str(ORIGINAL))
    assert r.returncode == 2 and "output path is one of the models" in r.stderr
    for flag in ("--no-webgpu", "--screenshot"):  # each only means something for the headless page
        r = _cli(str(ORIGINAL), *([flag] if flag == "--no-webgpu" else [flag, str(tmp_path / "p.png")]))
        assert r.returncode == 2 and r.stderr.strip().endswith(f"{flag} needs --headless RESULT.json"), r.stderr


needs_runtimes = pytest.mark.skipif(runtimes.runtimes_dir() is None, reason="run `deform-surgeon setup` first")


@needs_runtimes
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stops_cleanly_on_a_signal(sig: signal.Signals, tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # SIGINT as a terminal delivers it, even when pytest itself runs in the background (where it is ignored)
    proc = subprocess.Popen([sys.executable, "-m", "deform_surgeon", "serve", str(ORIGINAL)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + proc.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
    # `import onnxruntime` (1.32) itself writes $TMPDIR/.ses on every import; nothing else may be there
    assert [p.name for p in tmp_path.iterdir() if p.name != ".ses"] == [], "no temp file left behind"


@pytest.mark.webgpu
@needs_runtimes
def test_page_runs_both_models_in_headless_chromium(tmp_path: Path, patched: Path) -> None:
    """The page on SwiftShader with `import 'onnxruntime-web/webgpu'` (where the unpatched GatherND form runs too):
    both models run without a WebGPU error, agree with ORT CPU within the tolerance, and with each other byte for
    byte; the patched one has no CPU node and no Memcpy."""
    result, shot = tmp_path / "result.json", tmp_path / "page.png"
    r = _cli(str(ORIGINAL), str(patched), "--headless", str(result), "--screenshot", str(shot), "--runs", "1",
             "--device-profile", "spec-default", timeout=900)  # the default bundle: onnxruntime-web/webgpu
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"] is True and doc["bundle_file"] == "ort.webgpu.min.mjs"
    assert doc["software_adapter"] is True and "not GPU timings" in doc["timing_note"]
    assert doc["adapter"]["architecture"] == "swiftshader"
    # the page requested ORT's device with the profile's limits, not the adapter's (10 storage buffers, 1 GiB)
    assert doc["profile"]["name"] == "spec-default" and doc["applied_limits"] == SPEC_DEFAULT_LIMITS
    original, patched_run = doc["models"]
    for m in (original, patched_run):
        assert m["ok"] and m["error"] is None and m["gpu_errors"] == []
        assert len(m["runs_ms"]) == 1 and m["min_ms"] <= m["median_ms"]
        assert m["session_create_s"] > 0 and m["placement"]["placement_logged"]
        assert m["outputs"] == [{"name": "mask", "dtype": "float32", "dims": [1, 1, 64, 64]}]
        assert 0 <= m["vs_cpu"]["mask"]["max_abs_diff"] <= GPU_TOLERANCE["float32"]
        assert m["verdict_vs_cpu"]["passed"] and m["verdict_vs_cpu"]["kind"] in ("byte-identical", "agrees")
        # the mask and the cutout at the sample's own size (256 x 256), each a PNG download
        assert [(o["kind"], o["width"], o["height"]) for o in m["image_outputs"]] == [
            ("mask", 256, 256), ("cutout", 256, 256)]
    assert original["placement"]["cpu_nodes"] > 0 and original["placement"]["memcpy"] > 0
    assert patched_run["placement"]["cpu_nodes"] == 0 and patched_run["placement"]["memcpy"] == 0
    assert patched_run["identical_to_original"] is True
    assert patched_run["vs_original"]["mask"]["max_abs_diff"] == 0
    assert patched_run["verdict_vs_original"]["text"] == "byte-identical (max |diff| 0)"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "software adapter: the timings below are not GPU timings" in r.stdout
    assert "patched vs the original: byte-identical (max |diff| 0)" in r.stdout
    v = original["verdict_vs_cpu"]
    assert f"original vs ORT CPU: {v['text']}" in r.stdout and f"max |diff| {v['max_abs_diff']:.3g}" in v["text"]


@pytest.mark.webgpu
@needs_runtimes
def test_a_model_the_adapter_cannot_run_is_a_failure(tmp_path: Path) -> None:
    """float16 on an adapter without shader-f16 (SwiftShader): the page reports ORT's error and the placement ORT
    logged before it, the result is not ok and the command exits 1; on an adapter with shader-f16 it runs."""
    result = tmp_path / "result.json"
    r = _cli(str(FIXTURES / "decoder_gathernd_fp16.onnx"), "--headless", str(result), "--bundle", "webgpu",
             "--runs", "1", timeout=900)
    doc = json.loads(result.read_text())
    (m,) = doc["models"]
    assert doc["input"] == {"name": "image", "dtype": "float16", "dims": [1, 3, 64, 64]}
    if "shader-f16" in doc["adapter"]["features"]:
        assert r.returncode == 0 and m["ok"] and m["vs_cpu"]["mask"]["max_abs_diff"] <= GPU_TOLERANCE["float16"]
        return
    assert r.returncode == 1 and doc["ok"] is False and m["ok"] is False
    assert "requires f16 but the device does not support it" in m["error"]
    assert m["runs_ms"] == [] and m["outputs"] == []
    assert m["placement"]["placement_logged"] and m["placement"]["cpu_nodes"] > 0
    assert "requires f16" in r.stdout
    hint = f"original: find where it goes wrong: deform-surgeon bisect {FIXTURES / 'decoder_gathernd_fp16.onnx'} " \
        "--runtime browser --bundle webgpu --device-profile adapter --seed 0"
    assert m["bisect_command"] in hint and hint in r.stdout


def test_serves_the_external_data_a_model_names_and_no_other_file(tmp_path: Path) -> None:
    import onnx

    model = onnx.load(str(ORIGINAL))
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(model, str(folder / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data",
              size_threshold=0)
    (folder / "secret.txt").write_text("not served")
    web = tmp_path / "onnxruntime-web"
    web.mkdir()
    app = ServeApp([ServedModel.load("original", folder / "ext.onnx")], None, ort_web=web)
    assert app.config()["models"][0]["external"] == [
        {"path": "ext.onnx.data", "url": "/external/original/ext.onnx.data"}]
    srv = make_server(app)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert _request(srv, "GET", "/external/original/ext.onnx.data") == (
            200, (folder / "ext.onnx.data").read_bytes())
        assert _request(srv, "GET", "/external/original/secret.txt")[0] == 403
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_model_folder_serves_only_what_the_pipeline_reads(tmp_path: Path) -> None:
    """A transformers.js folder at /models/<label>/: its two configs, the model file and the data file it names;
    `.env`, `.git/config`, a private note and another dtype's file are not served (they were: 200)."""
    import onnx

    folder = tmp_path / "birefnet"
    (folder / "onnx").mkdir(parents=True)
    (folder / ".git").mkdir()
    onnx.save(onnx.load(str(ORIGINAL)), str(folder / "onnx" / "model.onnx"), save_as_external_data=True,
              location="model.onnx_data", size_threshold=0)
    for name, text in (("config.json", "{}"), ("preprocessor_config.json", "{}"), (".env", "SECRET=1"),
                       (".git/config", "[core]"), ("notes_private.txt", "private"), ("onnx/model_q4.onnx", "x")):
        (folder / name).write_text(text)
    web = tmp_path / "onnxruntime-web"
    web.mkdir()
    app = ServeApp([ServedModel.load("original", folder)], None, ort_web=web)
    srv = make_server(app)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for rel in ("config.json", "preprocessor_config.json", "onnx/model.onnx", "onnx/model.onnx_data"):
            assert _request(srv, "GET", f"/models/original/{rel}") == (200, (folder / rel).read_bytes()), rel
        for rel in (".env", ".git/config", "notes_private.txt", "onnx/model_q4.onnx", "onnx/", "%2e%2e/x"):
            assert _request(srv, "GET", f"/models/original/{rel}")[0] == 404, rel
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_pages_inputs_go_to_a_folder_of_the_servers_own(tmp_path: Path) -> None:
    """Not a fixed shared /tmp/deform-surgeon-serve-inputs/<hash>.npz, which could be another user's file: a
    folder this process made, readable by its user only."""
    import stat

    from deform_surgeon.webgpu.serve.server import _save_input

    a = _save_input({"x": np.zeros(3, np.float32)}, "0123456789abcdef0123")
    b = _save_input({"x": np.ones(3, np.float32)}, "fedcba98765432100000")
    assert a.parent == b.parent and a.parent.name.startswith("deform-surgeon-serve-inputs-")
    assert stat.S_IMODE(a.parent.stat().st_mode) == 0o700
    assert np.load(a)["x"].tolist() == [0, 0, 0] and np.load(b)["x"].tolist() == [1, 1, 1]


@pytest.mark.webgpu
@needs_runtimes
def test_any_image_model_runs_and_shows_its_first_output(tmp_path: Path) -> None:
    """Not a mask: a 3 -> 4 channel Conv with two outputs. The page runs it, compares both outputs with ORT CPU and
    shows the first output's first plane (the last output has 4 channels, so it is not taken for a mask)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "w"], ["features"], pads=[1, 1, 1, 1], kernel_shape=[3, 3],
                          strides=[1, 1], dilations=[1, 1]),  # JSEP: "dilations should be 2D" without them
         helper.make_node("Relu", ["features"], ["relu"])],
        "conv", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 4, 32, 32]),
         helper.make_tensor_value_info("relu", TensorProto.FLOAT, [1, 4, 32, 32])], [w])
    model = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(model))
    result = tmp_path / "result.json"
    r = _cli(str(model), "--headless", str(result), "--runs", "1", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    (m,) = json.loads(result.read_text())["models"]
    assert m["ok"] and sorted(m["vs_cpu"]) == ["features", "relu"]
    assert all(v["max_abs_diff"] <= GPU_TOLERANCE["float32"] for v in m["vs_cpu"].values())
    assert m["display"].startswith("first output 'features'")


# ------------------------------------------------------------------------------ the page as a user drives it

DRIVER = Path(__file__).parents[1] / "helpers" / "serve_page.mjs"


def _grey_model(path: Path, size: int = 64) -> Path:
    """mask = the mean of the three channels: what the page shows is the picture it fed the model, in grey."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["image"], ["mask"], axes=[1], keepdims=1)], "grey",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, size, size])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _ellipse(path: Path, w: int = 40, h: int = 80) -> np.ndarray:
    """A white ellipse filling a tall black picture (RGB), as a PNG; returns its grey values."""
    from helpers.png import write_png

    y, x = np.mgrid[0:h, 0:w]
    inside = ((x + 0.5 - w / 2) / (w / 2 - 2)) ** 2 + ((y + 0.5 - h / 2) / (h / 2 - 2)) ** 2 <= 1
    grey = np.where(inside, 255, 0).astype(np.uint8)
    write_png(path, np.repeat(grey[:, :, None], 3, axis=2))
    return grey


def _drive(tmp_path: Path, models: list[Path], steps: list[dict], query: str = "", webgpu: bool = True) -> dict:
    """Serves `models` and runs tests/helpers/serve_page.mjs on the page; its report of every step."""
    from deform_surgeon.base.js_runtimes import harness_env

    app = ServeApp([ServedModel.load(label, m) for label, m in zip(("original", "patched")[:len(models)], models,
                                                                   strict=True)], None)
    srv = make_server(app)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    out = tmp_path / "state.json"
    try:
        cmd = ["node", str(DRIVER), "--url", f"http://127.0.0.1:{srv.server_address[1]}/{query}", "--out",
               str(out), "--steps", json.dumps(steps), "--chromium", str(runtimes.CHROMIUM)]
        r = subprocess.run(cmd + ([] if webgpu else ["--no-webgpu"]), env=harness_env(tmp_path),
                           capture_output=True, text=True, timeout=900)
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report.get("page_errors"), report["page_errors"]
    return report


@pytest.mark.webgpu
@needs_runtimes
def test_page_blocks_a_bad_image_keeps_the_aspect_ratio_and_downloads_pngs(tmp_path: Path) -> None:
    """A user's session on one model: a file that is not an image blocks "run" (and leaves the picker empty) until
    a good one is chosen; a tall 40x80 picture is letterboxed into the 64x64 input, not squashed; the mask and the
    cutout come back at 40x80 as PNG downloads."""
    from helpers.png import read_png

    model = _grey_model(tmp_path / "grey.onnx")
    bad, tall = tmp_path / "not_an_image.png", tmp_path / "tall.png"
    bad.write_text("this is text, not a picture\n")
    grey = _ellipse(tall)
    downloads = tmp_path / "downloads"
    report = _drive(tmp_path, [model], [{"pick": str(bad)}, {"pick": str(tall)}, {"uncheck": "normalize"},
                                        {"run": True}, {"downloads": str(downloads)}], query="?runs=1")
    opened, after_bad, after_good, _, _, downloaded = report["states"]
    assert opened["run_disabled"] is False and opened["title"] == "deform-surgeon serve: grey.onnx on this GPU"
    assert "deform-surgeon patch MODEL.onnx MODEL.patched.onnx" in opened["one_model"]
    assert opened["runs"] == "1"
    assert after_bad["run_disabled"] is True and after_bad["picker"] == ""
    assert after_bad["status"].startswith("not_an_image.png cannot be decoded as an image")
    assert after_good["run_disabled"] is False and after_good["status"] == "ready"

    # letterboxed: scaled by 0.8 to 32x64, bars of 16 columns left and right in the ImageNet mean (124, 116, 104)
    row = after_good["input_canvas"]["middle_row_grey"]
    assert after_good["input_canvas"]["width"] == 64 and len(row) == 64
    assert set(row[:16]) == set(row[48:]) == {115}, row
    assert min(row[18:46]) > 200, row  # the ellipse is 32 columns wide at its middle, not 64
    assert "(40×80) keeps its aspect ratio: scaled by 0.800 to 32×64" in after_good["letterbox"]
    result = report["result"]
    assert result["ok"] is True and result["image"]["letterbox"] == {
        "into": [64, 64], "x": 16, "y": 0, "width": 32, "height": 64, "scale": 0.8, "fill_rgb": [124, 116, 104]}
    assert result["models"][0]["verdict_vs_cpu"]["passed"]

    assert sorted(downloaded["downloads"]) == sorted(p.name for p in downloads.iterdir()) == [
        "tall.original.cutout.png", "tall.original.mask.png"]
    mask = read_png(downloads / "tall.original.mask.png")
    cut = read_png(downloads / "tall.original.cutout.png")
    assert mask.shape[:2] == cut.shape[:2] == (80, 40)  # the image's own size
    # the mask is the picture the model was given, cut back out of the letterbox: the ellipse, edges blurred by the
    # 40x80 -> 32x64 -> 40x80 resampling
    diff = np.abs(mask[:, :, 0].astype(int) - grey.astype(int))
    assert diff.mean() < 12 and (diff > 128).mean() < 0.02, diff.mean()
    assert cut.shape[2] == 4 and np.array_equal(cut[:, :, 3], mask[:, :, 0])  # the mask is the cutout's alpha
    assert cut[40, 20, 3] == 255 and cut[40, 20, :3].min() > 240 and cut[2, 2, 3] == 0


@pytest.mark.webgpu
@needs_runtimes
def test_page_without_webgpu_runs_on_the_wasm_backend_and_says_so(tmp_path: Path, patched: Path) -> None:
    """Chromium without --enable-unsafe-webgpu (as many users' browsers): whatever bundle was asked for, the page
    runs both models on onnxruntime-web's wasm backend, says so and how to enable WebGPU; the patched model gives
    the original's bytes there, and both agree with ORT CPU within the tolerance (its kernels sum in another
    order)."""
    report = _drive(tmp_path, [ORIGINAL, patched], [{"run": True}], query="?bundle=jsep&runs=1", webgpu=False)
    opened, ran = report["states"]
    assert opened["run_disabled"] is False and opened["status"] == "ready"
    note = opened["no_webgpu"]
    assert note.startswith("This browser gives the page no WebGPU adapter, so the models run on onnxruntime-web's "
                           "wasm backend") and "To enable WebGPU:" in note
    result = report["result"]
    assert result["ok"] is True and result["bundle"] == "wasm" and result["no_webgpu"] is True
    assert result["bundle_file"] == "ort.wasm.min.mjs"
    original, patched_entry = result["models"]
    assert original["verdict_vs_cpu"]["passed"] and patched_entry["verdict_vs_cpu"]["passed"]
    assert patched_entry["verdict_vs_original"]["passed"] and patched_entry["identical_to_original"] is True
    assert ran["status"] == "done"


def test_help_says_why_serves_device_profile_differs_and_which_bundle_is_default() -> None:
    r = _cli("--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0
    assert "Why serve's default differs from every other command's (spec-default)" in text
    assert "webgpu = `import 'onnxruntime-web/webgpu'` (default; what transformers.js imports)" in text
    assert "(default: 5 on a hardware GPU, 1 on a software adapter" in text


def test_config_names_the_default_bundle_runs_and_image(tmp_path: Path) -> None:
    web = tmp_path / "onnxruntime-web"
    web.mkdir()
    picture = tmp_path / "photo.jpg"
    picture.write_bytes(b"\xff\xd8 not checked here: the browser decodes it")
    config = ServeApp([ServedModel.load("original", ORIGINAL)], None, ort_web=web).config()
    assert config["default_bundle"] == "webgpu" and config["runs"] is None
    assert config["default_runs"] == {"hardware": 5, "software": 1}
    assert config["image"] == {"url": "/sample.png", "name": "sample.png (bundled)"}
    app = ServeApp([ServedModel.load("original", ORIGINAL)], None, runs=3, ort_web=web, image=picture)
    assert app.config()["runs"] == 3 and app.config()["image"] == {"url": "/image", "name": "photo.jpg"}
    srv = make_server(app)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert _request(srv, "GET", "/image") == (200, picture.read_bytes())
    finally:
        srv.shutdown()
        srv.server_close()
    r = _cli(str(ORIGINAL), "--image", str(tmp_path / "missing.png"))
    assert r.returncode == 2 and r.stderr.strip().endswith("missing.png: no such file")


@pytest.mark.webgpu
@needs_runtimes
def test_headless_run_on_an_image_that_does_not_decode_fails_and_says_why(tmp_path: Path) -> None:
    """`serve --image` with a file the browser cannot decode: nothing runs (not even on the sample), exit 1."""
    bad = tmp_path / "scan.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    result = tmp_path / "result.json"
    r = _cli(str(_grey_model(tmp_path / "grey.onnx")), "--image", str(bad), "--headless", str(result), timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    doc = json.loads(result.read_text())
    assert doc["ok"] is False and doc["models"] == []
    assert doc["error"].startswith("scan.png cannot be decoded as an image")
    assert "page: scan.png cannot be decoded as an image" in r.stdout


# ------------------------------------------------------------------------------------ bad requests, bad options
@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_one_line(port: str) -> None:
    r = _cli(str(ORIGINAL), "--port", port, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"deform-surgeon: error: argument --port: '{port}' is not a port number from 0 "
                                     "to 65535 (see `deform-surgeon serve --help`)"], r.stderr


def test_a_model_path_that_cannot_be_a_file_is_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.onnx")
    for args, problem in [([tmp_path / "fifo.onnx"], "is a FIFO, not a regular file"),
                          ([ORIGINAL, "--device-profile", tmp_path / "fifo.onnx"], "is a FIFO, not a regular file"),
                          ([tmp_path / ("m" * 300)], "the original model has a name of 300 bytes")]:
        r = _cli(*map(str, args), timeout=300)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and problem in r.stderr, r.stderr


def _raw(srv, request: bytes) -> bytes:
    """Send raw bytes, read the answer until the server closes the connection (a hang times out: a failure)."""
    import socket

    with socket.create_connection(srv.server_address, timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("length", ["abc", "1e3", "-1", " 12x"])
def test_a_bad_content_length_is_a_400_and_nothing_is_printed(server, length: str, capsys) -> None:
    port = server.server_address[1]
    answer = _raw(server, f"POST /logparse HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {length}\r\n\r\n"
                          "some body".encode())
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"bad Content-Length"), answer
    assert _request(server, "GET", "/")[0] == 200  # and the server goes on
    assert capsys.readouterr().err == ""


def test_a_download_the_client_aborts_prints_nothing(tmp_path: Path, capsys) -> None:
    """The page aborts a model download (a new run, a closed tab): the server's write fails with a reset or a
    broken pipe, which is the client's choice, not a server error: no traceback on the terminal."""
    import socket
    import struct

    import onnx
    from onnx import TensorProto, helper

    big = helper.make_tensor("unused", TensorProto.FLOAT, [16, 1 << 20], np.zeros(16 << 20, np.float32).tobytes(),
                             raw=True)  # 64 MiB: more than any socket buffer holds
    graph = helper.make_graph([helper.make_node("Identity", ["image"], ["mask"])], "g",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 3, 8, 8])], [big])
    onnx.save(helper.make_model(graph), tmp_path / "big.onnx")
    web = tmp_path / "onnxruntime-web"
    (web / "dist").mkdir(parents=True)
    (web / "package.json").write_text('{"version": "1.30.0"}')
    srv = make_server(ServeApp([ServedModel.load("original", tmp_path / "big.onnx")], None, ort_web=web))
    srv.daemon_threads = False  # server_close() then waits for every request's thread: all it printed is printed
    thread = threading.Thread(target=srv.serve_forever)
    thread.start()
    try:
        for _ in range(3):
            sock = socket.create_connection(srv.server_address, timeout=60)
            sock.sendall(f"GET /model/original.onnx HTTP/1.1\r\nHost: 127.0.0.1:{srv.server_address[1]}\r\n\r\n"
                         .encode())
            assert sock.recv(12) == b"HTTP/1.1 200"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            sock.close()
        assert _request(srv, "GET", "/")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()
    assert capsys.readouterr().err == ""


def test_serve_image_that_is_a_folder_or_a_fifo_says_so(tmp_path: Path) -> None:
    """`serve --image` with a folder or a FIFO said "no such file"; it says what the path is (a FIFO is not
    opened)."""
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "pictures").mkdir()
    for name, problem in (("pipe.png", "is a FIFO, not a regular file (give a picture file (PNG, JPEG, ...))"),
                          ("pictures", "is a folder, not a picture file (give a picture file (PNG, JPEG, ...))")):
        r = _cli(str(ORIGINAL), "--image", str(tmp_path / name))
        assert (r.returncode, r.stderr) == (2, f"deform-surgeon serve: error: {tmp_path / name}: {problem}\n"), \
            r.stderr


def test_an_output_that_differs_gets_the_bisect_command_with_the_pages_input(server) -> None:
    """The page suggests `deform-surgeon bisect` for the model, its bundle and device, fed the page's own input."""
    image = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    cpu = ort.InferenceSession(str(ORIGINAL), providers=["CPUExecutionProvider"]).run(None, {"image": image})[0]
    layout = {"input": {"name": "image", "dtype": "float32", "dims": list(image.shape)},
              "outputs": [{"name": "mask", "dtype": "float32", "dims": list(cpu.shape)}], "bundle": "jsep"}
    body = image.tobytes() + (cpu + 0.5).tobytes()
    status, text = _request(server, "POST", "/compare/original", body, {"X-Layout": json.dumps(layout)})
    command = json.loads(text)["bisect_command"].split()
    assert command[:3] == ["deform-surgeon", "bisect", str(ORIGINAL)] and command[3:7] == ["--runtime", "browser",
                                                                                           "--bundle", "jsep"]
    saved_path = Path(command[command.index("--inputs") + 1])
    with np.load(saved_path) as saved:
        assert saved["image"].tobytes() == image.tobytes()
    saved_path.unlink()  # the server keeps it for the user; the test leaves nothing behind
    status, text = _request(server, "POST", "/compare/original", image.tobytes() + cpu.tobytes(),
                            {"X-Layout": json.dumps(layout)})
    assert "bisect_command" not in json.loads(text)
    config = json.loads(_request(server, "GET", "/config.json")[1])
    assert config["models"][0]["bisect"]["webgpu"].startswith(f"deform-surgeon bisect {ORIGINAL} --runtime browser")
