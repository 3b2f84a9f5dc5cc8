"""`batch DIR OUTDIR` planned: every `.onnx` below DIR an entry patched into the same relative name in OUTDIR, the
other files to copy, OUTDIR's folders, and its config.json, all checked before anything is written."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...base.errors import SurgeonError
from ...files import wire
from ...files.io_check import file_kind
from ...files.pair import is_own_data_name
from .collisions import check_collisions
from .entry import OPTIONS, SWITCHES, Entry
from .js_config import TRANSFORMERS_SUBFOLDER, TransformersConfig


def plan_folder(folder: str, out_dir: str, cli: dict, summary: str | None = None
                ) -> tuple[list[Entry], list[tuple[Path, Path]], TransformersConfig | None]:
    """The entries of `batch DIR OUTDIR` (the package's docstring), the (source, target) files to copy unchanged, and
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
        check_collisions(entries, summary, copies, whole=True)
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


def _data_name(model: Path, src: Path) -> dict:
    """The data file name of a model of a transformers.js folder (`onnx/` beside a `config.json`): always
    `<name>.onnx_data`, the name transformers.js fetches and hands ORT (`data_suffix`), whatever the input's is
    named (a `model.onnx.data` input was written as `.data`, which the folder's pipeline never fetched)."""
    ours = model.parent == src / TRANSFORMERS_SUBFOLDER and (src / "config.json").is_file()
    return {"data_suffix": "_data"} if ours else {}


def _folder_link(path: Path, src: Path) -> bool:
    """Whether the walk of DIR goes into `path`: yes for a folder, and for a link to a folder inside DIR (its
    models and files are patched and copied under the link's name, as `cp -rL` would); a link to a folder outside
    DIR, or to one that holds the link (a loop), is refused, one line, never skipped without a word."""
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
