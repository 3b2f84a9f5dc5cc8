"""Drives the JS harnesses (onnxruntime-node, or onnxruntime-web in headless Chromium) and builds a Placement.

Why subprocesses and a log file: the WebGPU EPs exist only in the JS runtimes (the Python onnxruntime wheel
has no WebGPU EP), and ORT reports node placement only in its verbose log. The harness's stderr (ORT's log, or
the forwarded browser console) goes straight to a file so that an 18,000-node log can never fill a pipe;
stdout carries only ``@@progress`` lines. Every harness runs in its own process group and is stopped (SIGTERM,
then SIGKILL) on timeout, error or Ctrl-C; Chromium, which playwright starts in a process group of its own, is
additionally found through the unique temporary profile directory on its command line and stopped by pid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...base import js_runtimes as runtimes
from ...base.js_runtimes import harness_env, missing_setup
from ...graph.device import DeviceProfile, resolve_profile
from ...graph.ops import op_histogram
from ..sample_image import png, scene
from .logparse import CPU_EP, LogSummary, parse_ort_log
from .result import Placement

PKG_DIR = Path(__file__).resolve().parent
CHROMIUM = runtimes.CHROMIUM
SWIFTSHADER_ICD = runtimes.SWIFTSHADER_ICD
SETUP_COMMAND = runtimes.SETUP_COMMAND

RUNTIMES = ("node", "browser")
BUNDLES = ("webgpu", "jsep", "all", "transformers", "wasm")
# transformers.js's file name suffix per dtype (`onnx/model{suffix}.onnx`), as its pipeline picks the file
TRANSFORMERS_DTYPES = {"": "fp32", "_fp16": "fp16", "_quantized": "q8", "_int8": "int8", "_uint8": "uint8",
                       "_q4": "q4", "_q4f16": "q4f16", "_bnb4": "bnb4"}
DEFAULT_TIMEOUT = 600.0
DEFAULT_INT_RANGE = (0, 4)

Progress = Callable[[str], None] | None

# onnxruntime-js tensor type names -> numpy dtypes
JS_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
_NP_TO_JS = {v: k for k, v in JS_DTYPES.items()}


class SetupMissing(RuntimeError):
    """The Debian/npm runtimes are not installed; the message names the command that installs them."""


# --------------------------------------------------------------------------------------------------- setup


# --------------------------------------------------------------------------------------------------- model io


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A transformers.js model folder (config.json beside onnx/) and the one file of it a pipeline loads."""

    root: Path
    model: Path  # root/onnx/<name><suffix>.onnx

    @property
    def file_name(self) -> str:  # transformers.js's `model_file_name` (the file's stem)
        return self.model.stem

    @property
    def dtype(self) -> str:  # the `dtype:` a user writes to get this file ("fp32" for one it does not name)
        stem = self.model.stem
        return next((d for suffix, d in TRANSFORMERS_DTYPES.items() if suffix and stem.endswith(suffix)), "fp32")

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> ModelFolder:
        """The folder of `path`: a model folder (its onnx/model.onnx), or a file in a model folder's onnx/."""
        p = Path(path)
        model = p / "onnx" / "model.onnx" if p.is_dir() else p
        root = model.parent.parent
        if model.parent.name != "onnx" or not (root / "config.json").is_file():
            raise ValueError(f"{path}: not in a transformers.js model folder (config.json beside onnx/, the model in "
                             "onnx/, as `batch DIR OUTDIR` writes it); --bundle transformers loads such a folder")
        if not model.is_file():
            raise FileNotFoundError(f"model file not found: {model}")
        return cls(root, model)


def _load_model_header(model_path: Path) -> Any:
    import onnx

    return onnx.load(str(model_path), load_external_data=False)


def external_data_files(model: Any) -> list[str]:
    """Relative paths of the external-data files a model references (the browser must be given them)."""
    from onnx import TensorProto

    locations: list[str] = []
    for init in model.graph.initializer:
        if init.data_location == TensorProto.EXTERNAL:
            for entry in init.external_data:
                if entry.key == "location" and entry.value not in locations:
                    locations.append(entry.value)
    return locations


def make_inputs(
    model: Any, seed: int = 0, int_range: tuple[int, int] = DEFAULT_INT_RANGE
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Seeded inputs for every graph input that is not an initializer: floats uniform in [0, 1), integers
    uniform in ``int_range`` (half-open), bools 0/1. Unknown or symbolic dimensions become 1 (noted),
    because the runtimes need concrete shapes and 1 is the size every exported BiRefNet input accepts."""
    from onnx import helper

    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape: list[int] = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(int(d.dim_value))
            else:
                shape.append(1)
                notes.append(f"input {vi.name}: dimension {i} ({d.dim_param or '?'}) set to 1")
        if dtype.kind == "f":
            arr = rng.random(shape, dtype=np.float32).astype(dtype)
        elif dtype.kind in "iu":
            arr = rng.integers(int_range[0], int_range[1], size=shape, dtype=np.int64).astype(dtype)
        elif dtype.kind == "b":
            arr = rng.integers(0, 2, size=shape).astype(np.bool_)
        else:
            raise ValueError(f"input {vi.name}: dtype {dtype} is not supported by the harness")
        feeds[vi.name] = np.ascontiguousarray(arr)
    return feeds, notes


def _write_inputs(io_dir: Path, feeds: dict[str, np.ndarray]) -> None:
    meta = []
    for i, (name, arr) in enumerate(feeds.items()):
        if arr.dtype not in _NP_TO_JS:
            raise ValueError(f"input {name}: dtype {arr.dtype} has no onnxruntime-js equivalent")
        file = f"in_{i}.bin"
        (io_dir / file).write_bytes(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes())
        meta.append({"name": name, "dtype": _NP_TO_JS[arr.dtype], "dims": list(arr.shape), "file": file})
    (io_dir / "inputs.json").write_text(json.dumps(meta))


def compare_outputs(
    got: dict[str, np.ndarray | None], ref: dict[str, np.ndarray]
) -> dict[str, dict[str, Any]]:
    """Byte-for-byte comparison of every reference output, plus the largest absolute difference.

    Bytes, not values: ``-0.0`` vs ``+0.0`` and NaN payloads are differences here (docs/runtime-facts.md section 5:
    zero tolerance is not bit identity). ``max_abs_diff`` is over positions where both values are finite;
    positions where exactly one side is non-finite (or both, but different) are counted in
    ``nonfinite_mismatch``.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            out[name] = {
                "identical": False,
                "max_abs_diff": None,
                "dtype": None,
                "shape": None,
                "missing": True,
                "reference_dtype": str(r.dtype),
                "reference_shape": list(r.shape),
            }
            continue
        entry: dict[str, Any] = {"dtype": str(g.dtype), "shape": list(g.shape)}
        if g.dtype != r.dtype or g.shape != r.shape:
            entry.update(
                identical=False,
                max_abs_diff=None,
                reference_dtype=str(r.dtype),
                reference_shape=list(r.shape),
            )
            out[name] = entry
            continue
        identical = np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(r).tobytes()
        a = g.astype(np.float64)
        b = r.astype(np.float64)
        fin = np.isfinite(a) & np.isfinite(b)
        diff = np.abs(a[fin] - b[fin])
        same_nonfinite = (~np.isfinite(a)) & (~np.isfinite(b)) & ((a == b) | (np.isnan(a) & np.isnan(b)))
        nonfinite_mismatch = int(np.count_nonzero(~fin & ~same_nonfinite))
        mismatched = int(np.count_nonzero(diff != 0)) + nonfinite_mismatch
        entry.update(
            identical=bool(identical),
            max_abs_diff=float(diff.max()) if diff.size else 0.0,
            mismatched_elements=mismatched,
            nonfinite_mismatch=nonfinite_mismatch,
            max_diff_at=_where_worst(a, b, fin, same_nonfinite, diff),
        )
        out[name] = entry
    return out


def _where_worst(a: np.ndarray, b: np.ndarray, fin: np.ndarray, same_nonfinite: np.ndarray,
                 diff: np.ndarray) -> list[int] | None:
    """Where in the tensor it differs most (`bisect` says where a node's output goes wrong): the first position
    where exactly one side is non-finite, else the largest finite difference; None when nothing differs."""
    odd = ~fin & ~same_nonfinite
    if odd.any():
        return [int(i) for i in np.unravel_index(int(np.argmax(odd)), a.shape)]
    if not diff.size or not diff.max():
        return None
    return [int(i) for i in np.unravel_index(int(np.flatnonzero(fin)[int(np.argmax(diff))]), a.shape)]


def reference_outputs(model_path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ORT CPU in this Python process on the same inputs: the ground truth every GPU run is held against."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    values = sess.run(names, feeds)
    return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


# ----------------------------------------------------------------------------------------------- processes


def _pids_with_marker(marker: str) -> list[int]:
    """Pids of processes whose command line contains ``marker`` (a unique temp path of this measurement)."""
    pids: list[int] = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd:
            pids.append(int(d.name))
    return pids


def _stop_group(proc: subprocess.Popen, grace: float = 8.0) -> None:
    """SIGTERM the harness's process group (the browser harness then closes Chromium); SIGKILL if it
    lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _sweep(marker: str) -> None:
    """Stops leftover processes of this measurement (Chromium runs in a process group of its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_with_marker(marker)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and _pids_with_marker(marker):
            time.sleep(0.1)


def run_harness(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout: float, progress: Progress, marker: str
) -> tuple[int | None, str | None, str]:
    """Runs one harness (placement's, or `serve --headless`'s page) in its own process group, its stderr into
    `log_path`; stops it and every process carrying `marker` on the way out. Returns (exit code or None, error text
    for timeout/interrupt, the progress steps)."""
    last = {"text": "starting"}
    steps: list[str] = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,  # never written: its EOF tells the harness (--watch-stdin) we are gone
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=str(PKG_DIR),
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                text = raw.decode("utf-8", "replace").rstrip("\n")
                if text.startswith("@@progress "):
                    text = text[len("@@progress ") :]
                    last["text"] = text
                    steps.append(text)
                if progress is not None:
                    progress(text)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
            reader.join(timeout=5)
            return rc, None, steps
        except subprocess.TimeoutExpired:
            step = last["text"]
            _stop_group(proc)
            return None, f"timed out after {timeout:g} s (last step: {step})", steps
        finally:
            _stop_group(proc)
            _sweep(marker)
            if proc.stdin is not None:
                proc.stdin.close()


# --------------------------------------------------------------------------------------------------- main


def measure_placement(
    model_path: str | os.PathLike[str],
    runtime: str = "node",
    bundle: str | None = "webgpu",
    run: bool = False,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress = None,
    *,
    int_range: tuple[int, int] = DEFAULT_INT_RANGE,
    log_out: str | os.PathLike[str] | None = None,
    jsep_debug: bool = True,
    feeds: dict[str, np.ndarray] | None = None,
    profile: DeviceProfile | str | None = None,
) -> Placement:
    """Creates a session for ``model_path`` on a real WebGPU EP and reports where ORT placed every node.

    ``runtime="node"`` uses onnxruntime-node's native WebGPU EP (``bundle`` is ignored and reported as None);
    ``runtime="browser"`` loads onnxruntime-web in headless Chromium with ``bundle`` "webgpu" (native EP),
    "jsep" or "all" (both JSEP). With ``run=True`` seeded inputs (or ``feeds``) are run there and on ORT CPU
    in Python and compared byte for byte; a run that reports any uncaptured WebGPU error counts as failed even
    if ``session.run()`` resolved. ``jsep_debug=False`` only exists to demonstrate JSEP's silent failure mode.
    ``log_out`` keeps a copy of the raw ORT log. ``profile`` (default ``spec-default``) is the device the model
    must fit: every node and tensor beyond its limits is reported in ``limit_violations`` (and the placement is
    not ok); in the browser the page requests its device with the profile's limits, so a run fails where a
    user's GPU with those limits fails. Raises FileNotFoundError / ValueError for bad input and
    :class:`SetupMissing` when the runtimes are not installed; runtime failures are returned, never raised.
    """
    t_start = time.monotonic()
    target = _Target.check(model_path, runtime, bundle)
    profile = resolve_profile(profile)
    on_cpu = target.bundle == "wasm"  # the wasm backend runs no WebGPU kernel: no device limit applies
    violations = [] if on_cpu else limit_violations(target.model, profile, target.runtime, target.bundle)
    notes = ["the wasm backend runs every node on ORT's CPU EP in WebAssembly: no WebGPU device, no device "
             "profile"] if on_cpu else target.profile_notes(profile)
    scratch = _Scratch(Path(tempfile.mkdtemp(prefix="ds-placement-")))
    try:
        scratch.io.mkdir()
        if run:
            feeds, input_notes = target.write_run_inputs(scratch.io, feeds, seed, int_range)
            notes += input_notes
        cmd = target.harness_command(scratch, profile, run=run, jsep_debug=jsep_debug)
        rc, fail, steps = run_harness(cmd, harness_env(scratch.root), scratch.log, timeout, progress,
                                      marker=str(scratch.root))
        outcome = _HarnessOutcome.read(scratch, rc, fail, steps, log_out)
        summary, log_notes = _read_placement_log(outcome, target.header)
        notes += outcome.adapter_notes + log_notes
        run_info = _run_entry(outcome, target, scratch.io, feeds, seed) if run else None
        return Placement(
            runtime=target.runtime, bundle=target.bundle, session_ok=outcome.session_ok, error=outcome.error,
            log=summary, adapter=outcome.raw.get("adapter"), run=run_info, model=str(target.model),
            timings=outcome.timings(t_start), versions=outcome.versions, notes=notes,
            device_profile=profile.to_dict(), applied_limits=outcome.raw.get("applied_limits"),
            limit_violations=violations, peak_rss_mib=outcome.peak_rss_mib, wasm_heap=outcome.raw.get("wasm_heap"),
        )
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Target:
    """What a measurement runs, checked before any process starts: a bad argument, a missing or unreadable file and
    runtimes not set up are the caller's to fix, raised here; what fails once the harness runs is reported."""

    model: Path
    runtime: str
    bundle: str | None  # None on node: its native WebGPU EP comes with no bundle choice
    folder: ModelFolder | None  # the transformers.js model folder (bundle "transformers"), else None
    header: Any  # the ModelProto without its external data: its inputs, ops and external files

    @classmethod
    def check(cls, model_path: str | os.PathLike[str], runtime: str, bundle: str | None) -> _Target:
        """The target of `model_path` on `runtime`, or the error that says why it cannot be measured."""
        model = Path(model_path)
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, not {runtime!r}")
        if runtime == "browser" and bundle not in BUNDLES:
            raise ValueError(f"bundle must be one of {BUNDLES}, not {bundle!r}")
        folder = ModelFolder.of(model) if runtime == "browser" and bundle == "transformers" else None
        model = folder.model if folder is not None else model
        if not model.is_file():
            raise FileNotFoundError(f"model file not found: {model}")
        try:
            header = _load_model_header(model)
        except Exception as e:  # onnx raises DecodeError and friends: the file is not an ONNX model
            raise ValueError(f"{model}: not a readable ONNX model ({e})") from e
        msg = missing_setup(runtime)
        if msg:
            raise SetupMissing(msg)
        return cls(model, runtime, None if runtime == "node" else bundle, folder, header)

    def profile_notes(self, profile: DeviceProfile) -> list[str]:
        """Why, on node, the profile is only checked statically: there the page cannot request a device."""
        if self.runtime != "node":
            return []
        return [f"device profile '{profile.name}' checked statically: onnxruntime-node creates its own "
                "WebGPU device with the adapter's limits, so a run there shows the adapter's limits"]

    def write_run_inputs(self, io_dir: Path, feeds: dict[str, np.ndarray] | None, seed: int,
                         int_range: tuple[int, int]) -> tuple[dict[str, np.ndarray] | None, list[str]]:
        """What the run is fed, written where the harness reads it, and the notes on it. Through transformers.js
        a picture of the model's input size (its pipeline preprocesses it into the tensors, which the harness
        uploads); otherwise `feeds`, or seeded inputs whose notes say which dimensions were set to 1."""
        if self.folder is not None:
            (io_dir / "image.png").write_bytes(png(scene(*_image_size(self.header))))
            return feeds, []
        notes: list[str] = []
        if feeds is None:
            feeds, notes = make_inputs(self.header, seed=seed, int_range=int_range)
        _write_inputs(io_dir, feeds)
        return feeds, notes

    def harness_command(self, scratch: _Scratch, profile: DeviceProfile, run: bool, jsep_debug: bool) -> list[str]:
        """The harness's command line: node's, or the browser's with its bundle, its Chromium profile in `scratch`
        (the marker its processes are found by), the external data files the page must be given and the limits
        its device is requested with; a model folder's file as transformers.js names it; `--run` with the inputs."""
        harness = "ort_node_harness.mjs" if self.runtime == "node" else "browser_harness.mjs"
        cmd = ["node", str(PKG_DIR / harness), "--model", str(self.model.resolve()), "--out", str(scratch.result)]
        if self.runtime != "node":
            cmd += ["--bundle", str(self.bundle), "--chromium", str(CHROMIUM), "--user-data-dir",
                    str(scratch.chromium_profile), "--external", json.dumps(external_data_files(self.header)),
                    "--jsep-debug", "1" if jsep_debug else "0", "--limits", json.dumps(profile.limits)]
        if self.folder is not None:
            cmd += ["--folder", str(self.folder.root.resolve()), "--model-file", self.folder.file_name,
                    "--dtype", self.folder.dtype]
        if run:
            cmd += ["--io", str(scratch.io), "--run"]
        cmd.append("--watch-stdin")
        return cmd


@dataclasses.dataclass(frozen=True)
class _Scratch:
    """The measurement's temporary folder: its path is unique, so it is also the marker every process of this
    measurement carries on its command line (`run_harness` stops them by it)."""

    root: Path

    @property
    def io(self) -> Path:  # the inputs the harness reads and the tensors it uploads
        return self.root / "io"

    @property
    def result(self) -> Path:  # the harness's result.json
        return self.root / "result.json"

    @property
    def log(self) -> Path:  # ORT's verbose log (the harness's stderr)
        return self.root / "ort.log"

    @property
    def chromium_profile(self) -> Path:
        return self.root / "chromium-profile"


@dataclasses.dataclass(frozen=True)
class _HarnessOutcome:
    """What one harness run left: its exit code, `run_harness`'s error (timeout, interrupt), its result.json and
    ORT's log. Read as a measurement: a harness that failed is reported as what it showed, never raised."""

    rc: int | None
    fail: str | None
    created: str | None  # "session created in N s": the run failed, but after the session was created
    raw: dict[str, Any]  # result.json; {} when the harness wrote none
    log_text: str

    @classmethod
    def read(cls, scratch: _Scratch, rc: int | None, fail: str | None, steps: list[str],
             log_out: str | os.PathLike[str] | None) -> _HarnessOutcome:
        """The outcome from `scratch` (before it is removed); ORT's log is also copied to `log_out`."""
        # a run that timed out after the session was created: the session is reported as what it was
        created = next((s for s in steps if s.startswith("session created in")), None) if fail else None
        raw: dict[str, Any] = {}
        if scratch.result.exists():
            try:
                raw = json.loads(scratch.result.read_text())
            except ValueError as e:
                raw = {"error": f"unreadable harness result: {e}"}
        log_text = scratch.log.read_text("utf-8", "replace") if scratch.log.exists() else ""
        if log_out is not None:
            Path(log_out).write_text(log_text)
        return cls(rc, fail, created, raw, log_text)

    @property
    def error(self) -> str | None:
        """The harness's error, with what stopped it first; a harness that wrote nothing is shown by its log's end."""
        error = self.raw.get("error")
        if self.fail:
            if self.created:
                return f"{self.created}, then the run {self.fail}"
            return f"{self.fail}; {error}" if error else self.fail
        if not self.raw:
            tail = "\n".join(self.log_text.strip().splitlines()[-5:])
            return f"harness exited with code {self.rc} and wrote no result: {tail}"
        return error

    @property
    def session_ok(self) -> bool:
        """The session was created, and the harness was not stopped before it said so."""
        return (bool(self.raw.get("session_ok")) and not self.fail) or self.created is not None

    @property
    def adapter_notes(self) -> list[str]:  # e.g. that the adapter is the software one
        return [str(self.raw["adapter_note"])] if self.raw.get("adapter_note") else []

    @property
    def versions(self) -> dict[str, str]:
        return {k: str(v) for k, v in (self.raw.get("versions") or {}).items() if v is not None}

    @property
    def peak_rss_mib(self) -> dict[str, float]:
        return {str(k): float(v) for k, v in (self.raw.get("peak_rss_mib") or {}).items()}

    def timings(self, t_start: float) -> dict[str, float]:
        """The harness's timings, the total since `t_start`, and the session's creation time read from its
        progress step when the harness was stopped before it reported it."""
        timings = {k: float(v) for k, v in (self.raw.get("timings") or {}).items()}
        timings["total_s"] = time.monotonic() - t_start
        if self.created and "session_create_s" not in timings:
            try:
                timings["session_create_s"] = float(self.created.split()[3])  # "session created in 2.34 s"
            except (IndexError, ValueError):
                pass
        return timings


def _read_placement_log(outcome: _HarnessOutcome, header: Any) -> tuple[LogSummary, list[str]]:
    """ORT's log as a LogSummary, and notes on what it does not say. When one EP takes every node ORT lists none:
    the CPU ops are then the model's own ops (every node is on the CPU); a created session whose log has no
    placement block means the log was cut, and its counts are unknown."""
    summary = parse_ort_log(outcome.log_text.splitlines())
    notes: list[str] = []
    if summary.placement_logged and not summary.nodes_listed:
        (ep,) = summary.nodes_by_provider or {"?": 0}
        notes.append(f"ORT logged 'All nodes placed on [{ep}]' (no per-node list)")
    if summary.placement_logged and not summary.nodes_listed and summary.cpu_nodes:
        by_count = sorted(op_histogram(header).items(), key=lambda kv: -kv[1])  # as the log's, most first
        summary = dataclasses.replace(summary, cpu_ops=dict(by_count))
        notes.append(
            "cpu_ops taken from the model file: ORT lists no nodes when one EP takes all of them"
        )
    if outcome.session_ok and not summary.placement_logged:
        notes.append("the log has no placement block; counts are unknown (was the verbose log cut?)")
    return summary, notes


def _run_entry(outcome: _HarnessOutcome, target: _Target, io_dir: Path, feeds: dict[str, np.ndarray] | None,
               seed: int) -> dict[str, Any]:
    """The Placement's ``run``. A run that outlived the timeout failed, even if its result landed while the harness
    was being stopped; through transformers.js the run is held against ORT CPU on the tensors the pipeline made of
    the picture (the harness uploads them), and the pipeline's mask is judged too."""
    raw_run = None if outcome.fail else outcome.raw.get("run")
    if target.folder is not None and raw_run is not None and raw_run.get("ok"):
        feeds = {name: _read_tensor(io_dir, o) for name, o in (raw_run.get("feeds") or {}).items()}
    return _finish_run(raw_run, io_dir, target.model, feeds or {}, outcome.session_ok, outcome.error, seed,
                       judge_mask=target.folder is not None)


def limit_violations(model: Path, profile: DeviceProfile, runtime: str, bundle: str | None) -> list[dict[str, Any]]:
    """Every node and tensor of `model` beyond `profile`'s limits, from the graph (`deform-surgeon budget`).

    Why statically: ORT places nodes at session creation, but a kernel over the device's limits fails only when it
    runs. Storage buffers per shader stage, maxBufferSize and maxStorageBufferBindingSize apply to every EP (the
    native EP binds some larger buffers in segments, but its Conv fails on one: docs/runtime-facts.md section 7)."""
    from ...graph.budget import analyze

    report = analyze(model, profile.max_buffer, profile.max_binding, storage_buffers=profile.storage_buffers)
    out: list[dict[str, Any]] = [
        {"kind": "storage_buffers", "node": n.node, "op": n.op, "count": n.buffers,
         "limit": f"maxStorageBuffersPerShaderStage {n.limit}"} for n in report.over_storage]
    out += [{"kind": "buffer_size", "tensor": t.name, "producer": t.producer, "bytes": t.nbytes,
             "limit": f"maxBufferSize {profile.max_buffer}"} for t in report.over_buffer]
    out += [{"kind": "binding_size", "tensor": t.name, "producer": t.producer, "bytes": t.nbytes,
             "limit": f"maxStorageBufferBindingSize {profile.max_binding}"} for t in report.over_binding]
    return out


def _finish_run(
    raw_run: dict[str, Any] | None,
    io_dir: Path,
    model: Path,
    feeds: dict[str, np.ndarray],
    session_ok: bool,
    session_error: str | None,
    seed: int,
    judge_mask: bool = False,
) -> dict[str, Any]:
    """Turns the harness's run report into the Placement ``run`` entry, comparing with ORT CPU (and, with
    ``judge_mask``, the pipeline's mask with the one ORT CPU's output gives: `_judge_mask`)."""
    info: dict[str, Any] = {
        "ok": False,
        "error": None,
        "outputs": {},
        "gpu_errors": [],
        "reference_error": None,
        "identical": None,
        "seed": seed,
    }
    if raw_run is None:
        info["error"] = (
            "not run: session creation failed"
            if not session_ok
            else (session_error or "the harness did not report a run")
        )
        return info
    gpu_errors = list(raw_run.get("gpu_errors") or [])
    info["gpu_errors"] = gpu_errors
    got = {name: _read_tensor(io_dir, o) for name, o in (raw_run.get("outputs") or {}).items()}
    ok = bool(raw_run.get("ok"))
    error = raw_run.get("error")
    if ok and gpu_errors:
        ok = False
        error = f"uncaptured WebGPU error during the run (session.run() resolved anyway): {gpu_errors[0]}"
    try:
        ref = reference_outputs(model, feeds)
    except Exception as e:  # the reference is part of the measurement: report, do not raise
        info["reference_error"] = f"{type(e).__name__}: {e}"
        ref = None
    if ref is not None and raw_run.get("ok"):
        info["outputs"] = compare_outputs(got, ref)
        for name, tensor in got.items():  # two models' runs on one runtime are compared by these (`--compare`)
            if tensor is not None and name in info["outputs"]:
                info["outputs"][name]["sha256"] = hashlib.sha256(tensor.tobytes()).hexdigest()
        info["identical"] = all(v["identical"] for v in info["outputs"].values())
        if judge_mask:
            info["mask"] = _judge_mask(raw_run, io_dir, next(iter(ref.values())))
    elif ref is None and ok:
        ok = False
        error = f"reference run on ORT CPU failed: {info['reference_error']}"
    info["ok"] = ok
    info["error"] = error
    return info


def _read_tensor(io_dir: Path, o: dict[str, Any]) -> np.ndarray | None:
    """A tensor a harness uploaded ({file, dtype, dims}), or None if it is missing or of an unknown type."""
    f = io_dir / o["file"]
    dtype = JS_DTYPES.get(o["dtype"])
    if dtype is None or not f.exists():
        return None
    return np.frombuffer(f.read_bytes(), dtype=dtype.newbyteorder("<")).astype(dtype).reshape(o["dims"])


def _image_size(model: Any) -> tuple[int, int]:
    """(height, width) of the picture for a model whose one input is an image [N, C, H, W] (unknown dims: 512)."""
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in model.graph.input[0].type.tensor_type.shape.dim]
    h, w = (dims[-2:] if len(dims) == 4 else [0, 0])
    return h or 512, w or 512


def expected_mask(logits: np.ndarray) -> np.ndarray:
    """The mask transformers.js's image-segmentation pipeline makes of a model output [1, 1, H, W] (when the
    picture has the model's size, so that no resize is involved): a sigmoid unless every value is within [0, 1]
    already, times 255, cut to uint8 (a typed array's conversion truncates)."""
    item = logits[0, 0].astype(np.float32)
    if np.any((item < -1e-5) | (item > 1 + 1e-5)):
        item = (1 / (1 + np.exp(-item.astype(np.float64)))).astype(np.float32)
    return np.trunc((item * np.float32(255)).astype(np.float32)).astype(np.int64) % 256


def _judge_mask(raw_run: dict[str, Any], io_dir: Path, ref: np.ndarray) -> dict[str, Any] | None:
    """The pipeline's mask (the returned picture's alpha) against the one ORT CPU's output gives: the largest
    difference in levels of 255 (a GPU difference in the output may move a level by one)."""
    m = raw_run.get("mask")
    if not m or not (io_dir / m["file"]).exists():
        return None
    got = np.frombuffer((io_dir / m["file"]).read_bytes(), dtype=np.uint8).reshape(m["dims"]).astype(np.int64)
    if ref.ndim != 4 or list(ref.shape[2:]) != list(got.shape):
        return {"shape": list(got.shape), "max_level_diff": None}
    diff = np.abs(got - expected_mask(ref))
    return {"shape": list(got.shape), "max_level_diff": int(diff.max()),
            "differing_pixels": int(np.count_nonzero(diff))}


__all__ = [
    "CPU_EP",
    "ModelFolder",
    "SetupMissing",
    "compare_outputs",
    "make_inputs",
    "measure_placement",
    "missing_setup",
    "reference_outputs",
]
