"""The command's standard streams: its report goes to stdout, its errors to stderr, and either may be closed
(`>&-`), full (`>/dev/full`), or a pipe whose reader has left (`| head -1`).

What the command does then (docs/robustness.md, "Exit codes"):
- a stream closed when it starts: refused before any work, one line on the other stream, exit 2 (a closed stream's
  descriptor would be the next file opened, and a child's output would land in it);
- a command writes its files before it prints its report, so a stdout that fails while the report is printed costs
  no file: one line on stderr names the stream, why, and the files written all the same (`WRITTEN`), exit 2;
- a reader that left (EPIPE: `| head -1` has what it wanted) ends the command quietly with 141, as a command killed
  by SIGPIPE ends; its files were written before;
- an error line goes to stderr, or to stdout where stderr cannot take it (`say`).
Either way no traceback, and nothing at the interpreter's exit: the failed stream is pointed at /dev/null, so the
interpreter's last flush of what it still holds succeeds.

Why a wrapper (`guarded`): an OSError from a print carries no file name, and a command's own errors of that kind
(a socket, a child) must not be taken for its stdout's; `StreamFailed` says which stream failed.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

WRITTEN: list[str] = []  # the files the command wrote (`wrote`), for the line a failed stream ends with
PIPE_CLOSED_EXIT = 128 + 13  # 141: how a command killed by SIGPIPE ends (Python ignores SIGPIPE: EPIPE instead)


class StreamFailed(Exception):
    """A write to the command's stdout or stderr (`name`, the text stream `stream`) failed: `error`, the OSError
    (its errno says why)."""

    def __init__(self, name: str, stream, error: OSError) -> None:
        super().__init__(f"{name}: could not be written ({error.strerror or error})")
        self.name, self.stream, self.error = name, stream, error


class _Guarded:
    """A text stream whose failed writes and flushes raise `StreamFailed`; everything else is the stream's."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StreamFailed(self._name, self._stream, exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StreamFailed(self._name, self._stream, exc) from None

    def __getattr__(self, attr: str):
        return getattr(self._stream, attr)


def closed_stream() -> int | None:
    """Before any work: where stdout or stderr is closed (Python starts with it None), the refusal's exit code
    (2), its line said on the other stream if that is open; None when both are open."""
    out, err = sys.stdout is None, sys.stderr is None
    if not (out or err):
        return None
    if out != err:
        name, other, redirect = ("stdout", sys.stderr, ">/dev/null") if out else ("stderr", sys.stdout, "2>/dev/null")
        try:
            print(f"deform-surgeon: error: {name} is closed, so what the command says there would be lost; nothing "
                  f"was done (give {redirect} to discard it)", file=other, flush=True)
        except OSError:  # (the other one full, or its reader gone: the exit code says it)
            _discard(other)
    return 2


@contextmanager
def guarded() -> Iterator[None]:
    """stdout and stderr as `_Guarded` streams while the block runs (the command), put back after."""
    saved = sys.stdout, sys.stderr
    WRITTEN.clear()
    sys.stdout, sys.stderr = _Guarded(saved[0], "stdout"), _Guarded(saved[1], "stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def wrote(*paths: object) -> None:
    """Note files the command has written (None: not written), for the line a failed stream ends with."""
    WRITTEN.extend(str(p) for p in paths if p is not None)


def failed_exit(exc: StreamFailed) -> int:
    """The end of a command whose stream failed (the module docstring): its exit code, its line said."""
    _discard(exc.stream)
    if exc.error.errno == errno.EPIPE:
        return PIPE_CLOSED_EXIT
    files = ", ".join(WRITTEN[:3]) + (f" and {len(WRITTEN) - 3} more" if len(WRITTEN) > 3 else "")
    say(f"deform-surgeon: error: {exc}; " + (f"written all the same: {files}" if WRITTEN else "no file was written"))
    return 2


def say(line: str) -> None:
    """One line for the user: on stderr, or on stdout where stderr cannot take it; nowhere if neither can."""
    for stream in (sys.stderr, sys.stdout):
        try:
            print(line, file=stream, flush=True)
            return
        except (StreamFailed, OSError, ValueError, AttributeError):
            continue


def _discard(stream) -> None:
    """Point the failed stream's descriptor at /dev/null: what its buffer still holds then goes nowhere, quietly,
    when it is flushed again (at the interpreter's exit)."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, OSError, ValueError):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)
