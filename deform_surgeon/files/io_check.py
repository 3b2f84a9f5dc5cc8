"""Which files a command reads and writes, checked before any work: no write may land on a read.

Why one module: `patch`, `inspect`, `verify`, `budget` and `batch` all write something (OUT, OUT's external data
file `<OUT>.data`, a JSON report, a summary) and read something (the models and every external data file they
name). A write target that is one of those inputs (by any spelling: `..`, a symlink, a hard link), that is
another write target of the same command, or that is not a regular file (`/dev/null`, a FIFO, a folder) would
destroy data or hang, and is refused here, before any work, as one line naming the file (exit 2).

The external data files a model names are found by a scan of its protobuf wire format (`files.scan_model`:
field headers only, no tensor bytes), remembered per unchanged file. The scan only widens what is refused;
`files.load_model` checks the references themselves afterwards (inside the folder after symlinks, present,
long enough).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ..base.errors import SurgeonError
from . import DataForm, path_problem, scan_model, user_path
from .pair import refuse_foreign_data, settle_out


def external_locations(model_path: str | Path) -> list[str]:
    """The `location` of every external tensor among the main graph's initializers (the only place `load_model`
    accepts external data)."""
    return scan_model(model_path).locations


def _keys(path: Path) -> set:
    """Every identity of a path: its absolute spelling, its real path and, if it exists, its inode."""
    keys: set = {os.path.abspath(path)}
    try:
        keys.add(str(path.resolve()))
        st = path.stat()
        keys.add((st.st_dev, st.st_ino))
    except (OSError, RuntimeError, ValueError):  # (ValueError: a NUL byte; load_model names the problem)
        pass
    return keys


def _real(path: Path) -> str:
    """The real path, or the absolute one where it cannot be resolved."""
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return os.path.abspath(path)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a one-line refusal: `a FIFO`, `a socket`, ..."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def require_regular_input(path: str | Path, hint: str = "give an .onnx file") -> None:
    """An input that exists must be a regular file: reading a FIFO or a device would hang or never end."""
    try:
        mode = Path(path).stat().st_mode
    except (OSError, ValueError):
        return  # missing (or no file name at all): load_model names it
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise SurgeonError(path, f"is {file_kind(mode)}, not a regular file", hint)


class FilePlan:
    """The files one command (or one batch) reads and writes; `read_model` and `write` refuse any overlap."""

    def __init__(self) -> None:
        self.reads: dict[object, str] = {}
        self.writes: dict[object, tuple[str, Path]] = {}

    def read_model(self, model_path: str | Path, label: str | None = None) -> list[Path]:
        """Register a model and its external data files as read; returns those data files."""
        path = user_path(model_path, "the model")
        require_regular_input(path)
        try:
            if not stat.S_ISREG(path.stat().st_mode):
                return []  # a folder: load_model names the problem
        except OSError:
            return []  # missing or out of reach: load_model names the problem
        label = label or f"the input model {path}"
        for key in _keys(path):
            self.reads.setdefault(key, label)
        data = [path.parent / loc for loc in external_locations(path)]
        for file in data:
            for key in _keys(file):
                self.reads.setdefault(key, f"an external data file of {path}")
        return data

    def read(self, path: str | Path, label: str) -> None:
        """Register another file the command reads (e.g. a limits JSON)."""
        for key in _keys(user_path(path, label)):
            self.reads.setdefault(key, label)

    def write(self, role: str, target: str | Path) -> Path:
        """Register `target` as written (as `role`, e.g. "OUT" or "--report"), or raise `SurgeonError`."""
        target = user_path(target, role)
        try:
            mode = target.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            mode = None
        except OSError as exc:  # a folder on the way that cannot be searched, a loop of links
            raise SurgeonError(target, f"{role} cannot be written there ({exc.strerror})") from None
        if mode is not None and not stat.S_ISREG(mode):
            raise SurgeonError(target, f"{role} is {file_kind(mode)}, not a regular file: it would be replaced by one",
                               "give a new file name or a regular file")
        keys = _keys(target)
        for key in keys:
            if key in self.reads:
                what = self.reads[key]
                if what.startswith("the input"):  # a model (or a batch entry's input) itself
                    raise SurgeonError(target, f"{role} is {what}", "choose another name; inputs are never modified")
                raise SurgeonError(target, f"{role} would overwrite the input's data: it is {what}",
                                   "choose another name; inputs are never modified")
        self._refuse_taken(role, target, keys)
        folder = target.parent
        if not folder.exists():
            raise SurgeonError(target, f"folder {folder} does not exist")
        if not folder.is_dir():
            raise SurgeonError(target, f"{folder} is not a folder, so {role} cannot be written there")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise SurgeonError(target, f"folder {folder} is not writable")
        for key in keys:
            self.writes[key] = (role, target)
        return target

    def _refuse_taken(self, role: str, target: Path, keys: set) -> None:
        """Refuse `target` if another write target of the command is that file (by any spelling)."""
        for key in keys:
            if key in self.writes:
                other, other_target = self.writes[key]
                both = ""
                if os.path.abspath(other_target) != os.path.abspath(target):  # two names, one file: say which
                    real = _real(target)
                    both = (f" ({target} and {other_target} are both {real})" if real != os.path.abspath(target)
                            else f" ({target} and {other_target} are two names of one file)")
                raise SurgeonError(target, f"{role} is also {other}{both}: one would overwrite the other",
                                   "give each output its own name")

    def reserve(self, role: str, target: Path) -> None:
        """Register `target` as a file the command may write: OUT's data file where OUT's own size decides
        ("auto" of a single file, `DataForm.expected`), so that no other output (a --report) takes its name; the
        file itself is checked by the writer if it writes one. A name no file can have is taken by nothing."""
        if path_problem(target):
            return
        keys = _keys(target)
        self._refuse_taken(role, target, keys)
        for key in keys:
            self.writes[key] = (role, target)

    def write_model(self, target: str | Path, input_data: Sequence[Path] = (), role: str = "OUT",
                    form: DataForm | None = None) -> None:
        """An output model and its data file (`form.data_path`, named after `input_data`, the input's data files
        as its model names them): written when `form` says it will be, reserved where OUT's size decides. What a
        killed writer of OUT left is settled first (`settle_out`); then a data file already there that the existing
        OUT does not name is a user's own file, refused."""
        target = user_path(target, role)
        if os.path.isdir(target):
            raise SurgeonError(target, "output path is a folder; give a file name such as model.patched.onnx")
        self.write(role, target)
        form = form if form is not None else DataForm()
        data, expected = form.data_path(target, input_data), form.expected(input_data)
        if expected is None:
            self.reserve(f"{role}'s external data file", data)
        elif expected:
            self.write(f"{role}'s external data file", data)
            refuse_foreign_data(target, data)
        if not expected:
            settle_out(target)


def check_io(models: Sequence[str | Path], out: str | Path | None = None,
             others: Sequence[tuple[str, str | Path | None]] = (),
             other_reads: Sequence[tuple[str, str | Path | None]] = (), external_data: str = "auto",
             data_suffix: str | None = None) -> FilePlan:
    """One command's files: refuse (one line, exit 2) any write target that is an input, another write target,
    not a regular file, or in a folder that is missing or not writable. `out` is an output model of the first
    model (its data file included: `FilePlan.write_model` for `external_data` and `data_suffix`, `DataForm`);
    `others` are (option, path) pairs such as ("--report", "r.json"), None meaning not given."""
    plan = FilePlan()
    data = [plan.read_model(m) for m in models]
    for label, path in other_reads:
        if path is not None:
            plan.read(path, label)
    if out is not None:
        first = data[0] if data else ()
        plan.write_model(out, first, form=DataForm(external_data, data_suffix))
    for role, path in others:
        if path is not None:
            plan.write(role, path)
    return plan
