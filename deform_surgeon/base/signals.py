"""Ctrl-C and SIGTERM held back while a few steps that must finish together run, then handled as they would have
been: the writer's renames of a model and its data file (files/pair.py: a signal between them left an OUT naming
a data file not its own), and batch's start of a worker (commands/batch/workers.py: one raised inside
`Process.start()` left a worker the batch did not know of).

How a signal reaches the handler, and why this holds it wherever it lands: a Ctrl-C from the terminal is sent to
the whole process group, and the kernel gives a process-directed signal to any thread that does not block it
(numpy's and ORT's worker threads included). CPython's C handler, on whichever thread took it, only marks the
signal; the Python handler then runs in the main thread at its next bytecode boundary. So the signal is held by
replacing the Python handlers (not by blocking it in the main thread, which only moves it to another thread), and
every signal marked before the block ends is seen: restoring a handler (`signal.signal`) first runs the handlers
of the signals already marked. One that another thread takes after the block ends runs the restored handler,
after the steps. Python's handlers can only be changed in the main thread; elsewhere the steps run as they are.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held(block_ctrl_c: bool = False) -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block is done, then the first one that came is handled by the handler
    it would have met (a callable is called; SIG_DFL is raised again; SIG_IGN stays ignored). `block_ctrl_c` also
    blocks Ctrl-C in this thread (`pthread_sigmask`), for a block that starts a process: the process inherits the
    mask through its exec, and so never sees a Ctrl-C in its start-up (batch's fork server)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, object]] = []
    previous = {sig: signal.getsignal(sig) for sig in HELD}
    previous = {sig: h for sig, h in previous.items() if h is not None}  # (None: not a handler Python can put back)
    mask = None
    try:
        for sig in previous:
            signal.signal(sig, lambda signum, frame: caught.append((signum, frame)))
        if block_ctrl_c:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (a Ctrl-C that waited is marked now, and seen below)
        _restore(previous)  # (first runs the handlers of the signals marked so far: they append to `caught`)
        for sig, frame in caught[:1]:
            handler = previous[sig]
            if callable(handler):
                handler(sig, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(sig)


def _restore(handlers: dict) -> None:
    """Put every handler of `handlers` back, even where a signal marked meanwhile runs a handler already put back
    and it raises (`signal.signal` runs the marked signals' handlers before it changes one): a handler left as
    this module's recorder would make every later Ctrl-C (or SIGTERM) of the process do nothing. The first such
    exception is raised once all are back: that signal was handled as it would have been after the block."""
    raised: BaseException | None = None
    for sig, handler in handlers.items():
        for _ in range(100):  # (each failed try consumed a marked signal: there are only so many)
            try:
                signal.signal(sig, handler)
                break
            except BaseException as exc:  # noqa: BLE001 (a KeyboardInterrupt from a restored handler, kept)
                raised = raised or exc
    if raised is not None:
        raise raised
