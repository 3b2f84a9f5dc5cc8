"""Folders of the command's own in TMPDIR, for what its checks write there (ORT CPU's graphs of a model, the model
kept aside for a proof, the outputs `verify` compares), removed on every way out, and one line when TMPDIR runs out
of space.

Why here: onnxruntime says a full disk while it saves a graph as "Protobuf serialization failed" or as a FAIL naming
its own source file, with no errno, and a forked child (background.py) stopped by its parent cannot remove what it
wrote. So each use of TMPDIR is a `scratch` folder, made by the caller (a child writes inside it, the caller removes
it after the child is reaped), and a failure while it is in use is judged by the space left there: none left (or an
errno saying so) is TMPDIR's problem, named as such with the space it had, not the library's traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import SurgeonError
from .sizes import human

_NEARLY_NONE = 1 << 20  # what a write that ran out of space leaves free, at most (a few blocks)
_OPEN = threading.local()  # `stack`: what this thread keeps in TMPDIR now, outermost first, with the space free then


class TmpdirFull(SurgeonError):
    """TMPDIR ran out of space (one line, exit 2). A check that turns errors into a verdict of its own lets this
    one through: the model is not at fault."""


@contextmanager
def scratch(prefix: str, what: str) -> Iterator[Path]:
    """A new folder in TMPDIR for `what` (the words the line names it by: "ORT CPU's graphs of the model"), removed
    with everything in it when the block ends, however it ends. A failure inside the block with TMPDIR out of space
    raises `TmpdirFull`, naming TMPDIR, what it holds for the command, and the space the command had there."""
    root = tempfile.gettempdir()
    stack = _OPEN.__dict__.setdefault("stack", [])
    stack.append((what, _free(root)))
    try:
        try:
            folder = Path(tempfile.mkdtemp(prefix=prefix))
        except OSError as exc:
            if _out_of_space(exc, root):
                raise _full(root, stack) from None
            raise SurgeonError(root, f"the temporary folder (TMPDIR) cannot be used ({exc.strerror or exc})",
                               "set TMPDIR to a folder you can write to") from None
        try:
            yield folder
        except TmpdirFull:
            raise
        except Exception as exc:
            if _out_of_space(exc, folder):
                raise _full(root, stack) from None
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        stack.pop()


def _full(root: str, stack: list[tuple[str, int | None]]) -> TmpdirFull:
    """The line for TMPDIR out of space: what the command keeps there now, and the space it had when it began to."""
    had = stack[0][1]
    whats = " and ".join(dict.fromkeys(what for what, _ in stack))
    space = f"more than the {human(had)} that was free there" if had is not None else "more than it has"
    return TmpdirFull(root, f"the temporary folder (TMPDIR) ran out of space: {space} is needed for {whats}",
                      "set TMPDIR to a folder with more free space")


def _out_of_space(exc: BaseException, folder: str | Path) -> bool:
    """Whether the failure `exc` is the file system's being full: an errno that says so anywhere in its chain, or
    (a library that says it otherwise) next to nothing left free in `folder`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    free = _free(folder)
    return free is not None and free < _NEARLY_NONE


def _free(folder: str | Path) -> int | None:
    """The bytes a process may still write in `folder`'s file system; None where that cannot be told."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize
