"""Measures a model's placement on a real WebGPU runtime: checks what is measured, runs its harness
(`harness.run_harness`) and builds the Placement from what it left (`outcome`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...base import js_runtimes as runtimes
from ...base.js_runtimes import harness_env, missing_setup
from ...graph.device import DeviceProfile, resolve_profile
from ..sample_image import png, scene
from .harness import PKG_DIR, Progress, Scratch, run_harness
from .logparse import CPU_EP
from .model_io import (
    DEFAULT_INT_RANGE,
    JS_DTYPES,
    ModelFolder,
    compare_outputs,
    external_data_files,
    make_inputs,
    read_tensor,
    reference_outputs,
    write_inputs,
)
from .outcome import HarnessOutcome, finish_run, read_placement_log
from .result import Placement

CHROMIUM = runtimes.CHROMIUM
SWIFTSHADER_ICD = runtimes.SWIFTSHADER_ICD
SETUP_COMMAND = runtimes.SETUP_COMMAND

RUNTIMES = ("node", "browser")
BUNDLES = ("webgpu", "jsep", "all", "transformers", "wasm")
DEFAULT_TIMEOUT = 600.0


class SetupMissing(RuntimeError):
    """The Debian/npm runtimes are not installed; the message names the command that installs them."""


def _load_model_header(model_path: Path) -> Any:
    import onnx

    return onnx.load(str(model_path), load_external_data=False)


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
    scratch = Scratch(Path(tempfile.mkdtemp(prefix="ds-placement-")))
    try:
        scratch.io.mkdir()
        if run:
            feeds, input_notes = target.write_run_inputs(scratch.io, feeds, seed, int_range)
            notes += input_notes
        cmd = target.harness_command(scratch, profile, run=run, jsep_debug=jsep_debug)
        rc, fail, steps = run_harness(cmd, harness_env(scratch.root), scratch.log, timeout, progress,
                                      marker=str(scratch.root))
        outcome = HarnessOutcome.read(scratch, rc, fail, steps, log_out)
        summary, log_notes = read_placement_log(outcome, target.header)
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
        write_inputs(io_dir, feeds)
        return feeds, notes

    def harness_command(self, scratch: Scratch, profile: DeviceProfile, run: bool, jsep_debug: bool) -> list[str]:
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


def _run_entry(outcome: HarnessOutcome, target: _Target, io_dir: Path, feeds: dict[str, np.ndarray] | None,
               seed: int) -> dict[str, Any]:
    """The Placement's ``run``. A run that outlived the timeout failed, even if its result landed while the harness
    was being stopped; through transformers.js the run is held against ORT CPU on the tensors the pipeline made of
    the picture (the harness uploads them), and the pipeline's mask is judged too."""
    raw_run = None if outcome.fail else outcome.raw.get("run")
    if target.folder is not None and raw_run is not None and raw_run.get("ok"):
        feeds = {name: read_tensor(io_dir, o) for name, o in (raw_run.get("feeds") or {}).items()}
    return finish_run(raw_run, io_dir, target.model, feeds or {}, outcome.session_ok, outcome.error, seed,
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


def _image_size(model: Any) -> tuple[int, int]:
    """(height, width) of the picture for a model whose one input is an image [N, C, H, W] (unknown dims: 512)."""
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in model.graph.input[0].type.tensor_type.shape.dim]
    h, w = (dims[-2:] if len(dims) == 4 else [0, 0])
    return h or 512, w or 512


__all__ = [
    "CPU_EP",
    "JS_DTYPES",
    "ModelFolder",
    "SetupMissing",
    "compare_outputs",
    "external_data_files",
    "limit_violations",
    "make_inputs",
    "measure_placement",
    "missing_setup",
    "reference_outputs",
    "run_harness",
]
