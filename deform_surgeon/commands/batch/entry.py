"""One model of a batch (`Entry`) and the options an entry takes: every option of `patch` under its API keyword
(the argument groups of args.py, `PATCH_GROUPS`), so an option added there is a manifest key and a batch option too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..args import PATCH_GROUPS, manifest_options

OPTIONS = manifest_options()  # entry option (an API keyword of `patch`: args.PATCH_GROUPS) -> accepted Python types
SWITCHES = tuple(o.dest for group in PATCH_GROUPS for o in group.options if o.switch)  # --verify: every entry
ENTRY_KEYS = {"input", "glob", "output", "report", *OPTIONS}
DEFAULT_KEYS = {"out_dir", "report_dir", *OPTIONS}

FAILED = "failed"  # (ok, unchanged, refused: the patch report's own words, report.py)


@dataclass
class Entry:
    """One model of a batch: where it comes from, where it goes, its options, and (later) what happened."""

    number: int
    input: str
    output: str | None = None
    report: str | None = None
    options: dict = field(default_factory=dict)
    error: str | None = None  # set before running: the entry is not run
    status: str = "queued"
    stage: str = "queued"
    seconds: float = 0.0
    result: dict | None = None
    ran: bool = False  # a worker was started (entries failed while planning get no report file)
    report_written: bool = False
    data_files: list[Path] = field(default_factory=list)  # the input's external data files
    external: bool = False  # planned: its output will have its weights in a data file (collisions.py)


def entry_problem(e: Entry) -> str:
    """The entry's error for a line that names its model already: without the model's path in front, which the
    error's own one line carries (a row read "src/onnx/model.onnx: src/onnx/model.onnx: not a readable ...")."""
    head = f"{e.input}: "
    return e.error[len(head):] if e.error and e.error.startswith(head) else (e.error or "")
