"""Runs one JS harness (onnxruntime-node, or onnxruntime-web in headless Chromium) as a process, and stops it.

Why a subprocess and a log file: the WebGPU EPs exist only in the JS runtimes (the Python onnxruntime wheel
has no WebGPU EP), and ORT reports node placement only in its verbose log. The harness's stderr (ORT's log, or
the forwarded browser console) goes straight to a file so that an 18,000-node log can never fill a pipe;
stdout carries only ``@@progress`` lines. Every harness runs in its own process group and is stopped (SIGTERM,
then SIGKILL) on timeout, error or Ctrl-C; Chromium, which playwright starts in a process group of its own, is
additionally found through the unique temporary profile directory on its command line and stopped by pid.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent  # the harnesses' .mjs files, and their working directory

Progress = Callable[[str], None] | None


@dataclasses.dataclass(frozen=True)
class Scratch:
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
