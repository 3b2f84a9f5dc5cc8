"""Work that runs beside the main road on a second core: the whole-model checks (onnx.checker and shape inference).

Why a process and not a thread: onnx's checker and shape inference hold the GIL (measured: a thread running the
checker beside Python work takes as long as the two one after the other). A forked child sees the caller's objects
as they were when it started (copy on write: nothing is copied or serialized to start it), computes, sends its
result back through a pipe and ends with `os._exit`, so no `finally` of the caller runs twice (temporary files stay
the caller's to remove).

`Background(fn, *args).result()` returns what `fn(*args)` returned, or raises the `SurgeonError` it raised (its file
and problem kept). Where a child cannot help or cannot be had (one core, not Linux, a daemonic batch worker that
may not have children, a child that died), `fn` runs in the caller when the result is asked for: the same
answer, later.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from .errors import SurgeonError


def _can_fork() -> bool:
    """Linux (where fork is the system's own way to start a process; macOS's system libraries do not promise to
    survive it), more than one core, and not a daemonic process (a batch worker: those may have no children)."""
    return (sys.platform.startswith("linux") and (os.cpu_count() or 1) > 1
            and not multiprocessing.current_process().daemon)


class Background:
    """`fn(*args)` computed in a forked child (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._proc = self._conn = None
        if _can_fork():
            sys.stdout.flush()  # the child flushes its copy of these buffers when it ends: they must be empty
            sys.stderr.flush()
            ctx = multiprocessing.get_context("fork")
            self._conn, child_end = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_child, args=(child_end, fn, args), daemon=True)
            self._proc.start()
            child_end.close()

    def result(self) -> Any:
        if self._proc is None:
            return self._fn(*self._args)
        try:
            kind, value = self._conn.recv()
        except EOFError:  # the child died without an answer: ask here
            kind, value = "retry", None
        finally:
            self.close()
        if kind == "ok":
            return value
        if kind == "error":
            raise SurgeonError(*value)
        return self._fn(*self._args)  # anything else the child met is met here again, as it is

    def close(self) -> None:
        """Reap the child, stopping it first if it has not answered (the caller is leaving: an error, Ctrl-C)."""
        if self._proc is None:
            return
        if not self._conn.poll():
            self._proc.terminate()
        self._proc.join()
        self._conn.close()
        self._proc = None


def _child(conn, fn: Callable[..., Any], args: tuple) -> None:
    # a forked child inherits the CLI's SIGTERM handler (which raises `Terminated`): `close()`'s terminate would
    # then print the child's traceback on stderr beside the command's one-line error; the default handler exits
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        conn.send(("ok", fn(*args)))
    except SurgeonError as exc:
        conn.send(("error", (exc.path, exc.problem, exc.hint)))
    except BaseException:  # noqa: BLE001 (the caller runs fn again and meets it itself)
        conn.send(("retry", None))
    finally:
        conn.close()
