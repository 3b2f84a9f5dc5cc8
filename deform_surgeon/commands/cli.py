"""`deform-surgeon` command line: a thin shell over the Python API, every subcommand one `Tool` (base/tool.py) in a
`command.py` beside its work (`TOOLS` says where each is).

Each command subscribes to argument groups (args.py) that add their options to its parser and parse them back into
the API's keywords; `TOOLS` lists every command, and one whose module cannot be imported is still listed and, run,
says in one line what to install (`MissingTool`). docs/architecture.md, "Commands", says how to add one.

Exit codes: 0 success; 1 verification failed (patched outputs differ) or a runtime check failed;
2 bad input (one line on stderr naming the file and the problem), or a stdout or stderr that is closed or cannot be
written; 3 a finding: some node was refused or some tensor stays over the device profile (`patch`, `batch`: the
report's status `refused`, the model written unless `--strict`; `inspect --strict`); 141 the reader of stdout left
(`| head`). A command writes its files before it prints its report (base/streams.py says why).
"""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys
import threading
from typing import Any, NoReturn

from .. import __version__
from ..base.errors import SIGNALLED, SurgeonError, catch_signals, stopped_exit
from ..base.streams import StreamFailed, closed_stream, failed_exit, guarded, say
from ..base.tool import Tool


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option and what it expects (`--help` prints the usage)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"deform-surgeon: error: {text} (see `{self.prog} --help`)\n")


# Every subcommand, in the order `--help` lists them: name -> "module:Tool class". A command's Tool lives in a
# `command.py` beside the work it runs: its own package's where it has one (commands/batch/, webgpu/placement/,
# webgpu/bisect/, webgpu/serve/, webgpu/setup/), else its layer's (commands/command.py: the patch road's four).
# Each is loaded the same way (`load_tool`); one whose module cannot be imported is still listed and says what to
# install (`MissingTool`).
TOOLS: dict[str, str] = {
    "patch": "deform_surgeon.commands.command:PatchTool",
    "inspect": "deform_surgeon.commands.command:InspectTool",
    "verify": "deform_surgeon.commands.command:VerifyTool",
    "batch": "deform_surgeon.commands.batch.command:BatchTool",
    "budget": "deform_surgeon.commands.command:BudgetTool",
    "placement": "deform_surgeon.webgpu.placement.command:PlacementTool",
    "bisect": "deform_surgeon.webgpu.bisect.command:BisectTool",
    "serve": "deform_surgeon.webgpu.serve.command:ServeTool",
    "setup": "deform_surgeon.webgpu.setup.command:SetupTool",
}


# A command whose module could not be imported: listed in `--help` with why, and run (with any arguments, `--help`
# too) it exits 2 with one line naming what is missing and what to install. Its help is worded per command, in
# __init__, so it has no docstring (a Tool's docstring is its text, tool.py).
class MissingTool(Tool):
    def __init__(self, name: str, error: ImportError) -> None:
        super().__init__()
        self.name, self.error, self.install = name, error, install_hint(error)
        self.help = f"(cannot be loaded: {error}; install what it needs: {self.install})".replace("%", "%%")

    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        # no option prefix: every argument, `--help` included, is taken as given and the command says what is missing
        parser = subparsers.add_parser(self.name, help=self.help, add_help=False, prefix_chars="\0")
        parser.add_argument("arguments", nargs="*")
        parser.set_defaults(tool=self)
        return parser

    def run(self, args: argparse.Namespace) -> int:
        raise SurgeonError(None, f"the {self.name} command cannot be loaded: {self.error}",
                           f"install what it needs: {self.install}")


def install_hint(error: ImportError) -> str:
    """What to install for a module that failed to import with `error`: deform-surgeon's own requirement for the
    missing package (`pip install 'onnx-graphsurgeon>=0.5'`), or deform-surgeon itself when one of its own modules is
    missing or broken."""
    import importlib.metadata  # only here: it imports email, zipfile and csv, every command's cost otherwise

    distribution = __name__.partition(".")[0]  # (this package's top: deform_surgeon)
    missing = (error.name or "").partition(".")[0]
    if not missing or missing == distribution:
        return f"pip install --force-reinstall {distribution}"

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        requirements = []
    for req in requirements:
        spec, _, marker = req.partition(";")
        name = re.match(r"[A-Za-z0-9._-]*", spec.strip()).group()
        if norm(name) == norm(missing) and "extra" not in marker:
            return f"pip install '{spec.strip()}'"
    return f"pip install {missing}"


def load_tool(name: str, where: str) -> Tool:
    """The command `name` from its "module:Class", or a `MissingTool` saying why it cannot be loaded."""
    module, _, cls = where.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as exc:
        if SIGNALLED:  # Ctrl-C / SIGTERM during the import, which a library made an ImportError: the command stops
            raise
        return MissingTool(name, exc)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deform-surgeon",
        description="Rewrite ONNX deformable-convolution graphs (BiRefNet) to run fully on WebGPU, bit-identically.")
    parser.add_argument("--version", action="version", version=f"deform-surgeon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, where in TOOLS.items():
        tool = load_tool(name, where)
        assert tool.name == name, f"{where} is the {tool.name!r} command, registered as {name!r}"
        tool.add_parser(sub)
    return parser


def main(argv: list[str] | None = None, start_note: str | None = None) -> int:
    """The command line; `start_note` is what `__main__` tells `patch --verbose` about how the process started.
    stdout and stderr are the command's as base/streams.py says: a closed one is refused before any work, one that
    fails is one line and an exit code, never a traceback."""
    closed = closed_stream()
    if closed is not None:
        return closed
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 is printed, not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = catch_signals()  # Ctrl-C and SIGTERM: temporaries and workers cleaned up, exit 130 / 143
    try:
        with guarded():
            try:
                parser = build_parser()
                parser.set_defaults(start_note=start_note)
                args = parser.parse_args(argv)
                code = int(args.tool.run(args))
                sys.stdout.flush()  # (what a full stdout refuses, said here, not at the interpreter's exit)
                return code
            except BaseException as exc:
                return _ended(exc)
    finally:
        for sig, handler in previous.items():  # main() called in-process (tests, scripts) leaves them as it found
            signal.signal(sig, handler)


def _ended(exc: BaseException) -> int:
    """The exit code of a command that raised `exc`, its one line said; re-raised where it is not the user's."""
    code = stopped_exit(exc)
    if code is not None:
        return code
    if isinstance(exc, SystemExit):  # argparse's --help, --version and usage errors: what it printed, out now
        try:
            sys.stdout.flush()
        except StreamFailed as failed:
            return failed_exit(failed)
        raise exc
    if isinstance(exc, StreamFailed):
        return failed_exit(exc)
    if isinstance(exc, SurgeonError):
        say(f"deform-surgeon: error: {exc.one_line()}")
        return exc.exit_code
    if isinstance(exc, OSError) and exc.filename is not None:  # a file the checks above did not foresee
        error = SurgeonError(exc.filename, f"cannot be used ({exc.strerror or exc})")
        say(f"deform-surgeon: error: {error.one_line()}")
        return error.exit_code
    raise exc
