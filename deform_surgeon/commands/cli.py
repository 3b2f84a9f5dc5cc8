"""`deform-surgeon` command line: a thin shell over the Python API, every subcommand one `Tool` (tool.py).

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
import contextlib
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..base.errors import SIGNALLED, SurgeonError, catch_signals, stopped_exit
from ..base.streams import StreamFailed, closed_stream, failed_exit, guarded, say, wrote
from ..base.tool import Tool
from ..checks.verify import verify
from ..files import atomic_path, check_model, load_model
from ..files.io_check import check_io
from ..graph.device import PROFILE_NAMES, resolve_profile
from .args import (
    DEVICE_PROFILE,
    MAX_BUFFER,
    MAX_MEMORY,
    STRICT,
    VERBOSE,
    ComparisonArgs,
    RewriteArgs,
    WriteArgs,
    profile_help,
    size_arg,
)
from .patch import inspect, patch
from .report import FINDING_EXIT, REFUSED


class PatchTool(Tool):
    """prove, rewrite and save a model (atomic; optionally verified first)"""

    name = "patch"

    def subscribe(self) -> list:
        self.write, self.rewrite, self.comparison = WriteArgs(), RewriteArgs(), ComparisonArgs()
        return [self.write, self.rewrite, self.comparison]

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model", help="input .onnx model (never modified)")
        parser.add_argument("output", nargs="?", default=None,
                            help="output path (default: <name>.patched.onnx beside input)")
        output = self.write.add_to(parser)
        output.add_argument("--report", metavar="FILE.json", help="also write the report as JSON")
        output.add_argument("--no-progress", action="store_true",
                            help="no progress lines on stderr (shown only when stderr is a terminal)")
        VERBOSE.add_to(output)

    def run(self, args: argparse.Namespace) -> int:
        out = args.output or str(Path(args.model).with_suffix("")) + ".patched.onnx"
        check_io([args.model], out, [("--report", args.report)], external_data=args.external_data or "auto")
        with _progress_lines(not args.no_progress and sys.stderr.isatty()):
            report = patch(args.model, out, **self.write.parse(args), **self.rewrite.parse(args),
                           verify_options=self.comparison.for_model(args, args.model))
        if report.written:
            data = (report.weights or {}).get("external_data")
            wrote(out, data and Path(out).with_name(data))
        if args.report:  # (every file before the report is printed: a stdout that fails costs none)
            _write_text(args.report, report.to_json())
        print(report.format(verbose=args.verbose, cli=True))
        if args.verbose and args.start_note:  # whether this run has glibc's huge pages (__main__.py), and why
            print(args.start_note)
        if report.written:
            print(f"wrote {out}")
        if args.report:
            print(f"report: {args.report}")
        if report.status == REFUSED:  # the word and exit code `batch` gives the same file
            print(f"refused: {report.findings}" + (f"; {out} written all the same" if report.written else ""))
            return FINDING_EXIT
        return 0


@contextlib.contextmanager
def _progress_lines(shown: bool) -> Iterator[None]:
    """The stages and steps of a patch (stages.py) on stderr while it runs, one line each, when `shown`: on a
    terminal, where a user waits for it; not in a pipe or a log, where only the report and errors are read."""
    if not shown:
        yield
        return
    from ..base.stages import LOG

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("deform-surgeon: %(message)s"))
    level = LOG.level
    LOG.setLevel(logging.INFO)
    LOG.addHandler(handler)
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.setLevel(level)


class InspectTool(Tool):
    """dry run: what would be rewritten or refused, and why"""

    name = "inspect"

    def subscribe(self) -> list:
        self.rewrite = RewriteArgs()
        return [self.rewrite]

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
        STRICT.add_to(parser, help="exit 3 if any node would be refused or any tensor stay over the device profile")
        VERBOSE.add_to(parser)

    def run(self, args: argparse.Namespace) -> int:
        check_io([args.model], others=[("--json", args.json)])
        report = inspect(args.model, **self.rewrite.parse(args))
        if args.json:
            _write_text(args.json, report.to_json())
        print(report.format(verbose=args.verbose, cli=True))
        return FINDING_EXIT if (args.strict and report.status == REFUSED) else 0


class VerifyTool(Tool):
    """compare two models on ORT CPU: zero tolerance + exact bytes"""

    name = "verify"

    def subscribe(self) -> list:
        self.comparison = ComparisonArgs()
        return [self.comparison]

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("original")
        parser.add_argument("patched")
        parser.add_argument("--json", metavar="FILE", help="write the result as JSON")

    def run(self, args: argparse.Namespace) -> int:
        check_io([args.original, args.patched], others=[("--json", args.json)])
        for path in (args.original, args.patched):
            if not os.path.isfile(path):
                load_model(path)  # names a missing file, a folder, one out of reach
        for path in (args.original, args.patched):
            model, weights = load_model(path)
            check_model(model, path, weights)
        result = verify(args.original, args.patched, **self.comparison.for_model(args, args.original))
        if args.json:
            _write_text(args.json, json.dumps(result.to_dict(), indent=2) + "\n")
        print(result.summary())
        return 0 if result.identical else 1


class BudgetTool(Tool):
    """tensors and nodes beyond a WebGPU device's limits (exit 1 if a tensor exceeds maxBufferSize or a node
    maxStorageBuffersPerShaderStage)"""

    name = "budget"

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model")
        MAX_BUFFER.add_to(parser, help="maxBufferSize (default: the device profile's; spec-default: 256MiB)")
        parser.add_argument("--max-binding", type=size_arg, default=None, metavar="BYTES",
                            help="maxStorageBufferBindingSize (default: the device profile's; spec-default: 128MiB)")
        DEVICE_PROFILE.add_to(parser, help=profile_help("the device whose limits to check"))
        parser.add_argument("--device-limits", metavar="FILE.json", help=argparse.SUPPRESS)  # a file profile's old name
        MAX_MEMORY.add_to(parser, help="also exit 1 when the peak of live activations exceeds BYTES (what "
                                       "`patch --max-memory` aims at)")
        parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
        parser.add_argument("--rows", type=int, default=40, help="table rows shown per section (default 40)")

    def run(self, args: argparse.Namespace) -> int:
        from ..graph.budget import analyze, human

        if not os.path.isfile(args.model):
            load_model(args.model)  # names a missing file / folder the usual way
        check_io([args.model], others=[("--json", args.json)],
                 other_reads=[(f"the --device-profile file {p}", p)
                              for p in [args.device_limits or args.device_profile] if p and p not in PROFILE_NAMES])
        profile = resolve_profile(args.device_limits or args.device_profile)
        max_buffer = profile.max_buffer if args.max_buffer is None else args.max_buffer
        max_binding = profile.max_binding if args.max_binding is None else args.max_binding
        source = f"device profile '{profile.name}': {profile.source}"
        given = [k for k in ("max_buffer", "max_binding") if getattr(args, k) is not None]
        if given:
            source += "; " + ", ".join(f"--{k.replace('_', '-')}" for k in given) + " given"
        report = analyze(args.model, max_buffer, max_binding, limits_source=source,
                         storage_buffers=profile.storage_buffers)
        if args.json:
            _write_text(args.json, report.to_json())
        print(report.format(limit_rows=args.rows))
        fits = True
        if args.max_memory is not None:
            fits = report.peak_bytes <= args.max_memory
            print(f"{'OK' if fits else 'FAIL'}: peak of live activations {human(report.peak_bytes)} "
                  f"{'within' if fits else 'OVER'} --max-memory {human(args.max_memory)}")
        return 0 if report.ok and fits else 1


def _write_text(path: str, text: str) -> None:
    try:
        with atomic_path(path, suffix=".json") as tmp:
            tmp.write_text(text)
    except OSError as exc:
        raise SurgeonError(path, f"could not be written ({exc.strerror or exc})") from None
    wrote(path)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option and what it expects (`--help` prints the usage)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"deform-surgeon: error: {text} (see `{self.prog} --help`)\n")


# Every subcommand, in the order `--help` lists them: name -> "module:Tool class". Each is loaded the same way
# (`load_tool`); one whose module cannot be imported is still listed and says what to install (`MissingTool`).
TOOLS: dict[str, str] = {
    "patch": "deform_surgeon.commands.cli:PatchTool",
    "inspect": "deform_surgeon.commands.cli:InspectTool",
    "verify": "deform_surgeon.commands.cli:VerifyTool",
    "batch": "deform_surgeon.commands.batch.command:BatchTool",
    "budget": "deform_surgeon.commands.cli:BudgetTool",
    "placement": "deform_surgeon.webgpu.placement.command:PlacementTool",
    "bisect": "deform_surgeon.webgpu.bisect.command:BisectTool",
    "serve": "deform_surgeon.webgpu.serve.command:ServeTool",
    "setup": "deform_surgeon.base.js_runtimes:SetupTool",
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
