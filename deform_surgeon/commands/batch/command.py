"""`deform-surgeon batch`: the command (`BatchTool`) and its road (`main`): plan, copy, run, reports, summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from ...base.errors import SurgeonError
from ...base.streams import wrote
from ...base.tool import Tool
from ...files import atomic_path
from ..args import ComparisonArgs, RewriteArgs, WriteArgs
from .copying import copy_files
from .folder import plan_folder
from .manifest import plan
from .progress import Progress
from .table import entry_report, exit_code, summary_table, variant_table, write_reports
from .workers import run


# `patch` over many models: the same argument groups as `patch`, so every patch option is a batch option and a
# manifest key (entry.OPTIONS) without being written again.
class BatchTool(Tool):
    """patch many models (TOML manifest and/or globs) in parallel processes; a report per model and a summary table
    (exit 1 if any failed, 3 if refused)"""

    name = "batch"

    def subscribe(self) -> list:
        self.write = WriteArgs(helps={"verify": "keep each output only if byte-identical on ORT CPU",
                                      "strict": "write nothing for a model with a refused node or a tensor over "
                                                "the device profile"})
        self.rewrite, self.comparison = RewriteArgs(), ComparisonArgs()
        return [self.write, self.rewrite, self.comparison]

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("manifest", nargs="?", default=None, metavar="MANIFEST|DIR",
                            help="TOML manifest (see docs/batch.md), or a model folder: every .onnx below it "
                                 "is patched into the same name in OUTDIR, the other files copied")
        parser.add_argument("outdir", nargs="?", default=None, metavar="OUTDIR",
                            help="with a model folder: where its patched copy goes (created if missing)")
        parser.add_argument("--glob", action="append", default=[], metavar="PATTERN",
                            help="also patch every model matching PATTERN (repeatable; quote it)")
        parser.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: number of cores)")
        output = parser.add_argument_group(self.write.title)
        output.add_argument("--out-dir", metavar="DIR",
                            help="outputs of entries without `output` (default: beside input)")
        output.add_argument("--report-dir", metavar="DIR", help="per-model JSON reports (default: beside each output)")
        output.add_argument("--summary", metavar="FILE.json", help="also write the summary as JSON")
        self.write.add_to(parser, into=output)
        output.add_argument("--no-progress", action="store_true", help="no progress bars / lines on stderr")

    def run(self, args: argparse.Namespace) -> int:
        cli = {**self.write.parse(args), **self.rewrite.parse(args), **self.comparison.parse(args),
               "out_dir": args.out_dir, "report_dir": args.report_dir}
        folder = args.manifest is not None and Path(args.manifest).is_dir()
        if folder and (args.glob or args.out_dir):
            raise SurgeonError(args.manifest, "a model folder takes no --glob or --out-dir",
                               "write `batch DIR OUTDIR`, or a manifest with --glob/--out-dir")
        if folder and args.outdir is None:
            raise SurgeonError(args.manifest, "is a folder: give the output folder too", "write `batch DIR OUTDIR`")
        if not folder and args.outdir is not None:
            raise SurgeonError(args.manifest, "is not a folder: OUTDIR is only for `batch DIR OUTDIR`",
                               "give a model folder, or the manifest alone")
        return main(args.manifest, args.glob, cli, args.jobs, args.summary, show_progress=not args.no_progress,
                          out_folder=args.outdir if folder else None)


def main(manifest: str | None, globs: list[str], cli: dict, jobs: int | None, summary_json: str | None,
         show_progress: bool = True, out_folder: str | None = None) -> int:
    """The `batch` command: plan, run, write reports and the summary; returns the exit code. With `out_folder`,
    `manifest` is a model folder (`batch DIR OUTDIR`, see the package's docstring)."""
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs < 1:
        raise SurgeonError(None, f"--jobs must be at least 1 (got {jobs})")
    if summary_json is not None and not Path(summary_json).parent.is_dir():
        raise SurgeonError(summary_json, f"folder {Path(summary_json).parent} does not exist")
    for key in ("out_dir", "report_dir"):
        if cli.get(key) is not None and not Path(cli[key]).is_dir():
            raise SurgeonError(cli[key], f"--{key.replace('_', '-')} is not an existing folder")
    copies: list[tuple[Path, Path]] = []
    config = None
    if out_folder is not None:
        entries, copies, config = plan_folder(manifest, out_folder, cli, summary_json)
        copy_files(copies)
    else:
        entries = plan(manifest, globs, cli, summary_json)
    jobs = max(1, min(jobs, sum(e.error is None for e in entries) or 1))
    try:
        seconds = run(entries, jobs, Progress() if show_progress else None)
    except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed: the config says what onnx/ holds all the same
        with contextlib.suppress(OSError, SurgeonError):
            config and config.update()
        raise
    write_reports(entries)  # every file before the table is printed: a stdout that fails costs none (streams.py)
    wrote(*(target for _, target in copies), *(e.output for e in entries if (e.result or {}).get("written")),
          *(e.report for e in entries if e.report_written), *([] if config is None else [config.path]))
    note = config and config.update()
    if summary_json is not None:
        data = {"jobs": jobs, "seconds": round(seconds, 3), "exit_code": exit_code(entries),
                "models": [entry_report(e) | {"report": e.report if e.report_written else None} for e in entries]}
        try:
            with atomic_path(summary_json, suffix=".json") as tmp:
                tmp.write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise SurgeonError(summary_json, f"could not be written ({exc.strerror or exc})") from None
        wrote(summary_json)
    print(variant_table(entries, manifest, jobs, seconds, len(copies)) if out_folder is not None else
          summary_table(entries, jobs, seconds))
    if note:
        print(note)
    return exit_code(entries)
