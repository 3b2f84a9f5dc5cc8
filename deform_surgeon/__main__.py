"""`python -m deform_surgeon` and the `deform-surgeon` command (`main`).

Why not `cli.main` directly: the command line imports onnx, onnx-graphsurgeon and numpy before it can parse an
argument, a second or more. Ctrl-C or SIGTERM in that time must end the command as at any other moment (one line,
exit 130 / 143), not as a KeyboardInterrupt traceback, so the handlers are installed here first, by a module that
imports nothing heavy (the package's `__init__` imports nothing: its API is imported when first used; `errors`
imports only the standard library's light modules), before anything else `main` does.

Why the command may start itself once more (`huge_pages_environ`): ORT CPU, without an arena, takes every tensor
of a run from glibc's malloc and gives it back when the run ends, so each of the many short ORT runs of a `patch`
(its proofs, its folding) faults its tensors in again, 4 KiB at a time. On the real BiRefNet-lite 1024 that was
19 s of a 35 s patch spent in the kernel (docs/fitting.md, "Cost on the real BiRefNet-lite 1024"). glibc backs its
large allocations with transparent huge pages (2 MiB) when told so at start-up,
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35 and later), and only the environment can tell it: where the
kernel gives huge pages only to memory that asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` is
`madvise`, the common default), the command sets it and replaces itself with the same command line (`os.execve`:
the same process, nothing left behind). Only where that runs this command again and nothing else
(`restarts_exactly`): a script that sets `sys.argv` and calls `main()` would run again from its first line, so
there the command runs without huge pages (glibc reads the setting at start-up only) and `patch --verbose` says so.
A `GLIBC_TUNABLES` that already names `glibc.malloc.hugetlb` is the user's choice and is kept (`=0` turns it off).
The setting is inherited by what the command starts (batch workers, node, Chromium), as any environment variable.
"""

from __future__ import annotations

import os
import sys

from .base.errors import catch_signals, stopped_exit

TYPE_CHECKING = False  # (typing and threading are not imported before the handlers: errors.py says why)
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def run(note: str | None = None) -> int:
    """The command in this process: the signal handlers first, then the command line (`note`: what --verbose says
    about huge pages)."""
    _catch_signals()
    try:
        from .commands.cli import main as cli_main
    except BaseException as exc:
        code = stopped_exit(exc)
        if code is None:
            raise
        return code
    return cli_main(start_note=note)


def main() -> int:
    """The command (the console script's and `python -m deform_surgeon`'s): started once more with huge pages where
    that helps (the module docstring), but only where starting again runs this command and nothing else
    (`restarts_exactly`). Called from a script (which set `sys.argv`, `python - <<EOF`, `-c`), a start again would
    run the script again from its first line (its side effects twice; from stdin, nothing at all: it is at its
    end), so the command runs as it is and --verbose says why."""
    _catch_signals()  # before anything else: a Ctrl-C here is one line too
    try:
        environ = huge_pages_environ(os.environ, _glibc_version(), _thp_mode())
        if environ is not None and restarts_exactly(sys.orig_argv, sys.argv, sys.modules.get("__main__")):
            try:
                os.execve(sys.executable, sys.orig_argv, environ)
            except OSError:  # cannot start itself again (a frozen or vanished interpreter): run as it is
                pass
            note = "huge pages: not asked for (the command could not start itself again)"
        elif environ is not None:
            note = ("huge pages: not asked for: glibc reads GLIBC_TUNABLES only when a process starts, and this one "
                    "was not started as `deform-surgeon` or `python -m deform_surgeon` (starting it again would run "
                    f"its caller again); set GLIBC_TUNABLES={HUGE_PAGES} before Python starts to have them")
        else:
            note = huge_pages_state(os.environ, _glibc_version(), _thp_mode())
    except BaseException as exc:
        code = stopped_exit(exc)
        if code is None:
            raise
        return code
    return run(note)


def _catch_signals() -> None:
    """`errors.catch_signals`, where it can be: in the main thread only (a `main()` called from another thread
    leaves signals to its caller; signal.signal raises ValueError there)."""
    try:
        catch_signals()
    except ValueError:
        pass


def restarts_exactly(orig_argv: Sequence[str], argv: Sequence[str], main_module: object) -> bool:
    """Whether running `orig_argv` (the interpreter's own command line) again runs this command with the same
    arguments and nothing else: the process was started as `python [options] -m deform_surgeon ARGS` or as the
    console script `deform-surgeon ARGS` (the file Python ran as `__main__`), and ARGS are still `argv[1:]`."""
    args = list(argv[1:])
    if len(orig_argv) <= len(args) or list(orig_argv[len(orig_argv) - len(args):]) != args:
        return False
    head = list(orig_argv[:len(orig_argv) - len(args)])
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name == f"{__package__}.__main__":
        return head[-2:] == ["-m", __package__] or head[-1] == f"-m{__package__}"
    file = getattr(main_module, "__file__", None)
    return spec is None and isinstance(file, str) and os.path.basename(file) == "deform-surgeon" and \
        head[-1] == file and head[-1] == argv[0]


def huge_pages_state(environ: Mapping[str, str], glibc: tuple[int, int] | None, thp_mode: str | None) -> str:
    """What --verbose says when the command does not start itself again (`huge_pages_environ` gave None)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return f"huge pages: as GLIBC_TUNABLES={tunables} asks"
    if glibc is None or glibc < (2, 35):
        return "huge pages: not asked for (not glibc 2.35 or later)"
    return f"huge pages: not asked for (transparent huge pages are '{thp_mode or 'not available'}', not 'madvise')"


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
