"""Work that runs beside the main road on a second core: the whole-model checks (onnx.checker and shape inference).

Why a process and not a thread: onnx's checker and shape inference hold the GIL (measured: a thread running the
checker beside Python work takes as long as the two one after the other). A forked child sees the caller's objects
as they were when it started (copy on write: nothing is copied or serialized to start it), computes, sends its
result back through a pipe and ends with `os._exit`, so no `finally` of the caller runs twice (temporary files stay
the caller's to remove).

`Background(fn, *args).result()` returns what `fn(*args)` returned, or raises the `SurgeonError` it raised (its file
and problem kept). Where a child cannot help or cannot be had (one core, not Linux, a daemonic batch worker that
may not have children, a child that died), `fn` runs in the caller when the result is asked for: the same
answer, later. `Background(fn, *args, retry=False)` raises `ChildDied` instead when the child died without an
answer: for work that is in a child because of its memory (verify.py runs each model so), a child the system
killed for its memory must not be run again in the caller.
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


class ChildDied(Exception):
    """The child ended without an answer (a signal: the kernel's OOM killer sends SIGKILL), with `retry=False`."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode
        how = (f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else
               f"ended with exit code {exitcode}")
        super().__init__(f"its process {how} before it answered")


class Background:
    """`fn(*args)` computed in a forked child (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, retry: bool = True) -> None:
        self._fn, self._args, self._retry = fn, args, retry
        self._proc = self._conn = None
        self._answered = False
        self.exitcode: int | None = None
        if _can_fork():
            for stream in (sys.stdout, sys.stderr):  # the child flushes its copy of these buffers when it ends:
                try:  # they must be empty (one that cannot take them fails the command where it is written to)
                    if stream is not None:
                        stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            ctx = multiprocessing.get_context("fork")
            self._conn, child_end = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_child, args=(child_end, fn, args), daemon=True)
            # the child is born with SIGTERM blocked and unblocks it once it has its own handler (`_child`): a
            # SIGTERM from the parent can never run the caller's handler (the CLI's, which raises) in the child
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                self._proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            child_end.close()

    def result(self) -> Any:
        if self._proc is None:
            return self._fn(*self._args)
        try:
            kind, value = self._conn.recv()
            self._answered = True  # (the child is ending on its own now: it is not stopped)
        except EOFError:  # the child died without an answer: ask here (unless told not to)
            kind, value = "died", None
        finally:
            self.close()
        if kind == "died" and not self._retry:
            raise ChildDied(self.exitcode)
        if kind == "ok":
            return value
        if kind == "error":
            raise SurgeonError(*value)
        return self._fn(*self._args)  # anything else the child met is met here again, as it is

    def close(self) -> None:
        """Reap the child, stopping it first if its answer was not taken (the caller is leaving: an error, a
        signal): it may be computing, or blocked sending an answer nobody will read."""
        if self._proc is None:
            return
        if not self._answered:
            self._proc.terminate()
        self._conn.close()
        self._proc.join()
        self.exitcode = self._proc.exitcode
        self._proc = None


def _child(conn, fn: Callable[..., Any], args: tuple) -> None:
    """Compute and send the answer. Stopping is the parent's: SIGTERM ends this child at once and quietly (not
    through the handler it inherited, which would raise and print a traceback from here), and Ctrl-C, which
    reaches the whole process group, is left to the parent, which then stops the child."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        try:
            answer = ("ok", fn(*args))
        except SurgeonError as exc:
            answer = ("error", (exc.path, exc.problem, exc.hint))
        except BaseException:  # noqa: BLE001 (the caller runs fn again and meets it itself)
            answer = ("retry", None)
        conn.send(answer)
    except BaseException:  # noqa: BLE001 (the answer cannot be sent: the parent has left; nobody to tell)
        pass
    finally:
        conn.close()
