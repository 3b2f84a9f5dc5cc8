"""What one harness run left, read as a measurement: its outcome (exit code, error, result.json, ORT's log), the
placement ORT's log shows, and the run's outputs held against ORT CPU's (and, through transformers.js, the
pipeline's mask against the one ORT CPU's output gives)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...graph.ops import op_histogram
from .harness import Scratch
from .logparse import LogSummary, parse_ort_log
from .model_io import compare_outputs, read_tensor, reference_outputs


@dataclasses.dataclass(frozen=True)
class HarnessOutcome:
    """What one harness run left: its exit code, `run_harness`'s error (timeout, interrupt), its result.json and
    ORT's log. Read as a measurement: a harness that failed is reported as what it showed, never raised."""

    rc: int | None
    fail: str | None
    created: str | None  # "session created in N s": the run failed, but after the session was created
    raw: dict[str, Any]  # result.json; {} when the harness wrote none
    log_text: str

    @classmethod
    def read(cls, scratch: Scratch, rc: int | None, fail: str | None, steps: list[str],
             log_out: str | os.PathLike[str] | None) -> HarnessOutcome:
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


def read_placement_log(outcome: HarnessOutcome, header: Any) -> tuple[LogSummary, list[str]]:
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


def finish_run(
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
    got = {name: read_tensor(io_dir, o) for name, o in (raw_run.get("outputs") or {}).items()}
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
