"""`python -m deform_surgeon` and the `deform-surgeon` command (`run`).

Why not `cli.main` directly: the command line imports onnx, onnx-graphsurgeon and numpy before it can parse an
argument, a second or more. Ctrl-C or SIGTERM in that time must end the command as at any other moment (one line,
exit 130 / 143), not as a KeyboardInterrupt traceback, so the handlers are installed here first, by a module that
imports nothing heavy (the package's `__init__` imports its API lazily).
"""

from __future__ import annotations

import threading

from .errors import catch_signals, stopped_exit


def run() -> int:
    if threading.current_thread() is threading.main_thread():
        catch_signals()
    try:
        from .cli import main
    except BaseException as exc:
        code = stopped_exit(exc)
        if code is None:
            raise
        return code
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
