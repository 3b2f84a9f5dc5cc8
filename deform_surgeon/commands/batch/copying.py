"""DIR's other files copied into OUTDIR unchanged (`batch DIR OUTDIR`): all or none, and only the bytes of a regular
file as it was when opened."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

from ...base.errors import SurgeonError
from ...files import atomic_path
from ...files.io_check import file_kind


def copy_files(copies: list[tuple[Path, Path]]) -> None:
    """Copy DIR's other files (`copies`: source, target) into OUTDIR, all or none: each into a temporary name beside
    its target, and all renamed into place once every one is copied (a copy that fails, or Ctrl-C, leaves OUTDIR as
    it was: a FIFO config.json left an empty OUTDIR/onnx/ and the files before it copied)."""
    with ExitStack() as staged:  # (each atomic_path renames on a clean exit, and removes its file on any other)
        for source, target in copies:
            _copy_bounded(source, staged.enter_context(atomic_path(target, suffix=source.suffix)))


def _copy_bounded(source: Path, target: Path) -> None:
    """Copy `source` into `target` as `regular_bytes` reads it."""
    try:
        with open(target, "wb") as out:
            for chunk in regular_bytes(source):
                out.write(chunk)
    except OSError as exc:
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None


def regular_bytes(source: Path) -> Iterator[bytes]:
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
