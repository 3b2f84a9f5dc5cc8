"""The argument groups of the patch road, each option written once (tool.py says how a group works).

`patch` takes `WriteArgs`, `RewriteArgs` and `ComparisonArgs`; `inspect` takes `RewriteArgs`; `verify` takes
`ComparisonArgs`; `batch` takes all three (`PATCH_GROUPS`), and its manifest keys are their options' API keywords
(`manifest_options`), so an option added here is on the command line of `patch` and `batch` and in a manifest at once.
`API_NAMES` (each flag -> its API keyword) is how a report read through the API names options (report.api_words).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..base.errors import SurgeonError
from ..base.tool import ArgGroup, Option
from ..checks.verify import DEFAULT_ITERATIONS, DEFAULT_SEED, MAX_ITERATIONS, MAX_SEED, MAX_THREADS, OPT_LEVELS
from ..files import BROWSER_SINGLE_FILE_LIMIT, EXTERNAL_DATA_CHOICES
from ..graph.input_shapes import check_input_shapes, parse_input_shapes
from ..graph.pipeline import SUM_MODES
from ..passes.registry import PASS_NAMES, check_pass_names

_RANGE = re.compile(r"^(?:(?P<name>[^:\[]+):)?\[(?P<lo>[^,\]]+),(?P<hi>[^\]]+)\]$")


def parse_val_ranges(items: list[str] | None) -> dict[str, tuple[float, float]] | None:
    """polygraphy's `--val-range` syntax: `NAME:[lo,hi]` per input, or `[lo,hi]` for all inputs (key "")."""
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


def val_ranges_for(val_range: Mapping[str, Any] | None, model: str | Path) -> dict[str, tuple[float, float]] | None:
    """`val_range` as `verify` takes it: a range given for every input (`--val-range [0,1]`, key "") made one range
    per input of `model`, the named ones kept."""
    if not val_range:
        return None
    ranges = {k: tuple(v) for k, v in val_range.items()}
    if "" in ranges:
        from ..checks.verify import default_val_ranges

        everything = ranges.pop("")
        ranges = {**{k: everything for k in default_val_ranges(model)}, **ranges}
    return ranges


def threads_arg(text: str) -> list[int]:
    """argparse's type of `--threads 1,4,8`: a bad one is argparse's usage error, one line."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of thread counts (e.g. 1,4,8)"
                                         ) from None
    problem = _threads_problem(counts)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return counts


def _threads_problem(value: int | list) -> str | None:
    counts = value if isinstance(value, list) else [value]
    if not counts or not all(isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= MAX_THREADS
                             for t in counts):
        return f"option threads = {value!r} should be thread counts from 1 to {MAX_THREADS:,}"
    return None


def size_arg(text: str) -> int:
    """argparse's type of a size (`256MiB`): a bad one is argparse's usage error, one line."""
    from ..graph.budget import parse_size

    try:
        return parse_size(text)
    except SurgeonError as exc:
        raise argparse.ArgumentTypeError(exc.one_line()) from None


def _size_problem(key: str):
    def check(value: Any) -> str | None:
        from ..graph.budget import parse_size

        try:
            parse_size(value)
        except SurgeonError as exc:
            return f"option {key}: {exc.one_line()}"
        return None

    return check


def _input_shapes_problem(value: Any) -> str | None:
    try:
        check_input_shapes(value)
    except SurgeonError as exc:
        return f"option input_shapes: {exc.one_line()}"
    return None


def _skip_passes_problem(value: Any) -> str | None:
    try:
        check_pass_names(value, "option skip_passes")
    except SurgeonError as exc:
        return exc.one_line()
    return None


def _at_least(key: str, low: int, high: int | None = None):
    def check(value: int) -> str | None:
        if value < low:
            return f"option {key} = {value!r} should be at least {low}"
        if high is not None and value > high:
            return f"option {key} = {value!r} should be at most {high:,}"
        return None

    return check


def _val_range_problem(ranges: dict) -> str | None:
    for name, r in ranges.items():
        if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                                              for x in r)):
            return f"val_range.{name} = {r!r} should be [lo, hi]"
        if not (math.isfinite(r[0]) and math.isfinite(r[1])) or r[0] > r[1]:
            return f"val_range.{name} = {r!r} should be finite with lo <= hi"
    return None


def profile_help(what: str) -> str:
    """`--device-profile`'s help, after what the command does with the device."""
    return (f"{what}: spec-default, adapter (the limits of this machine's adapter), wasm (spec-default's; `patch` "
            "also fits the file to the 4 GiB heap of onnxruntime-web's wasm backend), or limits captured by "
            "`placement --device-limits-out` (default spec-default)")


SWITCH = {"action": "store_true"}

# ------------------------------------------------------------------------------------------------ the options
ALLOW_UNPROVEN = Option(
    ("--allow-unproven",), "allow_unproven", settings=SWITCH, manifest=(bool,),
    help="also rewrite gathers whose index range is NOT proven (listed loudly; unsafe on WebGPU)")
SUM_MODE = Option(
    ("--sum-mode",), "sum_mode", settings={"choices": SUM_MODES}, manifest=(str,),
    help="Sum -> Add chain (default, bit-identical), tree (NOT bit-identical) or none")
MAX_BUFFER = Option(
    ("--max-buffer",), "max_buffer", settings={"type": size_arg, "metavar": "BYTES"},
    manifest=(int, str), check=_size_problem("max_buffer"),  # bytes, or a size such as "256MiB"
    help="split deformable-conv blocks whose tensors exceed BYTES into row chunks, and compute the Convs and Resizes "
         "that read or make other such tensors in row bands / channel groups (what is not exact by construction is "
         "written only once shown exact on its own, see docs/fitting.md); default: what the device profile lets "
         "one binding hold (spec-default: 128MiB); `deform-surgeon budget` lists what remains over it")
MAX_MEMORY = Option(
    ("--max-memory",), "max_memory", settings={"type": size_arg, "metavar": "BYTES"},
    manifest=(int, str), check=_size_problem("max_memory"),
    help="also chunk deformable-conv blocks (exactly, as --max-buffer) until the peak of live activations by "
         "`deform-surgeon budget`'s measure fits BYTES (e.g. 1.5GiB)")
DEVICE_PROFILE = Option(
    ("--device-profile",), "device_profile", settings={"metavar": "NAME|FILE.json"}, manifest=(str,),
    help=profile_help("fit every node to this device's maxStorageBuffersPerShaderStage"))
INPUT_SHAPES = Option(
    ("--input-shapes", "--input-shape"), "input_shapes", settings={"action": "append", "metavar": "NAME:DIMS"},
    parse=parse_input_shapes, manifest=(dict,), check=_input_shapes_problem,  # {input name: [dims]}
    help="fix symbolic input dims first, e.g. input_image:1,3,1024,1024 (repeatable; polygraphy's --input-shapes): "
         "the deform blocks are proven and the shape computations folded for that size, and --verify compares "
         "with the original given that size")
SKIP_PASS = Option(
    ("--skip-pass",), "skip_passes", settings={"action": "append", "choices": PASS_NAMES, "metavar": "NAME"},
    manifest=(list,), check=_skip_passes_problem,  # ["sum_chain", ...]
    help=f"do not run this pass (repeatable; one of {', '.join(PASS_NAMES)}): to find which rewrite a failing "
         "verification comes from; the report lists the passes that ran")

ITERATIONS = Option(("--iterations",), "iterations", settings={"type": int}, manifest=(int,),
                    check=_at_least("iterations", 1, MAX_ITERATIONS),
                    help=f"seeded inputs to compare (default {DEFAULT_ITERATIONS})")
SEED = Option(("--seed",), "seed", settings={"type": int}, manifest=(int,), check=_at_least("seed", 0),
              help=f"seed of the first input; iteration i uses seed+i (default {DEFAULT_SEED})")
VAL_RANGE = Option(("--val-range",), "val_range", settings={"nargs": "+", "metavar": "NAME:[LO,HI]"},
                   parse=parse_val_ranges, manifest=(dict,), check=_val_range_problem,  # { image = [0, 1] }
                   help="value range per input, polygraphy syntax (default floats [0,1], integers [0,8])")
OPT_LEVEL = Option(("--opt-level",), "opt_level", settings={"choices": OPT_LEVELS}, manifest=(str,),
                   help="ORT graph optimisation level of both sessions (default all; disable with --segment-memory)")
THREADS = Option(("--threads",), "threads", settings={"type": threads_arg, "metavar": "N[,N...]"},
                 manifest=(int, list), check=_threads_problem,
                 help="ORT intra-op thread counts to compare at, each in turn (e.g. 1,4,8; default: ORT's, one per "
                      "core): a Conv's bytes depend on the count, and a patched model must match at each")
SEGMENT_MEMORY = Option(
    ("--segment-memory",), "segment_memory", settings={"type": size_arg, "metavar": "BYTES"},
    manifest=(int, str), check=_size_problem("segment_memory"),
    help="run each model in segments of at most BYTES of tensors (e.g. 8GB), the tensors between them on disk: for "
         "a model whose whole ORT CPU run does not fit the machine; the same bytes as the whole run at --opt-level "
         "disable, which it implies (docs/verify.md)")

VERIFY = Option(("--verify",), "verify", settings=SWITCH, manifest=(bool,),
                help="write OUT only if it is byte-identical on ORT CPU")
COPY_UNCHANGED = Option(("--copy-unchanged",), "copy_unchanged", settings=SWITCH, manifest=(bool,),
                        help="with nothing to rewrite, still write a copy")
EXTERNAL_DATA = Option(
    ("--external-data",), "external_data", settings={"choices": EXTERNAL_DATA_CHOICES}, manifest=(str,),
    help=f"where OUT's weights go: auto (default) keeps the input's external data and moves the weights of a single "
         f"file over {BROWSER_SINGLE_FILE_LIMIT // 2**20} MiB to OUT_data, which a browser page can load; always / "
         f"never force either form")
STRICT = Option(("--strict",), "strict", settings=SWITCH, manifest=(bool,),
                help="if any node is refused or any tensor stays over the device profile: write nothing (exit 3 "
                     "either way)")
VERBOSE = Option(("-v", "--verbose"), "verbose", settings=SWITCH, api="format(verbose=True)",
                 help="list every rewritten node")


# ------------------------------------------------------------------------------------------------- the groups
class RewriteArgs(ArgGroup):
    """What to rewrite and for which device: the rewrite keywords of `patch` and `inspect`."""

    title = "rewrites"
    options = (ALLOW_UNPROVEN, SUM_MODE, MAX_BUFFER, MAX_MEMORY, DEVICE_PROFILE, INPUT_SHAPES, SKIP_PASS)


class ComparisonArgs(ArgGroup):
    """How the original and the patched model are compared: `verify`'s keywords (`patch`'s `verify_options`).
    `val_range` is parsed as given; `val_ranges_for` gives a range for all inputs (`[0,1]`) to each input of a model."""

    title = "comparison (ONNX Runtime CPU, zero tolerance + byte comparison)"
    options = (ITERATIONS, SEED, VAL_RANGE, OPT_LEVEL, THREADS, SEGMENT_MEMORY)

    def problem(self, spec: Mapping[str, Any]) -> str | None:
        problem = super().problem(spec)
        if problem is None and "seed" in spec and spec["seed"] + spec.get("iterations", 1) - 1 > MAX_SEED:
            problem = f"option seed = {spec['seed']!r} should be at most {MAX_SEED:,} - iterations + 1"
        return problem

    def for_model(self, args: argparse.Namespace, model: str | Path) -> dict[str, Any]:
        """`verify`'s keywords for `model`, from the parsed command line."""
        values = self.parse(args)
        return {**values, "val_range": val_ranges_for(values["val_range"], model)}


class WriteArgs(ArgGroup):
    """Whether and when `patch` writes its output: its switches."""

    title = "output"
    options = (VERIFY, COPY_UNCHANGED, STRICT, EXTERNAL_DATA)


PATCH_GROUPS: tuple[type[ArgGroup], ...] = (WriteArgs, RewriteArgs, ComparisonArgs)  # patch's, and batch's


def manifest_options() -> dict[str, tuple[type, ...]]:
    """Every option a batch manifest entry takes (the patch groups' options, by API keyword) -> its value types."""
    return {o.dest: o.manifest for group in PATCH_GROUPS for o in group.options if o.manifest}


def manifest_problem(spec: Mapping[str, Any]) -> str | None:
    """What is wrong with a manifest entry's (or `[defaults]`') options, checked before any model is run; None if
    nothing. Options are checked by the groups that define them."""
    for key, types in manifest_options().items():
        if key in spec and (not isinstance(spec[key], types) or (int in types and isinstance(spec[key], bool))):
            return f"option {key} = {spec[key]!r} should be {' or '.join(t.__name__ for t in types)}"
    for group in PATCH_GROUPS:
        problem = group().problem(spec)
        if problem:
            return problem
    return None


# each flag of `patch` -> how the Python API says it (`--max-memory` -> `max_memory`), for report.api_words
API_NAMES: dict[str, str] = {flag: o.api_name for group in PATCH_GROUPS for o in (*group.options, VERBOSE)
                             for flag in o.flags if flag.startswith("--")}
