"""`deform-surgeon batch`: patch many models (a TOML manifest and/or globs) in parallel worker processes.

Why a process per model: a model that crashes the ONNX parser, exhausts memory or fails in any other way fails
its own entry and nothing else; a fresh process also returns a large model's memory to the system. Processes
come from a fork server that has already imported the package, so starting one costs milliseconds.

Every entry ends in one of: `ok` (written; with --verify, verified), `unchanged` (nothing to rewrite),
`refused` (some node was refused, or some tensor stays over the device profile; written unless strict: the word
and exit code `patch` gives the same file), `failed` (bad input, verification failed, worker died; nothing
written). Exit code: 0 if every entry is ok or unchanged, 3 if some were refused and none failed,
1 if any failed, 2 if the batch itself cannot start (manifest missing or malformed, no models).

Manifest (paths relative to the manifest's folder)::

    [defaults]                    # optional; any entry option, plus out_dir and report_dir
    verify = true
    out_dir = "patched"           # outputs of entries without `output` (default: beside the input)

    [[model]]
    input = "birefnet_1024.onnx"
    output = "patched/birefnet_1024.webgpu.onnx"   # default: <out_dir>/<name>.patched.onnx
    report = "reports/birefnet_1024.json"          # default: <report_dir or output's folder>/<name>.report.json

    [[model]]
    glob = "variants/*.onnx"      # one entry per match, outputs by the default rule
    sum_mode = "chain"

A model folder instead of a manifest (`deform-surgeon batch DIR OUTDIR`): every `.onnx` below DIR (a
transformers.js repository's `onnx/` folder, say: one file per dtype) is patched into the same relative name in
OUTDIR, an unchanged model copied, each with its external data beside it; every other file (configs, tokenizer,
README) is copied unchanged, all or none, hidden files and folders (`.git`) are not; only regular files inside DIR
are read, and anything that cannot be read or written refuses the folder before anything is written (exit 2), a
config.json transformers.js would misread included (`TransformersConfig`); and one table says per variant its size,
how many deform blocks have a WebGPU kernel for every node, which nodes remain without one (kernels.py), the
verification and the time. Why `batch` and not `patch DIR OUTDIR`: a folder is a list of models, and batch already
runs each in its own process (one variant that fails or runs out of memory fails alone), with its progress, reports,
summary and exit codes.

Entry options: every option of `patch` under its API keyword (the argument groups of args.py, `PATCH_GROUPS`, so
an option added there is one here too): allow_unproven, sum_mode, verify, strict, copy_unchanged, iterations, seed,
val_range (`{ image = [0, 1] }`), opt_level, max_buffer / max_memory (bytes, or a size such as "256MiB"),
device_profile, input_shapes (`{ input_image = [1, 3, 1024, 1024] }`), skip_passes (`["sum_chain"]`: passes not to
run, as `--skip-pass`). Switches given on the command line (--verify, --strict, ...) apply to every entry; valued
command-line options are defaults that the manifest overrides.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import json
import math
import multiprocessing
import os
import queue
import re
import signal
import stat
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import SurgeonError
from ..base.signals import held
from ..base.streams import wrote
from ..files import DataForm, atomic_path, external_data_path, wire
from ..files.io_check import FilePlan, file_kind
from ..files.write import BROWSER_SINGLE_FILE_LIMIT, MAX_DATA_CHUNKS, is_own_data_name, settle_out
from ..graph.budget import human
from .args import PATCH_GROUPS, manifest_options, manifest_problem, val_ranges_for
from .report import FINDING_EXIT, OK, REFUSED, UNCHANGED

OPTIONS = manifest_options()  # entry option (an API keyword of `patch`: args.PATCH_GROUPS) -> accepted Python types
SWITCHES = tuple(o.dest for group in PATCH_GROUPS for o in group.options if o.switch)  # --verify: every entry
ENTRY_KEYS = {"input", "glob", "output", "report", *OPTIONS}
DEFAULT_KEYS = {"out_dir", "report_dir", *OPTIONS}
STAGE_FRACTION = {"queued": 0.0, "start": 0.02, "prove": 0.05, "export": 0.55, "write": 0.7, "verify": 0.8}

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
    external: bool = False  # planned: its output will have its weights in a data file (`_external_planned`)


# ---------------------------------------------------------------------------------------------------- planning
def plan(manifest: str | None, globs: list[str], cli: dict, summary: str | None = None) -> list[Entry]:
    """The entries of a batch, in order, each with its output and report paths and its options resolved.

    Problems of the batch as a whole raise `SurgeonError`; problems of one entry are recorded in `entry.error`.
    """
    defaults, raw = _read_manifest(Path(manifest)) if manifest is not None else ({}, [])
    raw += [({"glob": g}, Path(), "--glob") for g in globs]
    if not raw:
        raise SurgeonError(manifest, "no models: the manifest lists none" if manifest else
                           "no models: give a manifest or --glob PATTERN")
    out_dir = defaults.get("out_dir") or cli.get("out_dir")
    report_dir = defaults.get("report_dir") or cli.get("report_dir")
    entries: list[Entry] = []
    for spec, base, where in raw:
        number = len(entries) + 1
        problem = _spec_problem(spec)
        if problem:
            entries.append(Entry(number, str(spec.get("input", spec.get("glob", f"entry {number}"))),
                                 error=f"{where}: {problem}"))
            continue
        options = _entry_options(cli, defaults, spec)
        models = _models_of(spec, base)
        if not models:
            entries.append(Entry(number, spec["glob"], error=f"glob '{spec['glob']}' matches no file"))
            continue
        for inp, out, rep in models:
            out = str(base / out) if out else str(Path(out_dir or Path(inp).parent) / f"{Path(inp).stem}.patched.onnx")
            if not rep:
                rep = str(Path(report_dir or Path(out).parent) / f"{Path(out).stem}.report.json")
            else:
                rep = str(base / rep)
            entries.append(Entry(len(entries) + 1, inp, out, rep, dict(options)))
    _check_collisions(entries, summary)
    return entries


def _read_manifest(path: Path) -> tuple[dict, list[tuple[dict, Path, str]]]:
    """A manifest's `[defaults]` (its out_dir and report_dir made relative to the manifest's folder) and its
    `[[model]]` entries, each with the folder its paths are relative to and where it was given (for its error
    lines). A manifest that cannot be read as one, or whose defaults are wrong, refuses the batch (`SurgeonError`):
    every entry would inherit the problem."""
    if not path.is_file():
        raise SurgeonError(path, "no such file" if not path.exists() else "is not a file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SurgeonError(path, f"not a valid TOML manifest ({' '.join(str(exc).split())})") from None
    unknown = set(data) - {"defaults", "model"}
    if unknown:
        raise SurgeonError(path, f"unknown manifest key(s): {', '.join(sorted(unknown))}",
                           "a manifest has [defaults] and [[model]] entries")
    defaults = data.get("defaults", {})
    models = data.get("model", [])
    if not isinstance(defaults, dict) or not isinstance(models, list) or not all(isinstance(m, dict)
                                                                                  for m in models):
        raise SurgeonError(path, "[defaults] must be a table and [[model]] an array of tables")
    bad = set(defaults) - DEFAULT_KEYS
    if bad:
        raise SurgeonError(path, f"unknown option(s) in [defaults]: {', '.join(sorted(bad))}",
                           f"known: {', '.join(sorted(DEFAULT_KEYS))}")
    problem = manifest_problem(defaults)
    if problem:
        raise SurgeonError(path, f"[defaults]: {problem}")
    base = path.parent
    defaults = {k: (str(base / v) if k in ("out_dir", "report_dir") and isinstance(v, str) else v)
                for k, v in defaults.items()}
    return defaults, [(m, base, f"{path}, [[model]] #{k}") for k, m in enumerate(models, 1)]


def _spec_problem(spec: dict) -> str | None:
    """What is wrong with one entry as given (its keys, its paths, its options' values), or None: such an entry
    fails alone, and the rest of the batch runs."""
    bad = set(spec) - ENTRY_KEYS
    if bad:
        return f"unknown option(s) {', '.join(sorted(bad))} (known: {', '.join(sorted(ENTRY_KEYS))})"
    if ("input" in spec) == ("glob" in spec):
        return "an entry needs exactly one of `input` or `glob`"
    if "glob" in spec and ("output" in spec or "report" in spec):
        return "a `glob` entry cannot name one `output` or `report`; give each model its own entry"
    if not all(isinstance(spec.get(k, ""), str) for k in ("input", "glob", "output", "report")):
        return "input, glob, output and report must be strings"
    return manifest_problem(spec)


def _entry_options(cli: dict, defaults: dict, spec: dict) -> dict:
    """One entry's options: the command line's valued options, overridden by `[defaults]`, overridden by the
    entry's own; a switch (--verify, ...) is on where any of them turns it on, as on `patch`'s command line."""
    options = {k: v for k, v in cli.items() if k in OPTIONS and v is not None and k not in SWITCHES}
    options.update({k: v for k, v in defaults.items() if k in OPTIONS})
    options.update({k: v for k, v in spec.items() if k in OPTIONS})
    for k in SWITCHES:
        options[k] = bool(options.get(k)) or bool(cli.get(k))
    return options


def _models_of(spec: dict, base: Path) -> list[tuple[str, str | None, str | None]]:
    """The models one entry names, as (input, its output, its report; None: by the default rule): its `input`, or
    every match of its `glob` (none: an empty list), a `.patched.onnx` an earlier batch wrote left out."""
    if "glob" not in spec:
        return [(str(base / spec["input"]), spec.get("output"), spec.get("report"))]
    pattern = str(base / spec["glob"])
    matches = sorted(p for p in globlib.glob(pattern, recursive=True) if not p.endswith(".patched.onnx"))
    return [(m, None, None) for m in matches]


def plan_folder(folder: str, out_dir: str, cli: dict, summary: str | None = None
                ) -> tuple[list[Entry], list[tuple[Path, Path]], TransformersConfig | None]:
    """The entries of `batch DIR OUTDIR` (module docstring), the (source, target) files to copy unchanged, and
    OUTDIR's config.json as read (`TransformersConfig.planned`).

    OUTDIR and the subfolders the outputs need are created once everything else checked; OUTDIR inside DIR (a
    second run would take the outputs for inputs) and every write onto a read are refused (`SurgeonError`) before
    anything is written."""
    src, out = Path(folder), Path(out_dir)
    if src.resolve() == out.resolve() or src.resolve() in out.resolve().parents:
        raise SurgeonError(out, f"OUTDIR is {'DIR itself' if src.resolve() == out.resolve() else 'inside DIR'} "
                           f"({src})", "give an output folder outside the model folder")
    if out.exists() and not out.is_dir():
        raise SurgeonError(out, "OUTDIR exists and is not a folder")
    if not out.parent.is_dir():
        raise SurgeonError(out, f"folder {out.parent} does not exist")
    models, others = [], []
    for root, dirs, files in os.walk(src, followlinks=True):  # links to folders: see _folder_link
        dirs[:] = [d for d in sorted(dirs) if not d.startswith(".") and _folder_link(Path(root) / d, src)]
        for name in sorted(files):
            if not name.startswith(".") and _regular_file_in(Path(root) / name, src):
                (models if name.endswith(".onnx") else others).append(Path(root) / name)
    if not models:
        raise SurgeonError(src, "no .onnx model in this folder", "give a model folder (e.g. a repository's onnx/)")
    data = set()
    for m in models:
        try:
            scan = wire.scan_model(m)
        except SurgeonError:
            scan = None
        if scan is not None and scan.complete:
            data.update((m.parent / loc).resolve() for loc in scan.locations)
        else:  # an unreadable model fails as its own entry, and the data files named after it stay its own, not
            # copied (a half-downloaded model.onnx beside its model.onnx_data refused the whole folder: the copy
            # would have collided with the output's data file)
            data.update(f.resolve() for f in others if f.parent == m.parent and is_own_data_name(m.name, f.name))
    copies = [(f, out / f.relative_to(src)) for f in others if f.resolve() not in data]
    report_dir = cli.get("report_dir")
    options = {k: v for k, v in cli.items() if k in OPTIONS and v is not None and k not in SWITCHES}
    options.update({k: bool(cli.get(k)) for k in SWITCHES})
    options["copy_unchanged"] = True  # the folder out is complete: a variant with nothing to rewrite is copied
    def report(model: Path) -> str | None:  # onnx/model_fp16.onnx -> REPORT_DIR/onnx__model_fp16.report.json
        flat = "__".join(model.relative_to(src).with_suffix("").parts)
        return None if report_dir is None else str(Path(report_dir) / f"{flat}.report.json")

    entries = [Entry(k, str(m), str(out / m.relative_to(src)), report(m), dict(options, **_data_name(m, src)))
               for k, m in enumerate(models, 1)]
    for folder_out in sorted({Path(e.output).parent for e in entries} | {t.parent for _, t in copies}):
        if folder_out.exists() and not folder_out.is_dir():
            raise SurgeonError(folder_out, "is not a folder, so the outputs below it cannot be written")
        real = folder_out.resolve()  # a link the user has in OUTDIR would take the outputs below it elsewhere
        if real != out.resolve() and out.resolve() not in real.parents:
            raise SurgeonError(folder_out, f"leads outside OUTDIR ({out}) through a link, to {real}",
                               "outputs are written inside OUTDIR only: remove the link or give another OUTDIR")
    with _folders_made({Path(e.output).parent for e in entries} | {t.parent for _, t in copies}):
        _check_collisions(entries, summary, copies, whole=True)
        config = TransformersConfig.planned(out, copies, entries)
    return entries, copies, config


def _regular_file_in(path: Path, src: Path) -> bool:
    """True for a file of DIR that batch reads or copies as it is: a regular file inside DIR (itself, or a link to
    one). Anything else is refused, one line, before anything is written: a link leading outside DIR (a link to
    /dev/zero made the copy endless; a folder's links out were refused, its files' were copied), a broken link, a
    FIFO, a socket or a device (they hung the copy or failed it once other files were written)."""
    try:
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
    except FileNotFoundError:
        raise SurgeonError(path, "is a link to nothing", "remove the link, or copy its file in") from None
    except (OSError, RuntimeError) as exc:  # (RuntimeError: a loop of links)
        raise SurgeonError(path, f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if src.resolve() not in real.parents:
        raise SurgeonError(path, f"is a link to a file outside DIR ({real})", "batch DIR OUTDIR reads files inside "
                           "DIR only: copy the file in (cp -L), or give the folder that holds it as DIR")
    if not stat.S_ISREG(mode):
        raise SurgeonError(path, f"is {file_kind(mode)}, not a regular file", "batch DIR OUTDIR reads and copies "
                           "regular files only: remove it from DIR")
    return True


def copy_files(copies: list[tuple[Path, Path]]) -> None:
    """Copy DIR's other files (`copies`: source, target) into OUTDIR, all or none: each into a temporary name beside
    its target, and all renamed into place once every one is copied (a copy that fails, or Ctrl-C, leaves OUTDIR as
    it was: a FIFO config.json left an empty OUTDIR/onnx/ and the files before it copied)."""
    with ExitStack() as staged:  # (each atomic_path renames on a clean exit, and removes its file on any other)
        for source, target in copies:
            _copy_bounded(source, staged.enter_context(atomic_path(target, suffix=source.suffix)))


def _copy_bounded(source: Path, target: Path) -> None:
    """Copy `source` into `target` as `_regular_bytes` reads it."""
    try:
        with open(target, "wb") as out:
            for chunk in _regular_bytes(source):
                out.write(chunk)
    except OSError as exc:
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None


def _regular_bytes(source: Path) -> Iterator[bytes]:
    """The bytes of `source`, at most as many as it has when opened (its fstat size), and only from a regular file:
    what was checked can be swapped for a FIFO or a device before it is read, and a file that grows meanwhile would
    make the copy endless. O_NONBLOCK: opening a FIFO does not wait for a writer."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SurgeonError(source, f"cannot be read ({exc.strerror or exc})") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise SurgeonError(source, f"is {file_kind(opened.st_mode)}, not a regular file", "batch DIR OUTDIR "
                               "reads and copies regular files only: remove it from DIR")
        left = opened.st_size
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as exc:
                raise SurgeonError(source, f"cannot be read ({exc.strerror or exc})") from None
            if not chunk:
                break
            left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


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


def _data_name(model: Path, src: Path) -> dict:
    """The data file name of a model of a transformers.js folder (`onnx/` beside a `config.json`): always
    `<name>.onnx_data`, the name transformers.js fetches and hands ORT (`data_suffix`), whatever the input's is
    named (a `model.onnx.data` input was written as `.data`, which the folder's pipeline never fetched)."""
    ours = model.parent == src / TRANSFORMERS_SUBFOLDER and (src / "config.json").is_file()
    return {"data_suffix": "_data"} if ours else {}


def _folder_link(path: Path, src: Path) -> bool:
    """Whether the walk of DIR goes into `path`: yes for a folder, and for a link to a folder inside DIR (its
    models and files are patched and copied under the link's name, as `cp -rL` would); a link to a folder outside
    DIR, or to one that holds the link (a loop), is refused, one line: it used to be skipped without a word."""
    if not path.is_symlink():
        return True
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # a broken link or a loop of links: no folder, as os.walk sees it
        return False
    if not real.is_dir():
        return False
    top = src.resolve()
    if real != top and top not in real.parents:
        raise SurgeonError(path, f"is a link to a folder outside DIR ({real})", "batch DIR OUTDIR follows links to "
                           "folders inside DIR only: copy the folder in, or give it as DIR")
    holders = {p.resolve() for p in (path.parent, *path.parent.parents) if p == src or src in p.parents}
    if real in holders:
        raise SurgeonError(path, f"is a link to {real}, a folder that holds it: the walk would never end",
                           "remove the link")
    return True


def _check_collisions(entries: list[Entry], summary: str | None = None,
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


@contextmanager
def _folders_made(folders: set[Path]) -> Iterator[None]:
    """Make `folders` (and the ones above them that are missing) for the checks in the block, which need them;
    a refusal in the block takes back the ones made here: a batch refused up front leaves OUTDIR as it found it
    (it left empty folders)."""
    created: list[Path] = []
    try:
        for folder in sorted(folders):
            missing = [p for p in (folder, *folder.parents) if not p.exists()]
            folder.mkdir(parents=True, exist_ok=True)
            created += reversed(missing)
        yield
    except BaseException:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise


def _check_writes(entries: list[Entry], files: FilePlan, summary: str | None,
                  copies: list[tuple[Path, Path]], whole: bool = False) -> None:
    """The write half of `_check_collisions`, once the output folders are there."""
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


# ---------------------------------------------------------------------------------------------------- running
def _stop_in_a_finalizer(unraisable) -> None:
    """A worker's SIGTERM that Python handled inside a finalizer (a weakref callback): its SystemExit cannot
    unwind from there, and Python would print it as "Exception ignored" and go on. The worker ends at once,
    quietly, by the signal itself, as the batch that sent it asked (what it leaves is settled as a killed
    worker's)."""
    if isinstance(unraisable.exc_value, SystemExit):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    sys.__unraisablehook__(unraisable)


def _work(number: int, entry: dict, messages) -> None:
    """Worker process: patch one model, reporting stages and the result on `messages`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so temporary files are removed on the way out
    sys.unraisablehook = _stop_in_a_finalizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the batch stops its workers
    from ..base.errors import SurgeonError as Error
    from .patch import patch

    options = dict(entry["options"])
    try:  # `--val-range [lo,hi]`: every input of this model
        val_range = val_ranges_for(options.pop("val_range", None), entry["input"])
    except Exception:  # an unreadable model: patch() below names the problem
        val_range = None
    verify_options = {k: options.pop(k, None) for k in ("iterations", "seed", "opt_level")}
    verify_options["val_range"] = val_range
    verify_options["threads"] = options.pop("threads", None) or entry.get("threads")  # (the entry's, else its share)
    messages.put(("stage", number, "start"))
    try:
        report = patch(entry["input"], entry["output"], progress=lambda s: messages.put(("stage", number, s)),
                       verify_options=verify_options, **options)
        messages.put(("done", number, report.to_dict(), None))
    except Error as exc:
        messages.put(("done", number, None, exc.one_line()))
    except MemoryError:
        messages.put(("done", number, None, f"{entry['input']}: out of memory"))
    except Exception as exc:  # a bug, not bad input: still only this entry fails
        messages.put(("done", number, None, f"{entry['input']}: internal error: {type(exc).__name__}: {exc}"))


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # every worker is forked from a server that has imported the patch and verify stacks once
        # (and its workers are born ignoring Ctrl-C: ctrl_c_ignored says why)
        ctx.set_forkserver_preload(["deform_surgeon.commands.patch", "deform_surgeon.checks.verify", "onnxruntime",
                                    "polygraphy.backend.onnxrt", "polygraphy.comparator",
                                    "deform_surgeon.commands.ctrl_c_ignored"])
        return ctx
    return multiprocessing.get_context("spawn")


def run(entries: list[Entry], jobs: int, progress: Progress | None = None) -> float:
    """Run the entries that have no error yet, `jobs` at a time; fill in their status. Returns the wall time."""
    start = time.perf_counter()
    todo = [e for e in entries if e.error is None]
    for e in entries:
        if e.error is not None:
            e.status = FAILED
    ctx = _context()
    with held(block_ctrl_c=True):  # (the queue's lock may start multiprocessing's resource tracker)
        messages = ctx.Queue()
    running: dict[int, tuple[Entry, object, float]] = {}
    by_number = {e.number: e for e in entries}
    if progress:
        progress.start(entries)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                e = todo.pop(0)
                threads = None if jobs == 1 else max(1, (os.cpu_count() or 1) // jobs)  # no oversubscription
                proc = ctx.Process(target=_work, args=(e.number, {"input": e.input, "output": e.output,
                                                                   "options": e.options, "threads": threads},
                                                       messages), daemon=True)
                with held(block_ctrl_c=True):
                    proc.start()
                    e.stage, e.status, e.ran = "start", "running", True
                    running[e.number] = (e, proc, time.perf_counter())
            try:
                msg = messages.get(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg is not None:
                _handle(msg, by_number, running, progress)
            for number, (e, proc, t0) in list(running.items()):
                if proc.exitcode is not None and number in running:
                    while True:  # its last messages may still be in the pipe
                        try:
                            _handle(messages.get(timeout=0.5), by_number, running, progress)
                        except queue.Empty:
                            break
                    if number in running:
                        code = proc.exitcode
                        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                        _finish(e, None, f"{e.input}: worker process died ({why}; out of memory?)", t0)
                        _remove_temporaries(e)
                        del running[number]
                        if progress:
                            progress.finished(e)
            if progress:
                progress.tick()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (the CLI raises `Terminated`): stop every worker, leave nothing
        for _e, proc, _ in running.values():
            proc.terminate()
        for e, proc, _ in running.values():
            proc.join(10)
            if proc.exitcode is None:  # stuck in native code: it must not go on to write its output
                proc.kill()
                proc.join()
            _remove_temporaries(e)
        raise
    finally:
        if progress:
            progress.close()
    return time.perf_counter() - start


def _handle(msg, by_number: dict[int, Entry], running: dict, progress: Progress | None) -> None:
    kind, number = msg[0], msg[1]
    e = by_number[number]
    if kind == "stage":
        e.stage = msg[2]
        if progress:
            progress.stage(e)
        return
    if number not in running:
        return
    _, proc, t0 = running.pop(number)
    _finish(e, msg[2], msg[3], t0)
    proc.join()
    if progress:
        progress.finished(e)


def _finish(e: Entry, result: dict | None, error: str | None, t0: float) -> None:
    e.seconds = time.perf_counter() - t0
    e.result, e.error = result, error
    # the report's own word (PatchReport.status), the one `patch` exits by; unchanged: with copy_unchanged, an
    # exact copy was written
    e.status = FAILED if error is not None else result["status"]
    e.stage = "done"


def _remove_temporaries(e: Entry) -> None:
    """What a killed worker may have left: its temporaries (never the output itself), and an old output pair it had
    moved aside to put the new one in place (put back, or removed): `settle_out`, which touches only what is proven
    a dead writer's (another writer of that output may be at work)."""
    if e.output:
        settle_out(Path(e.output))


# ------------------------------------------------------------------------------------------ transformers.js
TRANSFORMERS_SUBFOLDER = "onnx"  # where transformers.js fetches a model folder's files (`{subfolder}/model_fp16.onnx`)
# transformers.js 4.3.1's file name suffixes by dtype (DEFAULT_DTYPE_SUFFIX_MAPPING, src/utils/dtypes.js): a page asks
# for the file `model` of dtype fp16, `model_fp16.onnx`, and looks its data up by either name (`data_files_read`)
DTYPE_SUFFIXES = ("_fp16", "_int8", "_uint8", "_quantized", "_q4", "_q2", "_q1", "_q4f16", "_q2f16", "_q1f16", "_bnb4")
_JS_SPACE = ("\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029"
             "\u202f\u205f\u3000\ufeff")  # what JavaScript's Number("...") trims: WhiteSpace and LineTerminator
_JS_DECIMAL = re.compile(r"[+-]?(?:Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)")
_JS_RADIX = re.compile(r"0([xXoObB])([0-9a-zA-Z]+)")


def base_names(file_name: str) -> set[str]:
    """The names a page may give transformers.js for the file `file_name` (`fileName`, the model's file name
    without the dtype suffix: `model` for `model_fp16.onnx`, or `model_fp16` itself with dtype fp32)."""
    stem = file_name.removesuffix(".onnx")
    return {stem} | {stem[: -len(s)] for s in DTYPE_SUFFIXES if stem.endswith(s) and len(stem) > len(s)}


def data_files_read(value, file_name: str, base: str) -> int:
    """How many data files transformers.js 4.3.1 fetches for `file_name` (`model_fp16.onnx`) asked for as `base`
    (`model`), its config's `use_external_data_format` being `value`: `resolveExternalDataFormat(config, fullName,
    fileName)` (src/utils/model-loader.js) is 0 for a false value; in an object (an array too) the entry of the
    full name, else of the base name, else 0; else the value itself, each as JavaScript's `+x` reads it; its loop
    `for (i = 0; i < n; ++i)` then fetches ceil(n) files (1.5: 2), none for NaN or n <= 0, and over
    MAX_DATA_CHUNKS it refuses to load (shown as one more)."""
    if not _js_truthy(value):
        return 0
    if isinstance(value, dict):
        value = next((value[k] for k in (file_name, base) if k in value), 0)
    elif isinstance(value, list):  # (an array's own properties, its indices and length, name no model file)
        return 0
    n = _js_number(value)
    if not n > 0:
        return 0
    return MAX_DATA_CHUNKS + 1 if n > MAX_DATA_CHUNKS else math.ceil(n)


def _js_truthy(value) -> bool:
    """JavaScript's `!!value` for a value of JSON.parse."""
    return value not in (None, False, 0, "") or isinstance(value, (list, dict))


def _js_number(value) -> float:
    """JavaScript's `+value` (ToNumber) for a value of JSON.parse: an array through its string (`[2]` is 2, `[1, 2]`
    NaN), an object NaN."""
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer literal past a double's range
            return math.copysign(math.inf, value)
    if value is None:
        return 0.0
    if isinstance(value, (str, list)):
        text = (value if isinstance(value, str) else _js_string(value)).strip(_JS_SPACE)
        if not text:
            return 0.0
        if radix := _JS_RADIX.fullmatch(text):
            try:
                return float(int(radix[2], {"x": 16, "o": 8, "b": 2}[radix[1].lower()]))
            except ValueError:  # a digit the base has not
                return math.nan
            except OverflowError:
                return math.inf
        return float(text) if _JS_DECIMAL.fullmatch(text) else math.nan
    return math.nan


def _js_string(value) -> str:
    """JavaScript's `String(value)` of an array's element (null: empty; an array: its elements joined by commas),
    as far as `_js_number` needs it (a number: any text that reads back as that number)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(_js_string(v) for v in value)
    if isinstance(value, dict):
        return "[object Object]"
    n = _js_number(value)
    return repr(n) if math.isfinite(n) else ("Infinity" if n > 0 else "-Infinity")


def _not_json(name: str) -> float:
    """`NaN`, `Infinity`, `-Infinity`: Python's json takes them, JavaScript's JSON.parse does not."""
    raise ValueError(f"{name} is not JSON")


def _not_finite(value) -> bool:
    """Whether a number in `value` is not finite (a literal such as 1e400: read as infinity, it would be written
    back as `Infinity`, which JSON.parse rejects)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_not_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_not_finite(v) for v in value)
    return False


@dataclass
class TransformersConfig:
    """OUTDIR's config.json in a transformers.js model folder (`config.json` beside `onnx/`), read before any model
    is written: transformers.js fetches a model's external data only when its
    `transformers.js_config.use_external_data_format` says so, so batch makes it say which files it wrote with
    data, and keeps every other value of the config as it was read. Whether it can (`problem`) is decided up front:
    a config that cannot be written back as read (not JSON as JSON.parse reads it, a number past a float's range,
    a lone surrogate, nesting deeper than Python reads) refuses the batch before anything is written where it
    would have to change, and is left untouched where it says the right thing already."""

    path: Path  # OUTDIR/config.json
    raw: bytes  # as read: DIR's (the copy's source), else OUTDIR's own
    config: dict | None  # None where it cannot be read (see `problem`)
    problem: str | None = None

    @classmethod
    def read(cls, source: Path, target: Path) -> TransformersConfig:
        raw = b"".join(_regular_bytes(source))
        try:
            config = json.loads(raw.decode("utf-8-sig"), parse_constant=_not_json)  # (transformers.js reads a BOM)
        except (UnicodeError, ValueError, RecursionError) as e:
            return cls(target, raw, None, f"cannot be read as JSON ({type(e).__name__})")
        if not isinstance(config, dict):
            return cls(target, raw, None, "is not a JSON object")
        try:
            (json.dumps(config, ensure_ascii=False) + "\n").encode("utf-8")
            infinite = _not_finite(config)
        except (UnicodeError, RecursionError) as e:  # (a lone surrogate: read, but not writable as UTF-8)
            return cls(target, raw, config, f"cannot be written back as read ({type(e).__name__})")
        if infinite:
            return cls(target, raw, config, "holds a number past a float's range, which would be written back as "
                       "`Infinity` (JSON.parse rejects it)")
        return cls(target, raw, config)

    @classmethod
    def planned(cls, out: Path, copies: list[tuple[Path, Path]], entries: list[Entry]) -> TransformersConfig | None:
        """OUTDIR's config.json as it will be before the models are written (None: there is none, or no model is
        written into OUTDIR/onnx/); refused (`SurgeonError`, exit 2) if it would have to change and cannot."""
        target, folder = out / "config.json", out / TRANSFORMERS_SUBFOLDER
        source = next((s for s, t in copies if t == target), target if target.exists() else None)
        planned = {Path(e.output).name: int(e.external) for e in entries
                   if e.error is None and Path(e.output).parent == folder}
        if source is None or not planned:
            return None
        config = cls.read(source, target)
        if config.problem and not config.says(planned):
            raise SurgeonError(source, f"{config.problem}, so batch cannot make it say which models in "
                               f"{TRANSFORMERS_SUBFOLDER}/ have external data", "transformers.js would fetch the "
                               "wrong data files: fix or remove the config, then run again")
        return config

    def value(self):
        section = (self.config or {}).get("transformers.js_config")
        return section.get("use_external_data_format") if isinstance(section, dict) else None

    def says(self, counts: dict[str, int]) -> bool:
        """Whether transformers.js reads `counts` (file name -> its data files) from the config, whichever base
        name a page gives (`base_names`)."""
        return all(data_files_read(self.value(), name, base) == n
                   for name, n in counts.items() for base in base_names(name))

    def update(self) -> str | None:
        """Make the config say how many data files each model in OUTDIR/onnx/ has, as each model file names them
        (`_data_files_named`): the written ones as written (never a data file an earlier run left), and the ones
        a failed or stopped run left as they are (the copy of DIR's config said what DIR's models had). Returns
        what was done, or None (the config says so already: left as copied, byte for byte)."""
        folder = self.path.parent / TRANSFORMERS_SUBFOLDER
        counts = {p.name: _data_files_named(p) for p in sorted(folder.glob("*.onnx"))}
        if self.says(counts):
            return None
        if self.problem:  # (only where the plan's external data was not written: a model with no stored tensor)
            return f"{self.path}: {self.problem}, so not updated: transformers.js may fetch the wrong data files"
        section = self.config.get("transformers.js_config")
        self.config["transformers.js_config"] = {**(section if isinstance(section, dict) else {}),
                                                 "use_external_data_format": counts}
        bom = "\ufeff" if self.raw.startswith(b"\xef\xbb\xbf") else ""
        with atomic_path(self.path, suffix=".json") as tmp:
            tmp.write_bytes((bom + json.dumps(self.config, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        shown = ", ".join(f"{k}: {v}" for k, v in counts.items() if v)
        return (f"{self.path}: transformers.js_config.use_external_data_format set to the data files written "
                f"({shown or 'none'}), so transformers.js fetches them")


def _data_files_named(model: Path) -> int:
    """How many data files of transformers.js's names the model file names, in the order it fetches them
    (`<name>_data`, `<name>_data_1`, ...): 1 for a model the writer wrote with `<name>.onnx_data`, 0 for one file
    (or a data file in another name, which transformers.js never fetches)."""
    try:
        named = {Path(loc).name for loc in wire.scan_model(model).locations}
    except (OSError, RuntimeError, ValueError, SurgeonError):
        return 0
    n = 0
    while f"{model.name}_data" + (f"_{n}" if n else "") in named:
        n += 1
    return n


# --------------------------------------------------------------------------------------------------- reporting
def _problem(e: Entry) -> str:
    """The entry's error for a line that names its model already: without the model's path in front, which the
    error's own one line carries (a row read "src/onnx/model.onnx: src/onnx/model.onnx: not a readable ...")."""
    head = f"{e.input}: "
    return e.error[len(head):] if e.error and e.error.startswith(head) else (e.error or "")


def entry_report(e: Entry) -> dict:
    """The per-model JSON report: the patch report (see PatchReport.to_dict) plus `status` and `error`."""
    base = dict(e.result) if e.result is not None else {
        "version": 1, "model": e.input, "output": e.output, "written": False, "options": e.options}
    base.update({"status": e.status, "error": e.error, "seconds": round(e.seconds, 3)})
    return base


def write_reports(entries: list[Entry]) -> None:
    for e in entries:
        if not e.ran or not e.report:
            continue
        try:
            with atomic_path(e.report, suffix=".json") as tmp:
                tmp.write_text(json.dumps(entry_report(e), indent=2) + "\n")
            e.report_written = True
        except OSError as exc:
            note = f"report {e.report} not written ({exc.strerror or exc})"
            e.error = f"{e.error}; {note}" if e.error else note
            e.status = FAILED


def summary_table(entries: list[Entry], jobs: int, seconds: float) -> str:
    rows = [("#", "status", "time", "rewritten", "refused", "model -> output, or the error")]
    for e in entries:
        s = (e.result or {}).get("summary", {})
        rewritten = s.get("rewritten", 0) + s.get("rewritten_unproven", 0) if s else None
        verified = (e.result or {}).get("verification") or {}
        if e.status == FAILED:
            what = e.error or "failed"
        else:
            what = f"{e.input} -> {e.output if e.result and e.result.get('written') else '(not written)'}"
            if verified.get("identical"):
                what += " (verified)"
        rows.append((str(e.number), e.status, f"{e.seconds:.1f}s" if e.seconds else "-",
                     "-" if rewritten is None else str(rewritten), "-" if not s else str(s.get("refused", 0)), what))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"batch: {len(entries)} model(s), {jobs} job(s), {seconds:.1f} s"]
    lines += [f"  {r[0]:>{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]:>{w[4]}}  {r[5]}" for r in rows]
    counts = {k: sum(e.status == k for e in entries) for k in (OK, UNCHANGED, REFUSED, FAILED)}
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)


def _size(e: Entry) -> str:
    """The written output's size, its external data included (the input's when nothing was written)."""
    path = Path(e.output if e.result and e.result.get("written") else e.input)
    data = external_data_path(path, e.data_files, e.options.get("data_suffix"))
    files = [path, data] if path == Path(e.output) else [path, *e.data_files]
    total = sum(f.stat().st_size for f in files if f.is_file())
    return human(total)


def variant_table(entries: list[Entry], root: str, jobs: int, seconds: float, copies: int) -> str:
    """The `batch DIR OUTDIR` table: one row per variant (module docstring)."""
    from ..graph.kernels import INTEGER_8BIT, NO_EXACT_LOWERING, SHIP_FOR_GPU, KernelReport

    rows = [("variant", "status", "size", "deform blocks resident", "no WebGPU kernel (CPU EP)", "verify", "time")]
    for e in entries:
        r = e.result or {}
        k = KernelReport.from_dict(r["webgpu"]) if r.get("webgpu") else None
        if k is None:
            resident = cpu = "-"
        else:
            resident = f"{k.blocks_resident}/{k.blocks}" if k.blocks else "no deform block"
            cpu = f"{k.cpu_nodes}" + (f": {KernelReport.ops_text({**k.inside, **_add(k.inside, k.outside)})}"
                                      if k.cpu_nodes else "")
            if k.jsep_only:
                cpu += f" (JSEP also: {KernelReport.ops_text(k.jsep_only)})"
        v = r.get("verification")
        verify = ("-" if e.status == FAILED else "(copy)" if e.status == UNCHANGED else
                  "not run" if v is None else "PASSED" if v.get("identical") else "FAILED")
        rows.append((str(Path(e.input).relative_to(root)), e.status, _size(e) if e.status != FAILED else "-",
                     resident, cpu, verify, f"{e.seconds:.1f}s" if e.seconds else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"batch {root}: {len(entries)} model(s), {copies} other file(s) copied unchanged, {jobs} job(s), "
             f"{seconds:.1f} s"]
    lines += ["  " + "  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r)).rstrip() for r in rows]
    lines += [f"  {e.input}: {_problem(e)}" for e in entries if e.error]
    eight_bit = [str(Path(e.input).relative_to(root)) for e in entries if (e.result or {}).get("webgpu")
                 and KernelReport.from_dict(e.result["webgpu"]).integer_8bit()[0]]
    if eight_bit:
        lines.append(f"  8-bit file(s) {', '.join(eight_bit)}: their {'/'.join(INTEGER_8BIT)} nodes stay on the CPU "
                     f"EP: {NO_EXACT_LOWERING}; {SHIP_FOR_GPU}")
    counts = {k: sum(e.status == k for e in entries) for k in (OK, UNCHANGED, REFUSED, FAILED)}
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in b}


def exit_code(entries: list[Entry]) -> int:
    if any(e.status == FAILED for e in entries):
        return 1
    if any(e.status == REFUSED for e in entries):
        return FINDING_EXIT
    return 0


class Progress:
    """Progress on stderr: on a terminal, a bar per running model and one overall, redrawn in place; otherwise
    one line per stage change (logs stay readable)."""

    WIDTH = 24

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.drawn = 0
        self.entries: list[Entry] = []
        self.t0 = time.perf_counter()
        self.last: dict[int, str] = {}

    def start(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.t0 = time.perf_counter()
        for e in entries:
            if e.status == FAILED:
                self._line(f"[{e.number}/{len(entries)}] {e.input}: failed: {_problem(e)}")

    def tick(self) -> None:
        if self.tty:
            self._redraw()

    def stage(self, e: Entry) -> None:
        """Off a terminal: one line per stage a worker reports, as it is reported (sampling would skip stages)."""
        if not self.tty and self.last.get(e.number) != e.stage:
            self.last[e.number] = e.stage
            self._line(f"[{e.number}/{len(self.entries)}] {e.input}: {e.stage}")

    def finished(self, e: Entry) -> None:
        self.last[e.number] = "done"
        self._line(f"[{e.number}/{len(self.entries)}] {e.input}: {e.status} ({e.seconds:.1f} s)"
                   + (f": {_problem(e)}" if e.error else ""))

    def close(self) -> None:
        if self.tty:
            self._clear()
            self.stream.flush()

    def _bar(self, fraction: float) -> str:
        n = int(round(fraction * self.WIDTH))
        return "[" + "#" * n + "-" * (self.WIDTH - n) + "]"

    def _line(self, text: str) -> None:
        if self.tty:
            self._clear()
        self.stream.write(text + "\n")
        if self.tty:
            self._redraw()
        self.stream.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
            self.drawn = 0

    def _redraw(self) -> None:
        self._clear()
        total = len(self.entries) or 1
        done = sum(e.stage == "done" or e.status == FAILED for e in self.entries)
        share = sum(STAGE_FRACTION.get(e.stage, 0.0) for e in self.entries if e.status == "running")
        lines = [f"  {self._bar(STAGE_FRACTION.get(e.stage, 0.0))} {e.stage:<7} {Path(e.input).name}"
                 for e in self.entries if e.status == "running"]
        elapsed = time.perf_counter() - self.t0
        lines.append(f"{self._bar((done + share) / total)} {done}/{total} models  {elapsed:.0f} s")
        self.stream.write("\n".join(lines) + "\n")
        self.drawn = len(lines)
        self.stream.flush()


def main(manifest: str | None, globs: list[str], cli: dict, jobs: int | None, summary_json: str | None,
         show_progress: bool = True, out_folder: str | None = None) -> int:
    """The `batch` command: plan, run, write reports and the summary; returns the exit code. With `out_folder`,
    `manifest` is a model folder (`batch DIR OUTDIR`, see the module docstring)."""
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs < 1:
        raise SurgeonError(None, f"--jobs must be at least 1 (got {jobs})")
    if summary_json is not None and not Path(summary_json).parent.is_dir():
        raise SurgeonError(summary_json, f"folder {Path(summary_json).parent} does not exist")
    for key in ("out_dir", "report_dir"):
        if cli.get(key) is not None and not Path(cli[key]).is_dir():
            raise SurgeonError(cli[key], f"--{key.replace('_', '-')} is not an existing folder")
    copies: list[tuple[Path, Path]] = []
    config = None
    if out_folder is not None:
        entries, copies, config = plan_folder(manifest, out_folder, cli, summary_json)
        copy_files(copies)
    else:
        entries = plan(manifest, globs, cli, summary_json)
    jobs = max(1, min(jobs, sum(e.error is None for e in entries) or 1))
    try:
        seconds = run(entries, jobs, Progress() if show_progress else None)
    except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed: the config says what onnx/ holds all the same
        with contextlib.suppress(OSError, SurgeonError):
            config and config.update()
        raise
    write_reports(entries)  # every file before the table is printed: a stdout that fails costs none (streams.py)
    wrote(*(target for _, target in copies), *(e.output for e in entries if (e.result or {}).get("written")),
          *(e.report for e in entries if e.report_written), *([] if config is None else [config.path]))
    note = config and config.update()
    if summary_json is not None:
        data = {"jobs": jobs, "seconds": round(seconds, 3), "exit_code": exit_code(entries),
                "models": [entry_report(e) | {"report": e.report if e.report_written else None} for e in entries]}
        try:
            with atomic_path(summary_json, suffix=".json") as tmp:
                tmp.write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise SurgeonError(summary_json, f"could not be written ({exc.strerror or exc})") from None
        wrote(summary_json)
    print(variant_table(entries, manifest, jobs, seconds, len(copies)) if out_folder is not None else
          summary_table(entries, jobs, seconds))
    if note:
        print(note)
    return exit_code(entries)

