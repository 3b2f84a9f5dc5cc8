"""One error type for everything a user can get wrong.

Every failure a user can cause (a missing file, a model that is not ONNX, an output folder that does not exist,
a patched model that fails verification) ends as one line on stderr, `FILE: problem`, and exit code 2, with the
input untouched and no output written. Raising `SurgeonError` anywhere below the CLI gives exactly that.
"""

from __future__ import annotations

import functools
import signal
import sys

TYPE_CHECKING = False  # (typing itself is not imported: see below)
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any, TypeVar

    _F = TypeVar("_F", bound=Callable[..., Any])
# The command imports this module before its signal handlers are in place (`__main__.py`), so it imports only what
# Python's start-up has mostly loaded already: `inspect` where it is used, typing not at all (they were 15-25 ms).


class SurgeonError(Exception):
    """A failure caused by the input, reported as one line naming the file and the problem."""

    exit_code = 2

    def __init__(self, path: str | Path | None, problem: str, hint: str | None = None) -> None:
        self.path = None if path is None else str(path).replace("\0", "\\0")  # a NUL byte shown, not written
        self.problem = problem
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = self.problem if self.path is None else f"{self.path}: {self.problem}"
        if self.hint:
            text += f" ({self.hint})"
        return " ".join(text.split())


class VerificationError(SurgeonError):
    """The patched model's outputs differ from the original's; nothing was written."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every `finally` (temporary files, worker processes,
    browsers) runs on the way out; the CLI then exits 143."""

    exit_code = 143


SIGNALLED: list[int] = []  # the signals that stopped the command, in order (see `raise_on_signal`)


def raise_on_signal(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM as exceptions (KeyboardInterrupt, `Terminated`), so that every `finally` (temporary files,
    worker processes, browsers) runs on the way out; remembered, so that whatever a library made of the exception
    (onnxruntime's import turns it into "ImportError: initialization failed") the command still ends as stopped."""
    SIGNALLED.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def catch_signals() -> dict[int, Any]:
    """Install `raise_on_signal` for SIGINT and SIGTERM (main thread only); returns the handlers it replaced."""
    SIGNALLED.clear()
    return {sig: signal.signal(sig, raise_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def stopped_exit(exc: BaseException) -> int | None:
    """If `exc` ends a command stopped by a signal: print its one line and return its exit code (130 for Ctrl-C,
    143 for SIGTERM); else None."""
    if not (SIGNALLED or isinstance(exc, KeyboardInterrupt)):
        return None
    signum = SIGNALLED[0] if SIGNALLED else signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    try:
        print(f"deform-surgeon: {'terminated' if signum == signal.SIGTERM else 'interrupted'}", file=sys.stderr)
    except Exception:  # noqa: BLE001 (stderr full or gone: the exit code still says it)
        pass
    return 128 + signum


def api_call(fn: _F) -> _F:
    """A public API function whose user errors are `SurgeonError`s, as on the command line: arguments it does not
    take (a misspelt or unknown option) and an `OSError` about a file (permission denied, a name too long, a file
    removed under it), which would otherwise reach the user as a TypeError or a traceback."""
    import inspect

    signature = inspect.signature(fn)
    takes = ", ".join(signature.parameters)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            problem = str(exc).replace(f"{fn.__name__}() ", "")
            raise SurgeonError(None, f"{fn.__name__}(): {problem}", f"it takes {takes}") from None
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            if exc.filename is None:
                raise
            raise SurgeonError(exc.filename, f"cannot be used ({exc.strerror or exc})") from None

    return call  # type: ignore[return-value]
