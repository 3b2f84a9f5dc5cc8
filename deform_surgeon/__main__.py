"""`python -m deform_surgeon` and the `deform-surgeon` command (`main`).

Why not `cli.main` directly: the command line imports onnx, onnx-graphsurgeon and numpy before it can parse an
argument, a second or more. Ctrl-C or SIGTERM in that time must end the command as at any other moment (one line,
exit 130 / 143), not as a KeyboardInterrupt traceback, so the handlers are installed here first, by a module that
imports nothing heavy (the package's `__init__` imports its API lazily).

Why the command may start itself once more (`huge_pages_environ`): ORT CPU, without an arena, takes every tensor
of a run from glibc's malloc and gives it back when the run ends, so each of the many short ORT runs of a `patch`
(its proofs, its folding) faults its tensors in again, 4 KiB at a time. On the real BiRefNet-lite 1024 that was
19 s of a 35 s patch spent in the kernel (docs/fitting.md, "Cost on the real BiRefNet-lite 1024"). glibc backs its
large allocations with transparent huge pages (2 MiB) when told so at start-up,
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35 and later), and only the environment can tell it: where the
kernel gives huge pages only to memory that asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` is
`madvise`, the common default), the command sets it and replaces itself with the same command line (`os.execve`:
the same process, nothing left behind). A `GLIBC_TUNABLES` that already names `glibc.malloc.hugetlb` is the user's
choice and is kept (`=0` turns it off). The setting is inherited by what the command starts (batch workers, node,
Chromium), as any environment variable.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping

from .errors import catch_signals, stopped_exit

HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def run() -> int:
    if threading.current_thread() is threading.main_thread():
        catch_signals()
    try:
        from .cli import main as cli_main
    except BaseException as exc:
        code = stopped_exit(exc)
        if code is None:
            raise
        return code
    return cli_main()


def main() -> int:
    """The command: started once more with huge pages where that helps (see the module docstring), then `run`."""
    environ = huge_pages_environ(os.environ, _glibc_version(), _thp_mode())
    if environ is not None:
        try:
            os.execve(sys.executable, sys.orig_argv, environ)
        except OSError:  # cannot start itself again (a frozen or vanished interpreter): run as it is
            pass
    return run()


def huge_pages_environ(environ: Mapping[str, str], glibc: tuple[int, int] | None, thp_mode: str | None
                       ) -> dict[str, str] | None:
    """The environment to start the command again in, with glibc's huge pages asked for; None to run as it is:
    not glibc 2.35 or later, the kernel's transparent huge pages not `madvise` (`always`: every allocation has
    them already; `never`: none can), or `GLIBC_TUNABLES` already naming the setting."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if glibc is None or glibc < (2, 35) or thp_mode != "madvise" or "glibc.malloc.hugetlb" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # not glibc, or not a POSIX system
        return None


def _thp_mode() -> str | None:
    """The bracketed word of `always [madvise] never`, or None where the file is not there."""
    try:
        with open(THP_MODE) as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


if __name__ == "__main__":
    raise SystemExit(main())
