"""What the bad-input tests of every surface share: the command as a subprocess, a folder's state before and
after, a small model with external data, a file name of a given length and batch's summary rows."""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from pathlib import Path

import onnx
import pytest

from helpers import graphs

DS = [sys.executable, "-m", "deform_surgeon"]


def state(folder: Path) -> dict[str, tuple]:
    """Every entry below `folder` (hidden ones included): bytes and mtime of regular files, the kind of others
    (a FIFO is never opened)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            out[str(p.relative_to(folder))] = (p.read_bytes() if stat.S_ISREG(st.st_mode) else stat.S_IFMT(st.st_mode),
                                               st.st_mtime_ns)
    return out


def external(folder: Path, name: str = "model.onnx", location: str = "w.data") -> Path:
    """A small rewritable model with every weight in one external data file."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    onnx.save(graphs.exporter_like(H=30, W=40, C=8), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)
    return path


def long_name(stem: str, total: int, suffix: str = ".onnx") -> str:
    """A file name of `total` bytes."""
    return stem * (total - len(suffix)) + suffix


def summary_rows(stdout: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"^\s+(\d+)\s+\S+.*$", stdout, re.M)}


def without_permission_bypass() -> list[str]:
    """The prefix that runs a command without the capability to bypass file permissions (root has it)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}"]
