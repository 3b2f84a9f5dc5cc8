"""An output model and its external data file as a pair: their names, their putting in place, and what a killed
writer of them left, settled.

A model and its data file are a pair: the model names its data file by `location`, and a page (transformers.js:
`<name>.onnx_data`) fetches it by the documented name, so a new pair cannot take a fresh name of its own. They are
put in place by `install_pair`: both are complete under temporary names first; an existing OUT that names that data
file is moved aside (with it) before either new file takes its place, and put back if anything fails, so that at
no instant does an OUT name a data file that is not its own (for the few renames, OUT is absent instead); Ctrl-C
and SIGTERM wait for those renames. A data file at the target that the existing OUT does not name is a user's own
file and is refused, never replaced.

Two writers of one OUT may run at once (two `patch` runs, a `patch` beside a `batch`): each judges the data file
and puts its pair in place holding the lock of OUT's folder (`folder_lock`, an advisory lock on the folder
itself, so nothing is left behind), so one pair is put in place whole before the other replaces it whole. The
second waits for the first's few renames, not for its whole patch: OUT is then the last writer's pair, never a mix.

A writer killed at any moment (SIGKILL cannot wait) leaves what the next write of that OUT settles before it judges
anything (`settle_out`): an old pair it had moved aside is put back, or removed once the new OUT is in place
(`recover_pair`), and its temporaries, proven a dead writer's by their locks (temporary.py), are removed. The new
data file keeps a second, temporary name until OUT is in place, so a writer killed between the two leaves the proof
that the data file at OUT's data name is its own (not a file of the user's): it is removed with it.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..base.errors import SurgeonError
from ..base.signals import held
from . import wire
from .temporary import dead_temporary, folder_lock, free_name, temp_prefix
from .weights import Weights

_CHUNKED_DATA = re.compile(r"_data(_\d+)?$")
DATA_SUFFIXES = ("_data", ".data")
MAX_DATA_CHUNKS = 100  # transformers.js's MAX_EXTERNAL_DATA_CHUNKS (src/utils/hub/constants.js): it loads no more


def is_own_data_name(model_name: str, name: str) -> bool:
    """Whether `name` is a data file named after the model file `model_name` as writers name them: `<model>.data`,
    `<model>_data` and its chunks `<model>_data_<k>` (an old OUT's own, which leave with it; an unreadable model's
    in a batch folder, which stay its own)."""
    return re.fullmatch(re.escape(model_name) + r"(\.data|_data(_\d+)?)", name) is not None


def external_data_path(model_path: str | Path, input_data: Iterable[str | Path] = (), suffix: str | None = None
                       ) -> Path:
    """Where the external data of an output model goes, beside it: `<OUT>` + `suffix`, or (None) in the form of
    the input's own data files, `input_data` as its model names them (`Weights.named_sources`, not where links
    lead): `<OUT>.data` when the input's is named so (onnx's and torch's form), else `<OUT>_data`
    (`model.onnx_data`: transformers.js's form, which fetches `<name>.onnx_data` and gives ORT the bytes under that
    name, so a patched model folder loads there unchanged; also the name of weights moved out of a single file)."""
    model_path = Path(model_path)
    if suffix is None:
        names = [Path(f).name for f in input_data]
        suffix = ".data" if names and not any(_CHUNKED_DATA.search(n) for n in names) else "_data"
    return model_path.with_name(model_path.name + suffix)


def check_data_target(target: Path, data_target: Path, weights: Weights | None = None) -> None:
    """Refuse (`SurgeonError`, nothing written) a data file for `target` at `data_target` that would overwrite an
    input (`weights`: the model and its data files), that is a folder, or that is a file of the user's own: one
    that exists and that the existing `target` does not name (the data file of the OUT being replaced is
    replaced with it)."""
    inputs = {Path(p).resolve() for p in (weights.inputs if weights is not None else ())}
    if data_target.resolve() in inputs:
        raise SurgeonError(data_target, "the output's external data file would overwrite the input's",
                           "choose another OUT: the input is never modified")
    if data_target.is_dir():
        raise SurgeonError(data_target, "is a folder; the output's external data file goes there")
    refuse_foreign_data(target, data_target)


def refuse_foreign_data(target: Path, data_target: Path) -> None:
    """Refuse a file at `data_target` that the existing model `target` does not name: a file of the user's own,
    which writing `target` with its data would replace without a word (the data file of the OUT being replaced
    is replaced with it). Judged holding the folder's lock, once what a killed writer of `target` left is
    settled (`settle_out`): another writer is never seen halfway through putting its pair in place (its data file
    there, its OUT not yet), nor is a killed one's data file, or the old OUT it moved aside, taken for the user's."""
    with folder_lock(target.parent):
        _settle(target)
        _refuse_foreign(target, data_target)


def settle_out(target: Path) -> None:
    """Before `target` is written, or after its writer was killed (batch's worker): what a writer of `target`
    killed before it was done left, settled (module docstring): an old pair it had moved aside put back or removed
    (`recover_pair`), its temporaries removed, with the data file it had put in place for an OUT it never put in
    place. Only what is proven a dead writer's is touched."""
    with folder_lock(target.parent):
        _settle(target)


def _settle(target: Path) -> None:
    recover_pair(target)
    own = [target.with_name(target.name + s) for s in DATA_SUFFIXES]
    for name in [target, *own]:
        for tmp in target.parent.glob(f"{glob.escape(temp_prefix(name))}*.tmp*"):
            fd = dead_temporary(tmp)
            if fd is None:
                continue
            try:
                st = os.fstat(fd)
                for data in own:  # a second name of a data file its writer put in place, OUT not yet
                    if _same_file(data, st) and not names_data_file(target, data):
                        data.unlink()
                tmp.unlink()
            finally:
                os.close(fd)


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        other = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def _refuse_foreign(target: Path, data_target: Path) -> None:
    if os.path.lexists(data_target) and not names_data_file(target, data_target):
        raise SurgeonError(data_target, f"exists and is not the external data file of {target.name}: writing "
                           f"{target.name} would replace it", "remove it or choose another OUT")


def names_data_file(model_path: Path, data_path: Path) -> bool:
    """Whether the existing model file `model_path` names `data_path` as external data (by its `location`s, read
    from the file's wire format: no tensor is loaded); False where it is missing or not a model."""
    try:
        if not model_path.is_file():
            return False
        target = data_path.resolve()
        return any((model_path.parent / loc).resolve() == target for loc in wire.scan_model(model_path).locations)
    except (OSError, RuntimeError, ValueError, SurgeonError):
        return False


def install_pair(tmp: Path, target: Path, tmp_data: Path | None, data_target: Path, inputs: Iterable[tuple]) -> None:
    """Put the complete temporary model `tmp` (and its data file `tmp_data`) in place as `target` (and
    `data_target`), so that no one ever finds an OUT naming a data file that is not its own (module docstring):
    an existing OUT leaves with the data files of its own it names (`_old_pair`: moved aside, put back if a rename
    fails, removed once the new model is in place, whatever form the new one has: no stale data file is left for
    the next run to refuse as a user's own); otherwise the new data file takes a name no model uses before the
    new model takes OUT's. No input (`inputs`: `Weights.inputs`' file keys) is ever moved or removed. Signals
    wait until this is done; another writer of the folder waits for it (`folder_lock`), and the data file is
    judged again here, as another writer may have put its pair in place since it was judged."""
    with folder_lock(target.parent), held():  # (a signal still stops a wait for the lock)
        _settle(target)  # what a writer of this OUT killed here before left (SIGKILL cannot wait)
        if tmp_data is not None:
            _refuse_foreign(target, data_target)
        aside = _move_aside(_old_pair(target, inputs))
        placed, witness = False, None
        try:
            if tmp_data is not None:
                witness = _witness(tmp_data, data_target)
                os.replace(tmp_data, data_target)
                placed = True
            os.replace(tmp, target)
        except BaseException:
            if placed:
                data_target.unlink(missing_ok=True)
            _put_back(aside)
            raise
        finally:
            if witness is not None:
                witness.unlink(missing_ok=True)
        for backup, _ in aside:
            backup.unlink(missing_ok=True)


def _witness(tmp_data: Path, data_target: Path) -> Path | None:
    """A second, temporary name of the new data file, kept until OUT is in place: it shares the data file's lock
    (the temporary's), so a writer killed between the data file's rename and OUT's leaves the proof that the file
    at `data_target` is its own (`_settle` removes both). None on a file system without hard links."""
    witness = free_name(data_target, ".tmp.data")
    try:
        os.link(tmp_data, witness)
    except OSError:
        return None
    return witness


def _old_pair(target: Path, inputs: Iterable[tuple]) -> list[Path]:
    """The existing OUT and the data files of its own that it names (`<OUT>.data`, `<OUT>_data` and its chunks,
    beside it), which leave with it; [] where it names none (OUT is then replaced in one rename). Never a file
    this command reads (an old OUT may name the input's data file, a copied model; or the input itself may bear a
    data file's name: removing it lost the input), nor a file named otherwise, which other models may share."""
    if not target.is_file():
        return []
    try:
        locations = wire.scan_model(target).locations
    except (OSError, RuntimeError, ValueError, SurgeonError):
        return []
    read = {key[:2] for key in inputs}  # (device, inode): the same file by any name
    found = []
    for loc in dict.fromkeys(locations):
        path = target.parent / loc
        try:
            st = os.stat(path)
        except OSError:
            continue
        if path.parent.resolve() == target.parent.resolve() and is_own_data_name(target.name, path.name) and \
                (st.st_dev, st.st_ino) not in read:
            found.append(path)
    return [target, *found] if found else []


def _move_aside(paths: list[Path]) -> list[tuple[Path, Path]]:
    """Rename each existing file of `paths` to a hidden name beside it (`.<name>.<hash>.<hex>.old`); returns
    (backup, original) pairs. If one rename fails (an immutable OUT), the others are put back and it raises:
    nothing was replaced."""
    aside: list[tuple[Path, Path]] = []
    try:
        for path in paths:
            if os.path.lexists(path):
                backup = free_name(path, ".old")
                os.rename(path, backup)
                aside.append((backup, path))
    except BaseException:
        _put_back(aside)
        raise
    return aside


def recover_pair(target: Path, data_target: Path | None = None) -> None:
    """What a process killed during `install_pair` left (SIGKILL cannot wait: a batch's worker, or a `patch`): the
    pair it had moved aside (`_move_aside`'s backups of OUT, `data_target` and OUT's own data files) is put back
    where OUT is missing, and removed where the new OUT is in place (`settle_out`, with the folder's lock held:
    no live writer has a pair aside then)."""
    names = [target.name, *([data_target.name] if data_target else []), *(f"{target.name}{s}" for s in DATA_SUFFIXES),
             *(f"{target.name}_data_{k}" for k in range(1, MAX_DATA_CHUNKS + 1))]
    prefixes = {temp_prefix(name): target.parent / name for name in dict.fromkeys(names)}
    missing = not os.path.lexists(target)
    for backup in target.parent.glob(".*.old"):
        path = next((p for prefix, p in prefixes.items() if backup.name.startswith(prefix)), None)
        if path is None:
            continue
        if missing:
            os.replace(backup, path)
        else:
            backup.unlink(missing_ok=True)


def _put_back(aside: list[tuple[Path, Path]]) -> None:
    """Undo `_move_aside` (best effort: a file that cannot be put back keeps its backup name, never deleted)."""
    for backup, path in reversed(aside):
        try:
            os.replace(backup, path)
        except OSError:
            pass
