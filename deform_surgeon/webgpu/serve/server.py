"""The local HTTP server of `deform-surgeon serve`: one page that runs the original and the patched model on the
user's own GPU, in the user's own browser.

Why a server in Python: the page needs three things only Python has here: the ORT CPU reference output for the
exact input the page ran (onnxruntime's Python wheel), the byte comparison every other command uses
(`placement.runner.compare_outputs`) and ORT's log parser (`placement.logparse`). The page posts its input, its
outputs and its ORT log lines back; the answers are computed here, so there is one parser and one comparison.

What it serves, and nothing else: its page and the two browser modules shared with the placement harness, the
sample picture (or the one `--image` names), the models and the external-data files they name, and
onnxruntime-web's dist files from the runtimes `deform-surgeon setup` installed. It listens on 127.0.0.1 only and
answers only requests whose Host is that address (a page of another site cannot reach it through a DNS name that
resolves to 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import json
import mimetypes
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from ... import __version__
from ...base import js_runtimes as runtimes
from ...base.errors import SurgeonError
from ...checks.verdict import GPU_TOLERANCE, bisect_hint, combine, judge_outputs
from ...graph.device import ADAPTER, DeviceProfile
from ..placement.logparse import parse_ort_log
from ..placement.runner import JS_DTYPES, ModelFolder, compare_outputs, external_data_files

HERE = Path(__file__).resolve().parent
PLACEMENT_DIR = HERE.parent / "placement"
# Files of the page, by URL path.
PAGE_FILES = {
    "/": HERE / "page.html",
    "/serve_page.mjs": HERE / "serve_page.mjs",
    "/sample.png": HERE / "sample.png",
    "/browser_device.mjs": PLACEMENT_DIR / "browser_device.mjs",
    "/harness_node_and_page.mjs": PLACEMENT_DIR / "harness_node_and_page.mjs",
    "/transformers_page.mjs": PLACEMENT_DIR / "transformers_page.mjs",
}
MIME = {".html": "text/html; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
        ".js": "text/javascript; charset=utf-8", ".wasm": "application/wasm", ".json": "application/json",
        ".png": "image/png", ".onnx": "application/octet-stream"}
# `import 'onnxruntime-web/webgpu'` first: what transformers.js and most pages import today; then the default
# `import 'onnxruntime-web'` (JSEP), where the original model's rank-5 GatherND fails to compile.
BUNDLES = ("webgpu", "jsep", "wasm")
# and, when every model is in a transformers.js model folder, transformers.js's own pipeline over that folder
TRANSFORMERS = "transformers"
# Warm runs per model when `serve --runs` is not given: a hardware GPU gets 5 (a median means something); a software
# adapter emulates the GPU on the CPU, where 5 runs of a 64x64 model took 114 s and say nothing about a GPU.
DEFAULT_RUNS = {"hardware": 5, "software": 1}
MAX_POST = 1 << 30


@dataclass
class ServedModel:
    """One model the page runs: its file, the external-data files it names, its inputs and outputs."""

    label: str
    path: Path
    external: list[str]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    folder: ModelFolder | None = None  # the transformers.js model folder it is in, if it is in one
    _session: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, label: str, path: str | Path) -> ServedModel:
        import onnx
        from onnx import helper

        from ...files import load_model, user_path
        from ...files.io_check import require_regular_input

        p = user_path(path, f"the {label} model")
        if p.is_dir():  # a transformers.js model folder: its onnx/model.onnx
            try:
                p = ModelFolder.of(p).model
            except (FileNotFoundError, ValueError) as e:
                raise SurgeonError(path, str(e).removeprefix(f"{path}: ")) from None
        require_regular_input(p)  # a FIFO would block forever
        if not os.path.isfile(p):
            load_model(p)  # names a missing file, a folder, one out of reach
        try:
            model = onnx.load(str(p), load_external_data=False)
        except Exception as e:  # DecodeError and friends: not an ONNX file
            raise SurgeonError(p, f"not a readable ONNX model ({type(e).__name__})") from None
        inits = {i.name for i in model.graph.initializer}

        def describe(vi) -> dict[str, Any]:
            tt = vi.type.tensor_type
            dtype = str(np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))) if tt.elem_type else None
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            return {"name": vi.name, "dtype": dtype, "dims": dims}

        inputs = [describe(vi) for vi in model.graph.input if vi.name not in inits]
        outputs = [describe(vi) for vi in model.graph.output]
        try:
            folder = ModelFolder.of(p.resolve())
        except (FileNotFoundError, ValueError):
            folder = None
        return cls(label, p.resolve(), external_data_files(model), inputs, outputs, folder)

    def image_input_problem(self) -> str | None:
        """None when the model has one image input (N x 3 x H x W, float32 or float16), else what it has."""
        if len(self.inputs) != 1:
            return f"has {len(self.inputs)} inputs; the page runs models with one image input (1x3xHxW)"
        i = self.inputs[0]
        if i["dtype"] not in ("float32", "float16"):
            return f"input '{i['name']}' is {i['dtype']}; an image input is float32 or float16"
        if len(i["dims"]) != 4 or i["dims"][1] not in (3, None):
            return f"input '{i['name']}' has shape {i['dims']}; an image input is 1x3xHxW"
        return None

    def reference(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """ORT CPU's outputs for `feeds` (one session per model, created on first use)."""
        import onnxruntime as ort

        with self._lock:
            if self._session is None:
                self._session = ort.InferenceSession(str(self.path), providers=["CPUExecutionProvider"])
            names = [o.name for o in self._session.get_outputs()]
            values = self._session.run(names, feeds)
        return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}

    def folder_files(self) -> set[str]:
        """The files of its transformers.js folder a page is given (paths from the folder's root): the two
        configs the pipeline reads, the model file and the data files it names; nothing else of the folder (a
        `.env`, `.git/`, notes) is served."""
        if self.folder is None:
            return set()
        root = self.folder.root
        files = [self.folder.model, *(self.path.parent / e for e in self.external)]
        return {"config.json", "preprocessor_config.json"} | {Path(os.path.relpath(f, root)).as_posix()
                                                               for f in files}

    def to_config(self) -> dict[str, Any]:
        folder = None if self.folder is None else {  # served at /models/<label>/ for transformers.js
            "id": self.label, "file": self.folder.file_name, "dtype": self.folder.dtype, "root": str(self.folder.root)}
        return {"label": self.label, "name": self.path.name, "url": f"/model/{self.label}.onnx",
                "external": [{"path": e, "url": f"/external/{self.label}/{e}"} for e in self.external],
                "inputs": self.inputs, "outputs": self.outputs, "folder": folder}


class ServeApp:
    """What the server knows: the models, the device profile for the page, and the last outputs per model."""

    def __init__(self, models: list[ServedModel], profile: DeviceProfile | None, runs: int | None = None,
                 ort_web: Path | None = None, image: Path | None = None, notes: list[str] | None = None) -> None:
        """`runs`: warm runs per model (None: `DEFAULT_RUNS` for the page's adapter); `ort_web`: the
        onnxruntime-web package folder (default: the one `deform-surgeon setup` installed); `image`: the picture
        the page starts with (default: the bundled sample); `notes`: lines the page shows under its title."""
        self.models = {m.label: m for m in models}
        self.profile = profile
        self.runs = runs
        self.image = image
        self.notes = notes or []
        if ort_web is None:
            folder = runtimes.runtimes_dir()
            if folder is None:
                raise RuntimeError(f"onnxruntime-web is not installed; run `{runtimes.SETUP_COMMAND}`")
            ort_web = runtimes.node_modules() / "onnxruntime-web"
        self.ort_dist = ort_web / "dist"
        transformers = runtimes.node_modules() / "@huggingface" / "transformers"
        self.transformers_dist = transformers / "dist"  # and the onnxruntime-web it bundles, whose wasm it loads:
        self.transformers_ort_dist = transformers / "node_modules" / "onnxruntime-web" / "dist"
        self.bundles = (*BUNDLES, TRANSFORMERS) if all(m.folder for m in models) else BUNDLES
        try:
            web_version = json.loads((ort_web / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            web_version = "?"
        self.versions = {"deform_surgeon": __version__, "onnxruntime (CPU reference)": _ort_version(),
                         "onnxruntime-web (served)": web_version}
        self._last: dict[str, tuple[str, dict[str, np.ndarray]]] = {}
        self._lock = threading.Lock()

    def config(self) -> dict[str, Any]:
        if self.profile is None:
            profile = {"name": ADAPTER, "source": "the browser adapter's own limits (every limit it offers)",
                       "limits": None}
        else:
            profile = self.profile.to_dict()
        return {"models": [{**m.to_config(), "bisect": self.bisect_commands(m)} for m in self.models.values()],
                "profile": profile,
                "bundles": list(self.bundles), "default_bundle": BUNDLES[0], "runs": self.runs,
                "default_runs": DEFAULT_RUNS, "tolerance": GPU_TOLERANCE, "versions": self.versions,
                "image": {"url": "/image", "name": self.image.name} if self.image else
                {"url": "/sample.png", "name": "sample.png (bundled)"}, "notes": self.notes}

    def _profile_arg(self) -> str:
        """The `--device-profile` that gives `bisect` the device this page requests."""
        if self.profile is None:
            return ADAPTER
        source = self.profile.source
        return source[len("limits from "):] if source.startswith("limits from ") else self.profile.name

    def bisect_commands(self, m: ServedModel, inputs: str | None = None) -> dict[str, str]:
        """Per bundle, the `deform-surgeon bisect` command that finds where this model goes wrong on the page's
        runtime and device (seeded inputs; `inputs`: the page's own, saved by `compare`)."""
        return {b: bisect_hint(str(m.path), "browser", b, seed=0, inputs=inputs, device_profile=self._profile_arg())
                for b in self.bundles}

    def logparse(self, text: str) -> dict[str, Any]:
        s = parse_ort_log(text.splitlines())
        return {"placement_logged": s.placement_logged, "cpu_nodes": s.cpu_nodes, "memcpy": s.memcpy,
                "total_nodes": s.total_nodes, "nodes_by_provider": s.nodes_by_provider, "cpu_ops": s.cpu_ops,
                "memcpy_by_kind": s.memcpy_by_kind, "gpu_provider": s.gpu_provider,
                "kernel_not_found": len(s.kernel_not_found)}

    def compare(self, label: str, layout: dict[str, Any], body: bytes) -> dict[str, Any]:
        """The page's outputs for its input against ORT CPU's, and against the original model's outputs for the
        same input (when this is another model and the original ran on that input)."""
        model = self.models[label]
        tensors = _split_tensors([layout["input"], *layout["outputs"]], body)
        feeds = {layout["input"]["name"]: tensors[0]}
        got = {o["name"]: t for o, t in zip(layout["outputs"], tensors[1:], strict=True)}
        key = hashlib.sha256(tensors[0].tobytes()).hexdigest()
        t0 = time.monotonic()
        ref = model.reference(feeds)
        out: dict[str, Any] = {"cpu_run_s": time.monotonic() - t0, "input_sha256": key}
        out["vs_cpu"] = compare_outputs(got, ref)
        verdict = combine(judge_outputs(out["vs_cpu"], same_runtime=False).values())
        out["verdict_vs_cpu"] = verdict.to_dict() if verdict else None
        out["within_tolerance"] = bool(verdict and verdict.passed)
        if not out["within_tolerance"] and layout.get("bundle") in self.bundles:
            out["bisect_command"] = self.bisect_commands(model, str(_save_input(feeds, key)))[layout["bundle"]]
        with self._lock:
            self._last[label] = (key, got)
            first = next(iter(self.models))
            original = self._last.get(first) if label != first else None
        if original is not None and original[0] == key:
            out["vs_original"] = compare_outputs(got, original[1])
            out["identical_to_original"] = all(e["identical"] for e in out["vs_original"].values())
            same = combine(judge_outputs(out["vs_original"], same_runtime=True, reference="the original").values())
            out["verdict_vs_original"] = same.to_dict() if same else None
        return out


_INPUTS: list[Path] = []  # this process's own folder for the page's inputs (made once, mode 0700)


def _save_input(feeds: dict[str, np.ndarray], key: str) -> Path:
    """The page's input as an .npz that outlives the server (named by its hash, in a folder of this process's own
    that only its user can read: a shared, fixed folder could hold another user's file under that name), for the
    `bisect --inputs` command the page suggests when an output differs."""
    import tempfile

    if not _INPUTS:
        _INPUTS.append(Path(tempfile.mkdtemp(prefix="deform-surgeon-serve-inputs-")))
    path = _INPUTS[0] / f"{key[:16]}.npz"
    if not path.exists():
        np.savez(path, **feeds)
    return path


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def _split_tensors(layout: list[dict[str, Any]], body: bytes) -> list[np.ndarray]:
    """Cuts the posted body into tensors as `layout` ({name, dtype (onnxruntime-js name), dims}) lists them."""
    out, offset = [], 0
    for t in layout:
        dtype = JS_DTYPES.get(t["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {t['name']}: unsupported dtype {t['dtype']}")
        dims = [int(d) for d in t["dims"]]
        size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if offset + size > len(body):
            raise ValueError(f"tensor {t['name']}: body too short")
        out.append(np.frombuffer(body, dtype=dtype.newbyteorder("<"), count=size // dtype.itemsize,
                                 offset=offset).astype(dtype).reshape(dims))
        offset += size
    if offset != len(body):
        raise ValueError("body longer than its layout")
    return out


class _Handler(BaseHTTPRequestHandler):
    app: ServeApp
    server_version = "deform-surgeon-serve"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the page and the terminal report what matters; no access log

    def _host_ok(self) -> bool:
        port = self.server.server_address[1]
        return self.headers.get("Host") in (f"127.0.0.1:{port}", f"localhost:{port}")

    def _send(self, status: int, body: bytes = b"", ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, doc: Any, status: int = 200) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _file(self, path: Path, ctype: str | None = None) -> None:
        if not path.is_file():
            return self._send(HTTPStatus.NOT_FOUND)
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", ctype or MIME.get(path.suffix, "application/octet-stream"))
        self.send_header("Content-Length", str(size))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                self.wfile.write(chunk)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self._host_ok():
            return self._send(HTTPStatus.FORBIDDEN, b"wrong Host")
        path = unquote(urlsplit(self.path).path)
        app = self.app
        if path in PAGE_FILES:
            return self._file(PAGE_FILES[path])
        if path == "/image" and app.image is not None:
            return self._file(app.image, mimetypes.guess_type(app.image.name)[0] or "application/octet-stream")
        if path == "/config.json":
            return self._json(app.config())
        if path == "/favicon.ico":
            return self._send(HTTPStatus.NO_CONTENT)
        if path.startswith("/model/") and path.endswith(".onnx"):
            model = app.models.get(path[len("/model/"):-len(".onnx")])
            return self._file(model.path) if model else self._send(HTTPStatus.NOT_FOUND)
        if path.startswith("/external/"):
            label, _, rel = path[len("/external/"):].partition("/")
            model = app.models.get(label)
            if model is None or rel not in model.external:
                return self._send(HTTPStatus.FORBIDDEN)
            file = _inside(model.path.parent, rel)
            return self._file(file) if file else self._send(HTTPStatus.FORBIDDEN)
        for prefix, dist in (("/ort/", app.ort_dist), ("/transformers/", app.transformers_dist),
                             ("/ort-transformers/", app.transformers_ort_dist)):
            if path.startswith(prefix):
                name = path[len(prefix):]
                if "/" in name or name.startswith("."):
                    return self._send(HTTPStatus.FORBIDDEN)
                return self._file(dist / name)
        if path.startswith("/models/"):  # a transformers.js model folder, by its model's label
            label, _, rel = path[len("/models/"):].partition("/")
            model = app.models.get(label)
            allowed = model is not None and rel in model.folder_files()
            file = _inside(model.folder.root, rel) if allowed else None
            return self._file(file) if file else self._send(HTTPStatus.NOT_FOUND)
        return self._send(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:  # noqa: N802
        if not self._host_ok():
            return self._send(HTTPStatus.FORBIDDEN, b"wrong Host")
        path = urlsplit(self.path).path
        given = (self.headers.get("Content-Length") or "0").strip()
        if not given.isdecimal():  # "abc", "1e3", "-1": no length to read by; the connection cannot go on
            self.close_connection = True
            return self._send(HTTPStatus.BAD_REQUEST, b"bad Content-Length")
        length = int(given)
        if length > MAX_POST:
            self.close_connection = True
            return self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        body = self.rfile.read(length)
        try:
            if path == "/logparse":
                return self._json(self.app.logparse(body.decode("utf-8", "replace")))
            if path.startswith("/compare/") and path[len("/compare/"):] in self.app.models:
                layout = json.loads(unquote(self.headers.get("X-Layout") or "{}"))
                return self._json(self.app.compare(path[len("/compare/"):], layout, body))
        except Exception as e:  # reported to the page, which shows it as the failure it is
            return self._json({"error": f"{type(e).__name__}: {e}"}, 400)
        return self._send(HTTPStatus.NOT_FOUND)

    do_HEAD = do_GET


def _inside(root: Path, rel: str) -> Path | None:
    p = (root / rel).resolve()
    return p if p.is_relative_to(root.resolve()) else None


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a download the page aborted, a closed tab) is no error of the
        server's: nothing is printed. Anything else is printed as http.server does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_server(app: ServeApp, port: int = 0) -> ThreadingHTTPServer:
    """The server bound to 127.0.0.1 (`port` 0: a free port the OS picks); the caller runs serve_forever()."""
    handler = type("Handler", (_Handler,), {"app": app})
    server = _Server(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server
