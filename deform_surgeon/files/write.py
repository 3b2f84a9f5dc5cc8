"""Writing: the rule "no input is modified and no partial output file is ever left behind" lives here.

Every write goes to a temporary file in the target folder, is checked (its size; the caller's checks and
verification), and only then renamed over the target (a rename within one folder is atomic). The model is written
record by record (wire.py), no second copy of it in memory; the stored tensors' bytes are copied from the input's
files in the kernel where it can (`os.copy_file_range`): embedded ones into the model file, external ones into the
output's own data file (`<OUT>.data`, or `<OUT>_data` as the input's: `external_data_path`), written through a
temporary name like the model itself.

Which form the output's weights take (`weights_external`, `--external-data`): a page loads a single-file model through
onnxruntime-web's 32-bit wasm heap, which fails past `BROWSER_SINGLE_FILE_LIMIT` (docs/browser-loading.md), while
external data is fetched and uploaded by the WebGPU EP itself. So by default ("auto") an output that would be one
file larger than that (its own size, as serialized: not the input's) is written with its weights in external data,
named as transformers.js fetches them (`<OUT>_data`); a smaller one stays one file, and an input with external data
keeps it. "always" and "never" force either form. `DataForm` carries that choice, and the data file's name, to
every step that plans, checks, writes or reports the output's files, so the name checked is the name written.

A model and its data file are a pair: the model names its data file by `location`, and a page (transformers.js:
`<name>.onnx_data`) fetches it by the documented name, so a new pair cannot take a fresh name of its own. They are
put in place by `_install`: both are complete under temporary names first; an existing OUT that names that data
file is moved aside (with it) before either new file takes its place, and put back if anything fails, so that at
no instant does an OUT name a data file that is not its own (for the few renames, OUT is absent instead); Ctrl-C
and SIGTERM wait for those renames. A data file at the target that the existing OUT does not name is a user's own
file and is refused, never replaced.

Two writers of one OUT may run at once (two `patch` runs, a `patch` beside a `batch`): each judges the data file
and puts its pair in place holding the lock of OUT's folder (`_folder_lock`, an advisory lock on the folder
itself, so nothing is left behind), so one pair is put in place whole before the other replaces it whole. The
second waits for the first's few renames, not for its whole patch: OUT is then the last writer's pair, never a mix.

A writer killed at any moment (SIGKILL cannot wait) leaves what the next write of that OUT settles before it judges
anything (`settle_out`): an old pair it had moved aside is put back, or removed once the new OUT is in place
(`recover_pair`), and its temporaries are removed. A temporary is proven a dead writer's by its lock: each writer
holds an advisory lock on its own temporaries while they exist, which the system lets go when the process ends,
however it ends; one whose lock can be taken has no writer left. The new data file keeps a second, temporary name
until OUT is in place, so a writer killed between the two leaves the proof that the data file at OUT's data name is
its own (not a file of the user's): it is removed with it.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..base.errors import SurgeonError
from ..base.signals import held
from . import wire
from .weights import Weights, external_ref, is_external

try:
    import fcntl
except ImportError:  # (not POSIX: no advisory locks, the writers of one OUT do not take turns)
    fcntl = None  # type: ignore[assignment]

_PROTOBUF_LIMIT = 2**31 - 1

EXTERNAL_DATA_CHOICES = ("auto", "always", "never")
# The largest single-file model written by default. A page's onnxruntime-web holds a single file twice in its 4 GiB
# wasm heap, beside the constants ORT folds at session creation: the full BiRefNet 1024 (925 MiB) fails there, a
# file of weights alone at 1920 MiB (measured in headless Chromium: docs/browser-loading.md). 1.8x below the first.
BROWSER_SINGLE_FILE_LIMIT = 512 * 2**20


_ALIGN_THRESHOLD, _ALIGN = 1 << 20, 1 << 16  # onnx's own layout: tensors >= 1 MiB start at 64 KiB boundaries


_CHUNK = 1 << 24


def temp_prefix(target: str | Path) -> str:
    """The start of every temporary name `atomic_path` makes for `target`: short whatever the target's length (a
    name of up to 255 bytes must still work), and the same for one target only (`settle_out` finds a killed
    writer's temporaries by it)."""
    name = Path(target).name
    readable = "".join(c if c.isascii() and c.isprintable() else "_" for c in name[:24])  # ORT takes UTF-8 only
    return f".{readable}.{hashlib.sha1(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}."


@contextmanager
def temp_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a new, empty temporary file in the target's folder; it is removed on every way out unless it was
    renamed away, a signal included (the CLI turns SIGTERM into an exception, like Ctrl-C): its name is chosen
    *before* the file is created (O_EXCL), so there is no moment at which the file exists and the `finally` does
    not know its name. While it exists this process holds its lock (module docstring): it is created and locked
    holding the folder's lock, so no writer settling the folder ever finds it unlocked while this one lives."""
    target = Path(target)
    tmp_path: Path | None = None
    fd = None
    try:
        with _folder_lock(target.parent):
            for _ in range(100):
                tmp_path = target.parent / f"{temp_prefix(target)}{secrets.token_hex(4)}.tmp{suffix}"
                try:  # mode 0666 minus the umask: the mode any new file gets
                    fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                    break
                except FileExistsError:
                    tmp_path = None
            else:
                raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))
            _hold(fd)
        yield tmp_path
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()
        if fd is not None:
            _LOCK_FDS.discard(fd)
            os.close(fd)


@contextmanager
def atomic_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a temporary path in the target's folder (`temp_path`); rename it over `target` only if the block
    succeeds (a rename within one folder is atomic)."""
    with temp_path(target, suffix) as tmp:
        yield tmp
        os.replace(tmp, target)


@dataclass(frozen=True)
class DataForm:
    """Where an output's weights go, decided once and handed to every step that plans (io_check, batch), checks,
    writes and reports the output's files, so that the data file checked is the one written: `choice`
    (`--external-data`: one of `EXTERNAL_DATA_CHOICES`) and `suffix`, the data file's name after OUT's (one of
    `DATA_SUFFIXES`; None: in the form of the input's own data files, `external_data_path`)."""

    choice: str = "auto"
    suffix: str | None = None

    def data_path(self, out: str | Path, input_data: Iterable[str | Path] = ()) -> Path:
        """OUT's data file, for an input whose data files are `input_data` as its model names them."""
        return external_data_path(out, input_data, self.suffix)

    def expected(self, input_data: Iterable[str | Path]) -> bool | None:
        """Whether OUT will have a data file: known for "always", "never" and an input with external data; None
        for "auto" of a single file, which the output's own size decides when it is written (`weights_external`)."""
        if self.choice != "auto":
            return self.choice == "always"
        return True if list(input_data) else None


@dataclass(frozen=True)
class Written:
    """What `save_model_atomic` wrote: `data`, the external data file beside the model (None: the model is one
    file), and `one_file_size`, the model's size as one file where the writer measured it (a model written as one
    file, or one "auto" moved to a data file because of that size; None otherwise). The report's weights form is
    told from this, not from the input's size."""

    data: Path | None
    one_file_size: int | None


def save_model_atomic(
    model: onnx.ModelProto,
    target: str | Path,
    verify: Callable[[Path], None] | None = None,
    weights: Weights | None = None,
    check: Callable[[], None] | None = None,
    form: DataForm = DataForm(),
) -> Written:
    """Write `model` to a temporary file, check its size, run `check()` and `verify(tmp_path)` if given (either may
    raise: the temporary files are then removed), then put it in place (with its data file: `_install`). Returns
    what was written (`Written`): the data file beside it, or None when there was nothing to put there (a model
    with no stored tensor is one file).

    The model is written record by record (wire.py): no second copy of it is built in memory, and the bytes of
    the stored tensors (`weights`) go from file to file. `form.choice` (`weights_external`): "auto" keeps the
    input's external tensors external and its embedded ones embedded, and moves every stored initializer of a
    single-file input to the data file when the output as one file would be over `BROWSER_SINGLE_FILE_LIMIT`;
    "always" writes every stored initializer to the data file, "never" every one into the model file (Constant
    nodes' values stay in the model, as onnx's own converter leaves them). The data file,
    `form.data_path(target, ...)` beside the output, is named after the input's data files as the model names
    them, so the output's references are relative to its own folder and the input's data file is never touched.
    """
    target = Path(target)
    weights = weights if weights is not None else Weights(None)
    data_target = form.data_path(target, weights.named_sources())
    to_data, one_file = _to_data(model, weights, form.choice)
    try:
        if to_data:
            check_data_target(target, data_target, weights)
        with ExitStack() as stack:
            tmp = stack.enter_context(temp_path(target))
            tmp_data = stack.enter_context(temp_path(data_target, suffix=".data")) if to_data else None
            layout = _copy_to_data(to_data, weights, tmp_data) if tmp_data is not None else {}
            location = tmp_data.name if tmp_data is not None and verify is not None else data_target.name
            pieces = one_file if one_file is not None and not to_data else _pieces(model, weights, layout, location)
            size = _write_model(pieces, weights, tmp, target)
            if check is not None:
                check()
            if verify is not None:
                verify(tmp)
                if tmp_data is not None:
                    _write_model(_pieces(model, weights, layout, data_target.name), weights, tmp, target)
            weights.check_unchanged()  # last: every input read (copied, verified) is the one loaded
            _install(tmp, target, tmp_data, data_target, weights.inputs.values())
    except OSError as exc:
        weights.check_unchanged()  # an input removed or replaced under the writer: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None
    if to_data:
        return Written(data_target, sum(map(len, one_file)) if one_file is not None else None)
    return Written(None, size)


def _to_data(model: onnx.ModelProto, weights: Weights, choice: str
             ) -> tuple[list[onnx.TensorProto], list[wire.Piece] | None]:
    """The stored initializers that go to the data file for `choice` (`weights_external`), and, where the output's
    size as one file decided it ("auto" of a single-file input), the pieces of that one file (written as they are
    when it stays one file)."""
    stored = [t for t in model.graph.initializer if t.name in weights.tensors]
    if choice != "auto" or weights.external:
        keep = [t for t in stored if is_external(t)]
        return (keep if choice == "auto" else stored if choice == "always" else []), None
    pieces = _pieces(model, weights, {}, "")
    return (stored if weights_external(choice, False, sum(map(len, pieces))) else []), pieces


def weights_external(choice: str, input_external: bool, one_file_size: int) -> bool:
    """Whether an output has its weights in external data, for `choice` (`--external-data`,
    `EXTERNAL_DATA_CHOICES`): "auto" keeps an input's external data, and moves the weights of an output larger
    than `BROWSER_SINGLE_FILE_LIMIT` as one file out of it (a page could not load it). `one_file_size` is the
    output's own size as one file (the writer's measure; a dry run, which writes nothing, has only the input's)."""
    if choice != "auto":
        return choice == "always"
    return input_external or one_file_size > BROWSER_SINGLE_FILE_LIMIT


def single_file_problem(name: str, size: int) -> str | None:
    """Why a page could not load a model written as one file of `size` bytes (over `BROWSER_SINGLE_FILE_LIMIT`),
    or None."""
    if size <= BROWSER_SINGLE_FILE_LIMIT:
        return None
    return (f"{name} is one file of {size / 2**20:,.0f} MiB: onnxruntime-web holds a single file twice in its 4 GiB "
            f"wasm heap, with the constants it folds, and the full BiRefNet's 925 MiB file already fails there (over "
            f"{BROWSER_SINGLE_FILE_LIMIT / 2**20:,.0f} MiB is not written as one file by default); with its weights "
            f"in external data (--external-data always) a page loads it")


def copy_atomic(src: str | Path, target: str | Path, check: Callable[[], None] | None = None,
                inputs: Iterable[tuple] = ()) -> None:
    """Copy a file byte for byte through a temporary name (used when there is nothing to rewrite); `check()` (e.g.
    `Weights.check_unchanged`) runs before the copy takes the target's place, and may raise. It takes OUT's place
    as a written model does (`_install`): an old OUT's own data files leave with it, no input (`inputs`) is
    moved."""
    target = Path(target)
    try:
        with temp_path(target) as tmp:
            shutil.copyfile(src, tmp)
            if check is not None:
                check()
            _install(tmp, target, None, target, inputs)
    except OSError as exc:
        if check is not None:
            check()  # the input removed or replaced: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None


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


def check_external_output(out: str | Path, weights: Weights, form: DataForm) -> None:
    """Before any work: refuse an output whose data file (`form.data_path`), which it has when the input has
    external data or `form` puts its weights there, could not be written (`check_data_target`). Where the
    output's own size decides ("auto" of a single file), the writer checks it when it writes one."""
    if form.expected(weights.named_sources()):
        check_data_target(Path(out), form.data_path(out, weights.named_sources()), weights)


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
    with _folder_lock(target.parent):
        _settle(target)
        _refuse_foreign(target, data_target)


def settle_out(target: Path) -> None:
    """Before `target` is written, or after its writer was killed (batch's worker): what a writer of `target`
    killed before it was done left, settled (module docstring): an old pair it had moved aside put back or removed
    (`recover_pair`), its temporaries removed, with the data file it had put in place for an OUT it never put in
    place. Only what is proven a dead writer's is touched."""
    with _folder_lock(target.parent):
        _settle(target)


def _settle(target: Path) -> None:
    recover_pair(target)
    own = [target.with_name(target.name + s) for s in DATA_SUFFIXES]
    for name in [target, *own]:
        for tmp in target.parent.glob(f"{glob.escape(temp_prefix(name))}*.tmp*"):
            fd = _dead(tmp)
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


def _dead(path: Path) -> int | None:
    """A descriptor holding the lock of the temporary `path` when its writer is gone (the lock could be taken);
    None while a writer holds it, or where that cannot be told (not a regular file, a file system without locks)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:  # (BlockingIOError: its writer lives)
        pass
    os.close(fd)
    return None


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


def _install(tmp: Path, target: Path, tmp_data: Path | None, data_target: Path, inputs: Iterable[tuple]) -> None:
    """Put the complete temporary model `tmp` (and its data file `tmp_data`) in place as `target` (and
    `data_target`), so that no one ever finds an OUT naming a data file that is not its own (module docstring):
    an existing OUT leaves with the data files of its own it names (`_old_pair`: moved aside, put back if a rename
    fails, removed once the new model is in place, whatever form the new one has: no stale data file is left for
    the next run to refuse as a user's own); otherwise the new data file takes a name no model uses before the
    new model takes OUT's. No input (`inputs`: `Weights.inputs`' file keys) is ever moved or removed. Signals
    wait until this is done; another writer of the folder waits for it (`_folder_lock`), and the data file is
    judged again here, as another writer may have put its pair in place since it was judged."""
    with _folder_lock(target.parent), held():  # (a signal still stops a wait for the lock)
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
    witness = _free_name(data_target, ".tmp.data")
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
                backup = _free_name(path, ".old")
                os.rename(path, backup)
                aside.append((backup, path))
    except BaseException:
        _put_back(aside)
        raise
    return aside


def recover_pair(target: Path, data_target: Path | None = None) -> None:
    """What a process killed during `_install` left (SIGKILL cannot wait: a batch's worker, or a `patch`): the
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


def _free_name(target: Path, suffix: str) -> Path:
    """A name beside `target` that no file has, of `temp_prefix(target)`'s form (short whatever the target's)."""
    for _ in range(100):
        path = target.parent / f"{temp_prefix(target)}{secrets.token_hex(4)}{suffix}"
        if not os.path.lexists(path):
            return path
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))


_HELD = threading.local()  # `folders`: the (device, inode) of each folder whose lock this thread holds
_LOCK_FDS: set[int] = set()  # this process's descriptors that hold a lock


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Hold the lock of `folder` while the block runs: an advisory `flock` on the folder itself (a lock file beside
    OUT would be one more file left behind, and one removed could be locked by two writers at once). The writers
    of a folder's files take turns through it for what they do there in a few renames (judge a data file, put a
    pair in place); a second one waits (`_wait`). Taken once per thread (a block may call what takes it again).
    Where the folder cannot be opened or the file system has no locks, the block runs without it."""
    try:
        st = os.stat(folder)
    except OSError:
        st = None
    mine = _HELD.__dict__.setdefault("folders", set())
    key = None if st is None else (st.st_dev, st.st_ino)
    fd = _lock_folder(folder) if key is not None and key not in mine else None
    if fd is None:
        yield
        return
    mine.add(key)
    try:
        yield
    finally:
        mine.discard(key)
        _LOCK_FDS.discard(fd)
        os.close(fd)  # (the lock goes with the last descriptor of it)


def _lock_folder(folder: Path) -> int | None:
    """A descriptor of `folder` holding its lock; None where it cannot be had (`_folder_lock`)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # (a folder that may be written but not read)
        return None
    _LOCK_FDS.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait(fd)
    except BaseException as exc:  # a file system without locks; or Ctrl-C while waiting
        _LOCK_FDS.discard(fd)
        os.close(fd)
        if isinstance(exc, OSError):
            return None
        raise
    return fd


def _hold(fd: int) -> None:
    """Lock this process's new temporary `fd` (no one else has it: it was made holding the folder's lock)."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (a file system without locks: the temporary cannot be proven a dead writer's either)
            return
        _LOCK_FDS.add(fd)


def _wait(fd: int) -> None:
    """Wait for the lock another writer holds (its few renames; a signal still stops the wait)."""
    fcntl.flock(fd, fcntl.LOCK_EX)


def _forget_locks() -> None:
    """In a forked child (background.py's checks, verify's runs of each model): close the parent's descriptors that
    hold locks, which the child never uses. Were the parent killed, a child still running would otherwise hold its
    locks until it ends, and another writer would wait for it."""
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()
    _HELD.__dict__.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)


def _pieces(model: onnx.ModelProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str
            ) -> list[wire.Piece]:
    """The records of the file `model` is written as: its stored embedded tensors' data copied from the input
    file, its external ones pointing at (offset, length) of `layout` in `location`."""
    return wire.model_pieces(model, _file_graph(model.graph, weights, layout, location))


def _write_model(pieces: list[wire.Piece], weights: Weights, path: Path, target: Path) -> int:
    """Write the records `pieces` (`_pieces`) to `path`, and check that the file has the size protobuf says it
    must (a failed write raises on its own). Returns that size."""
    total = sum(map(len, pieces))
    if total > _PROTOBUF_LIMIT:
        raise SurgeonError(target, "patched model exceeds protobuf's 2 GB limit",
                           "write its weights to external data: --external-data always")
    size = 0
    with ExitStack() as files, ThreadPoolExecutor(1) as disk:  # a write gives up the GIL: the next records are
        fh = files.enter_context(open(path, "wb", buffering=0))  # serialized while the last ones go to disk
        sources: dict[Path | None, object] = {}
        if weights.data:
            sources[None] = files.enter_context(weights.open_source())
        writing = None
        try:
            for data in wire.serialized(pieces):
                if writing is not None:
                    writing.result()
                    writing = None
                if isinstance(data, wire.FileBytes):
                    if data.path not in sources:  # an external data file whose tensors go into the model
                        sources[data.path] = files.enter_context(open(data.path, "rb", buffering=0))
                    _copy_range(sources[data.path], data.offset, data.length, fh)
                else:
                    writing = disk.submit(_write_all, fh, data)
                size += len(data)
        finally:
            if writing is not None:
                writing.result()
    if size != total or os.path.getsize(path) != size:  # a failed write raises; this catches a short one
        raise SurgeonError(target, "written model is not complete (disk full?)")
    return size


def _write_all(fh, data: bytes) -> None:
    """All of `data` to the unbuffered file `fh` (a raw write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[fh.write(view):]


def _file_graph(graph: onnx.GraphProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str
                ) -> Iterator[wire.Piece]:
    """The graph records of the written file, in protobuf's own field order (an untouched model is written as
    `SerializeToString` would write it): external tensors re-pointed at the output's data file, the stored embedded
    ones with their raw data copied from the input file."""
    data = weights.data
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] in data:
            yield from wire.constant_record(node, data[node.output[0]])
        else:
            yield wire.record(wire.GRAPH_NODE, node)
    yield from wire.graph_name(graph)
    for t in graph.initializer:
        if t.name in layout:
            yield wire.record(wire.GRAPH_INITIALIZER, _pointed(t, location, *layout[t.name]))
        elif t.name in data:
            yield from wire.tensor_record(wire.GRAPH_INITIALIZER, t, data[t.name])
        elif t.name in weights.tensors and is_external(t):  # into the model file: the bytes of its data file
            path, offset, length = _external_span(t, weights.base_dir)
            yield from wire.tensor_record(wire.GRAPH_INITIALIZER, _embedded(t), wire.FileBytes(offset, length, path))
        else:
            yield wire.record(wire.GRAPH_INITIALIZER, t)
    yield from wire.graph_rest(graph)


def _copy_to_data(tensors: list[onnx.TensorProto], weights: Weights, out: Path) -> dict[str, tuple[int, int]]:
    """Copy the bytes of the stored initializers `tensors` into the data file `out` (in the kernel where it can):
    an external one's from its data file, an embedded one's from the input model file (or, for a model built in
    memory, its protobuf). Their new (offset, length); one span shared by several tensors is written once."""
    layout: dict[str, tuple[int, int]] = {}
    done: dict[tuple, tuple[int, int]] = {}
    pos = 0
    with ExitStack() as files, open(out, "wb", buffering=0) as dst:
        sources: dict[Path | None, object] = {}

        def opened(path: Path | None):
            if path not in sources:
                sources[path] = files.enter_context(weights.open_source() if path is None
                                                    else open(path, "rb", buffering=0))
            return sources[path]

        for t in tensors:
            if is_external(t):
                path, offset, length = _external_span(t, weights.base_dir)
                key: tuple = (path, offset, length)
            elif t.name in weights.data:
                span = weights.data[t.name]
                path, offset, length, key = None, span.offset, span.length, (None, span.offset, span.length)
            else:  # in the protobuf of a model built in memory
                raw = t.raw_data
                path, offset, length, key = None, 0, len(raw), ("memory", t.name)
            if key in done:
                layout[t.name] = done[key]
                continue
            if length >= _ALIGN_THRESHOLD and pos % _ALIGN:
                pos += dst.write(b"\0" * (_ALIGN - pos % _ALIGN))
            if key[0] == "memory":
                _write_all(dst, raw)
            else:
                _copy_range(opened(path), offset, length, dst)
            layout[t.name] = done[key] = (pos, length)
            pos += length
    if os.path.getsize(out) != pos:
        raise SurgeonError(out, "external data was not copied completely (disk full?)")
    return layout


def _external_span(t: onnx.TensorProto, base_dir: Path | None) -> tuple[Path, int, int]:
    """The file, offset and length of external tensor `t`'s bytes (a missing length: to the end of the file)."""
    location, offset, length = external_ref(t)
    path = (base_dir if base_dir is not None else Path()) / location
    return path, offset, os.path.getsize(path) - offset if length is None else length


def _embedded(t: onnx.TensorProto) -> onnx.TensorProto:
    """A copy of external tensor `t` without its external reference (its raw data is written beside it)."""
    out = onnx.TensorProto()
    out.CopyFrom(t)
    del out.external_data[:]
    out.ClearField("data_location")
    return out


def _copy_range(src, offset: int, length: int, dst) -> None:
    """Append `length` bytes of `src` from `offset` to `dst` (unbuffered files)."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(length - done, 1 << 30), offset + done)
                if n == 0:
                    break
                done += n
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
    while done < length:
        chunk = os.pread(src.fileno(), min(length - done, _CHUNK), offset + done)
        if not chunk:
            raise SurgeonError(src.name, f"ended early: {length - done} bytes of a stored tensor missing",
                               "was it changed while it was read?")
        _write_all(dst, chunk)
        done += len(chunk)


def _pointed(original: onnx.TensorProto, location: str, offset: int, length: int) -> onnx.TensorProto:
    """A copy of external tensor `original` (which holds no data) pointing at `location`, `offset`, `length`."""
    dst = onnx.TensorProto()
    dst.CopyFrom(original)
    keep = [(e.key, e.value) for e in original.external_data if e.key not in ("location", "offset", "length",
                                                                               "basepath")]
    del dst.external_data[:]
    for key, value in [("location", location), ("offset", str(offset)), ("length", str(length)), *keep]:
        entry = dst.external_data.add()
        entry.key, entry.value = key, value
    dst.data_location = onnx.TensorProto.EXTERNAL
    return dst
