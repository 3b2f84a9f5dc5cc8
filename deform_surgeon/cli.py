"""`deform-surgeon` command line: a thin shell over the Python API (polygraphy-style subcommands and groups).

Exit codes: 0 success; 1 verification failed (patched outputs differ) or a runtime check failed;
2 bad input (one line on stderr naming the file and the problem); 3 `--strict` and some node was refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from . import __version__
from .device import PROFILE_NAMES, resolve_profile
from .errors import SurgeonError, catch_signals, stopped_exit
from .input_shapes import parse_input_shapes
from .io_check import check_io
from .model_io import atomic_path, check_model, load_model
from .passes.registry import PASS_NAMES
from .surgeon import SUM_MODES, inspect, patch
from .verify import DEFAULT_ITERATIONS, DEFAULT_SEED, OPT_LEVELS, verify

_RANGE = re.compile(r"^(?:(?P<name>[^:\[]+):)?\[(?P<lo>[^,\]]+),(?P<hi>[^\]]+)\]$")


def parse_val_ranges(items: list[str] | None) -> dict[str, tuple[float, float]] | None:
    """polygraphy's `--val-range` syntax: `NAME:[lo,hi]` per input, or `[lo,hi]` for all inputs."""
    if not items:
        return None
    out: dict[str, tuple[float, float]] = {}
    for item in items:
        m = _RANGE.match(item.replace(" ", ""))
        try:
            if not m:
                raise ValueError
            out[m.group("name") or ""] = (float(m.group("lo")), float(m.group("hi")))
        except ValueError:
            raise SurgeonError(None, f"bad --val-range '{item}'", "write NAME:[lo,hi], e.g. image:[0,1]") from None
    return out


def _verify_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("comparison (ONNX Runtime CPU, zero tolerance + byte comparison)")
    g.add_argument("--iterations", type=int, default=None,
                   help=f"seeded inputs to compare (default {DEFAULT_ITERATIONS})")
    g.add_argument("--seed", type=int, default=None,
                   help=f"seed of the first input; iteration i uses seed+i (default {DEFAULT_SEED})")
    g.add_argument("--val-range", nargs="+", default=None, metavar="NAME:[LO,HI]",
                   help="value range per input, polygraphy syntax (default floats [0,1], integers [0,8])")
    g.add_argument("--opt-level", choices=OPT_LEVELS, default=None,
                   help="ORT graph optimisation level of both sessions (default all)")


def _verify_kwargs(args: argparse.Namespace, model: str) -> dict:
    ranges = parse_val_ranges(args.val_range)
    if ranges and "" in ranges:
        from .verify import default_val_ranges

        everything = ranges.pop("")
        ranges = {**{k: everything for k in default_val_ranges(model)}, **ranges}
    return {"iterations": args.iterations, "seed": args.seed, "val_range": ranges, "opt_level": args.opt_level}


def _rewrite_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rewrites")
    g.add_argument("--allow-unproven", action="store_true",
                   help="also rewrite gathers whose index range is NOT proven (listed loudly; unsafe on WebGPU)")
    g.add_argument("--sum-mode", choices=SUM_MODES, default=None,
                   help="Sum -> Add chain (default, bit-identical), tree (NOT bit-identical) or none")
    g.add_argument("--max-buffer", type=_size_arg, default=None, metavar="BYTES",
                   help="split deformable-conv blocks whose tensors exceed BYTES into row chunks, and compute the "
                        "Convs and Resizes that read or make other such tensors in row bands / channel groups (what "
                        "is not exact by construction is written only once shown exact on its own, see "
                        "docs/fitting.md); default: what the device profile lets one binding hold (spec-default: "
                        "128MiB); `deform-surgeon budget` lists what remains over it")
    g.add_argument("--max-memory", type=_size_arg, default=None, metavar="BYTES",
                   help="also chunk deformable-conv blocks (exactly, as --max-buffer) until the peak of live "
                        "activations by `deform-surgeon budget`'s measure fits BYTES (e.g. 1.5GiB)")
    _profile_arg(g, "fit every node to this device's maxStorageBuffersPerShaderStage")
    g.add_argument("--input-shapes", "--input-shape", action="append", default=None, metavar="NAME:DIMS",
                   help="fix symbolic input dims first, e.g. input_image:1,3,1024,1024 (repeatable; polygraphy's "
                        "--input-shapes): the deform blocks are proven and the shape computations folded for that "
                        "size, and --verify compares with the original given that size")
    g.add_argument("--skip-pass", dest="skip_passes", action="append", choices=PASS_NAMES, default=None,
                   metavar="NAME", help=f"do not run this pass (repeatable; one of {', '.join(PASS_NAMES)}): "
                                        "to find which rewrite a failing verification comes from; the report "
                                        "lists the passes that ran")


def _profile_arg(group, what: str) -> None:
    group.add_argument("--device-profile", default=None, metavar="NAME|FILE.json",
                       help=f"{what}: {' or '.join(PROFILE_NAMES)} (the limits of this machine's adapter), or "
                            "limits captured by `placement --device-limits-out` (default spec-default)")


def _cmd_patch(args: argparse.Namespace) -> int:
    out = args.output or str(Path(args.model).with_suffix("")) + ".patched.onnx"
    check_io([args.model], out, [("--report", args.report)])
    report = patch(args.model, out, allow_unproven=args.allow_unproven, sum_mode=args.sum_mode,
                   max_buffer=args.max_buffer, max_memory=args.max_memory, device_profile=args.device_profile,
                   input_shapes=parse_input_shapes(args.input_shapes), skip_passes=args.skip_passes,
                   verify=args.verify, copy_unchanged=args.copy_unchanged, strict=args.strict,
                   verify_options=_verify_kwargs(args, args.model))
    print(report.format(verbose=args.verbose, cli=True))
    if report.written:
        print(f"wrote {out}")
    if args.report:
        _write_text(args.report, report.to_json())
        print(f"report: {args.report}")
    return 3 if (args.strict and report.refused) else 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    check_io([args.model], others=[("--json", args.json)])
    report = inspect(args.model, allow_unproven=args.allow_unproven, sum_mode=args.sum_mode,
                     max_buffer=args.max_buffer, max_memory=args.max_memory, device_profile=args.device_profile,
                     input_shapes=parse_input_shapes(args.input_shapes), skip_passes=args.skip_passes)
    print(report.format(verbose=args.verbose, cli=True))
    if args.json:
        _write_text(args.json, report.to_json())
    return 3 if (args.strict and report.refused) else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    check_io([args.original, args.patched], others=[("--json", args.json)])
    for path in (args.original, args.patched):
        if not os.path.isfile(path):
            load_model(path)  # names a missing file, a folder, one out of reach
    for path in (args.original, args.patched):
        model, weights = load_model(path)
        check_model(model, path, weights)
    result = verify(args.original, args.patched, **_verify_kwargs(args, args.original))
    print(result.summary())
    if args.json:
        _write_text(args.json, json.dumps(result.to_dict(), indent=2) + "\n")
    return 0 if result.identical else 1


def _size_arg(text: str) -> int:
    from .budget import parse_size

    try:
        return parse_size(text)
    except SurgeonError as exc:
        raise argparse.ArgumentTypeError(exc.one_line()) from None


def _cmd_budget(args: argparse.Namespace) -> int:
    from .budget import analyze

    if not os.path.isfile(args.model):
        load_model(args.model)  # names a missing file / folder the usual way
    check_io([args.model], others=[("--json", args.json)],
             other_reads=[(f"the --device-profile file {p}", p) for p in [args.device_limits or args.device_profile]
                          if p and p not in PROFILE_NAMES])
    profile = resolve_profile(args.device_limits or args.device_profile)
    max_buffer = profile.max_buffer if args.max_buffer is None else args.max_buffer
    max_binding = profile.max_binding if args.max_binding is None else args.max_binding
    source = f"device profile '{profile.name}': {profile.source}"
    given = [k for k in ("max_buffer", "max_binding") if getattr(args, k) is not None]
    if given:
        source += "; " + ", ".join(f"--{k.replace('_', '-')}" for k in given) + " given"
    report = analyze(args.model, max_buffer, max_binding, limits_source=source,
                     storage_buffers=profile.storage_buffers)
    print(report.format(limit_rows=args.rows))
    fits = True
    if args.max_memory is not None:
        from .budget import human

        fits = report.peak_bytes <= args.max_memory
        print(f"{'OK' if fits else 'FAIL'}: peak of live activations {human(report.peak_bytes)} "
              f"{'within' if fits else 'OVER'} --max-memory {human(args.max_memory)}")
    if args.json:
        _write_text(args.json, report.to_json())
    return 0 if report.ok and fits else 1


def _cmd_batch(args: argparse.Namespace) -> int:
    from .batch import main as batch_main

    cli = {k: getattr(args, k, None) for k in ("allow_unproven", "sum_mode", "verify", "strict", "copy_unchanged",
                                               "iterations", "seed", "opt_level", "out_dir", "report_dir",
                                               "max_buffer", "max_memory", "device_profile", "skip_passes")}
    ranges = parse_val_ranges(args.val_range)
    if ranges:
        cli["val_range"] = {k: list(v) for k, v in ranges.items()}
    shapes = parse_input_shapes(args.input_shapes)
    if shapes:
        cli["input_shapes"] = {k: list(v) for k, v in shapes.items()}
    folder = args.manifest is not None and Path(args.manifest).is_dir()
    if folder and (args.glob or args.out_dir):
        raise SurgeonError(args.manifest, "a model folder takes no --glob or --out-dir",
                           "write `batch DIR OUTDIR`, or a manifest with --glob/--out-dir")
    if folder and args.outdir is None:
        raise SurgeonError(args.manifest, "is a folder: give the output folder too", "write `batch DIR OUTDIR`")
    if not folder and args.outdir is not None:
        raise SurgeonError(args.manifest, "is not a folder: OUTDIR is only for `batch DIR OUTDIR`",
                           "give a model folder, or the manifest alone")
    return batch_main(args.manifest, args.glob, cli, args.jobs, args.summary, show_progress=not args.no_progress,
                      out_folder=args.outdir if folder else None)


def _write_text(path: str, text: str) -> None:
    try:
        with atomic_path(path, suffix=".json") as tmp:
            tmp.write_text(text)
    except OSError as exc:
        raise SurgeonError(path, f"could not be written ({exc.strerror or exc})") from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option and what it expects (`--help` prints the usage)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"deform-surgeon: error: {text} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deform-surgeon",
        description="Rewrite ONNX deformable-convolution graphs (BiRefNet) to run fully on WebGPU, bit-identically.")
    parser.add_argument("--version", action="version", version=f"deform-surgeon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("patch", help="prove, rewrite and save a model (atomic; optionally verified first)")
    p.add_argument("model", help="input .onnx model (never modified)")
    p.add_argument("output", nargs="?", default=None, help="output path (default: <name>.patched.onnx beside input)")
    g = p.add_argument_group("output")
    g.add_argument("--verify", action="store_true", help="write OUT only if it is byte-identical on ORT CPU")
    g.add_argument("--report", metavar="FILE.json", help="also write the report as JSON")
    g.add_argument("--copy-unchanged", action="store_true", help="with nothing to rewrite, still write a copy")
    g.add_argument("--strict", action="store_true", help="if any node is refused: write nothing and exit 3")
    g.add_argument("-v", "--verbose", action="store_true", help="list every rewritten node")
    _rewrite_group(p)
    _verify_group(p)
    p.set_defaults(func=_cmd_patch)

    p = sub.add_parser("inspect", help="dry run: what would be rewritten or refused, and why")
    p.add_argument("model")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 3 if any node would be refused")
    p.add_argument("-v", "--verbose", action="store_true")
    _rewrite_group(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="compare two models on ORT CPU: zero tolerance + exact bytes")
    p.add_argument("original")
    p.add_argument("patched")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    _verify_group(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("batch", help="patch many models (TOML manifest and/or globs) in parallel processes; "
                                     "a report per model and a summary table (exit 1 if any failed, 3 if refused)")
    p.add_argument("manifest", nargs="?", default=None, metavar="MANIFEST|DIR",
                   help="TOML manifest (see `deform_surgeon.batch`), or a model folder: every .onnx below it is "
                        "patched into the same name in OUTDIR, the other files copied")
    p.add_argument("outdir", nargs="?", default=None, metavar="OUTDIR",
                   help="with a model folder: where its patched copy goes (created if missing)")
    p.add_argument("--glob", action="append", default=[], metavar="PATTERN",
                   help="also patch every model matching PATTERN (repeatable; quote it)")
    p.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: number of cores)")
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", metavar="DIR", help="outputs of entries without `output` (default: beside input)")
    g.add_argument("--report-dir", metavar="DIR", help="per-model JSON reports (default: beside each output)")
    g.add_argument("--summary", metavar="FILE.json", help="also write the summary as JSON")
    g.add_argument("--verify", action="store_true", help="keep each output only if byte-identical on ORT CPU")
    g.add_argument("--copy-unchanged", action="store_true", help="with nothing to rewrite, still write a copy")
    g.add_argument("--strict", action="store_true", help="write nothing for a model with a refused node")
    g.add_argument("--no-progress", action="store_true", help="no progress bars / lines on stderr")
    _rewrite_group(p)
    _verify_group(p)
    p.set_defaults(func=_cmd_batch)

    p = sub.add_parser("budget", help="tensors and nodes beyond a WebGPU device's limits (exit 1 if a tensor "
                                      "exceeds maxBufferSize or a node maxStorageBuffersPerShaderStage)")
    p.add_argument("model")
    p.add_argument("--max-buffer", type=_size_arg, default=None, metavar="BYTES",
                   help="maxBufferSize (default: the device profile's; spec-default: 256MiB)")
    p.add_argument("--max-binding", type=_size_arg, default=None, metavar="BYTES",
                   help="maxStorageBufferBindingSize (default: the device profile's; spec-default: 128MiB)")
    _profile_arg(p, "the device whose limits to check")
    p.add_argument("--device-limits", metavar="FILE.json", help=argparse.SUPPRESS)  # the older name of a file profile
    p.add_argument("--max-memory", type=_size_arg, default=None, metavar="BYTES",
                   help="also exit 1 when the peak of live activations exceeds BYTES (what `patch --max-memory` "
                        "aims at)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--rows", type=int, default=40, help="table rows shown per section (default 40)")
    p.set_defaults(func=_cmd_budget)

    try:
        from .placement import register_cli
    except ImportError:  # the placement harness is optional at import time; its command says what is missing
        register_cli = None
    if register_cli is not None:
        register_cli(sub)
    from .runtimes import register_cli as register_setup
    from .serve import register_cli as register_serve

    register_serve(sub)
    register_setup(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 is printed, not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = catch_signals()  # Ctrl-C and SIGTERM: temporaries and workers cleaned up, exit 130 / 143
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except BaseException as exc:
        code = stopped_exit(exc)
        if code is not None:
            return code
        if isinstance(exc, SurgeonError):
            print(f"deform-surgeon: error: {exc.one_line()}", file=sys.stderr)
            return exc.exit_code
        if isinstance(exc, OSError) and exc.filename is not None:  # a file the checks above did not foresee
            error = SurgeonError(exc.filename, f"cannot be used ({exc.strerror or exc})")
            print(f"deform-surgeon: error: {error.one_line()}", file=sys.stderr)
            return error.exit_code
        raise
    finally:
        for sig, handler in previous.items():  # main() called in-process (tests, scripts) leaves them as it found
            signal.signal(sig, handler)
