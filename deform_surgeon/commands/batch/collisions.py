"""What every entry of a batch reads and writes, checked before any model is: an output where another entry writes
or any entry reads, a folder that is missing or not writable (io_check's `FilePlan`), and whether each output will
have a data file (decided before any model is written, as config.json is decided on it)."""

from __future__ import annotations

import os
from pathlib import Path

from ...base.errors import SurgeonError
from ...files import DataForm
from ...files.io_check import FilePlan
from ...files.write import BROWSER_SINGLE_FILE_LIMIT
from .entry import Entry


def check_collisions(entries: list[Entry], summary: str | None = None,
                     copies: list[tuple[Path, Path]] = (), whole: bool = False) -> None:
    """Fail every entry that would write where an earlier entry writes, or where any entry reads (a model or one
    of its external data files), or into a folder that is missing or not writable (see io_check). A `--summary`
    or a file to copy (`copies`: source, target) that collides with any of them fails the whole batch
    (`SurgeonError`), and with `whole` (a model folder, whose OUTDIR is one whole) so does an entry's output."""
    files = FilePlan()
    for e in entries:
        if e.error is None:
            try:
                e.data_files = files.read_model(e.input, f"the input of entry {e.number} ({e.input})")
            except SurgeonError as exc:
                e.error = exc.one_line()
    for source, _ in copies:
        files.read(source, f"the input {source}")
    _check_writes(entries, files, summary, copies, whole)


def _check_writes(entries: list[Entry], files: FilePlan, summary: str | None,
                  copies: list[tuple[Path, Path]], whole: bool = False) -> None:
    """The write half of `check_collisions`, once the output folders are there."""
    for e in entries:
        if e.error is not None:
            continue
        try:
            for path, what in ((e.output, "output"), (e.report, "report")):
                if path and not Path(path).parent.is_dir():
                    raise SurgeonError(path, f"{what} folder {Path(path).parent} does not exist or is not a folder")
            form = DataForm(e.options.get("external_data") or "auto", e.options.get("data_suffix"))
            e.external = _external_planned(e, form)
            files.write_model(e.output, e.data_files, role=f"the output of entry {e.number} ({e.input})", form=form)
            if e.report:
                files.write(f"the report of entry {e.number} ({e.input})", e.report)
        except SurgeonError as exc:
            if whole:
                raise
            e.error = exc.one_line()
    for source, target in copies:
        files.write(f"the copy of {source}", target)
    if summary is not None:
        files.write("--summary", summary)


def _external_planned(e: Entry, form: DataForm) -> bool:
    """Whether the entry's output will have its weights in a data file, as far as it is known before the patch
    (config.json is decided on it before any model is written): `form.expected`, and where the output's own size
    decides ("auto" of a single file) the input's size, which the output's is close to (a patch adds index chains,
    not weights); where the writer then decides otherwise, batch says so when it updates config.json."""
    expected = form.expected(e.data_files)
    if expected is not None:
        return expected
    try:
        return os.path.getsize(e.input) > BROWSER_SINGLE_FILE_LIMIT
    except OSError:  # (a missing or unreadable input: loading it names the problem)
        return False
