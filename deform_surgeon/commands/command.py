"""The commands of the patch road (`patch`, `inspect`, `verify`, `budget`), each a `Tool` (base/tool.py) over the
Python API: `patch` and `inspect` over patch.py, `verify` over checks/verify.py, `budget` over graph/budget.py.
Listed in `cli.TOOLS` beside the commands that live with their own work (`batch/command.py`, and `webgpu/`'s)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..base.errors import SurgeonError
from ..base.streams import wrote
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
