"""Before/after comparison on ONNX Runtime CPU: polygraphy at zero tolerance, backed by an exact byte comparison.

Why both: polygraphy's `--atol 0 --rtol 0` fails on two identical NaNs, passes `-0.0` against `+0.0` and skips an
output that one model lacks. The byte comparison (same output names, dtypes, shapes and bytes, NaN-aware because
identical NaN bits are equal bytes) is the verdict; polygraphy drives the runs (seeded inputs with explicit value
ranges, both sessions at the same graph optimisation level) and its own verdict is reported beside it.

The two models run one after the other, each in its own forked process, their outputs saved to files, so that the
peak is the larger model's and not the sum (a process that has run one large session keeps much of its memory;
docs/verify.md); the result reports each run's peak RSS.

The options are checked in `verify_options`, the runs made in `verify_runs`, and the result and the byte
comparison that decides it are `verify_result`'s.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ..base.errors import SurgeonError, api_call
from ..base.scratch import scratch
from .verify_options import (
    DEFAULT_FLOAT_RANGE,
    DEFAULT_INT_RANGE,
    DEFAULT_ITERATIONS,
    DEFAULT_SEED,
    MAX_ITERATIONS,
    MAX_SEED,
    MAX_THREADS,
    OPT_LEVELS,
    VERIFY_OPTIONS,
    check_options,
    check_verify_options,
    default_val_ranges,
    input_signature,
    is_integer,
    level_of,
)
from .verify_result import Mismatch, VerifyResult, compare_bytes
from .verify_runs import CpuRuns, compare_runs, peak_rss, quiet_logs, run_both


def _describe(inputs: list) -> str:
    import onnx

    def one(vi) -> str:
        tt = vi.type.tensor_type
        dims = ",".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
        return f"{vi.name}: {onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else '?'}[{dims}]"

    return ", ".join(one(vi) for vi in inputs) or "none"


@api_call
def verify(original: str | Path, patched: str | Path, *, iterations: int | None = None, seed: int | None = None,
           val_range: dict[str, tuple[float, float]] | None = None, opt_level: str | None = None,
           quiet: bool = True, threads: int | None = None,
           input_shapes: dict[str, tuple[int, ...]] | None = None,
           segment_memory: int | str | None = None) -> VerifyResult:
    """Run both models on the same seeded inputs on ORT CPU and compare every output byte for byte.

    `input_shapes` (`patch --input-shapes`): the inputs are fed with these dims, and the reference is the original
    with its inputs fixed to them and nothing else changed (ORT's level 'all' computes a model whose input dims are
    static with other kernels than the same model with symbolic dims: measured up to 3e-7 apart on the replica,
    identical at the levels below; docs/variants.md).

    `threads`: ORT intra-op threads per session, or a list of counts to compare at, each in turn (None: ORT's
    default, one per physical core); a Conv's or GEMM's bytes depend on it (docs/runtime-facts.md, "Threads"),
    so the original and the patched model are run at the same count and compared, count by count. `batch`
    gives each of its parallel workers its share of the cores unless its entry names counts.

    `segment_memory` (bytes, or a size such as "8GB"): each model runs in segments of at most that many bytes of
    tensors, the tensors between them on disk (checks/run_in_segments.py), for models whose whole run does not fit
    the machine; at opt level 'disable' only, where that gives the whole model's bytes."""
    import polygraphy.comparator  # noqa: F401 (it drives the runs: one that is missing is met before any work)

    from ..files import user_path

    original, patched = user_path(original, "the original"), user_path(patched, "the patched model")
    iterations = DEFAULT_ITERATIONS if iterations is None else iterations
    seed = DEFAULT_SEED if seed is None else seed
    check_options(iterations, seed, opt_level, val_range, threads, segment_memory)
    opt_level = level_of(opt_level, segment_memory)
    if not isinstance(quiet, bool):
        raise SurgeonError(None, f"quiet must be True or False (got {quiet!r})")
    inputs = _seeded_inputs(original, patched, input_shapes)
    signatures, fix = [_describe(i) for i in inputs], _failure_hint(inputs[0])
    ranges = _checked_ranges(original, val_range, inputs[0])
    result = VerifyResult(str(original), str(patched), iterations, seed, opt_level, ranges)
    if segment_memory is not None:
        from ..base.sizes import parse_size

        result.segment_memory = parse_size(segment_memory)
    if signatures[0] != signatures[1]:  # the same seeded inputs cannot be fed to both: nothing to compare
        result.mismatch = Mismatch(0, "", f"the models' inputs differ: original takes {signatures[0]}; patched "
                                          f"takes {signatures[1]}")
        return result
    counts = None if threads is None else [threads] if is_integer(threads) else list(dict.fromkeys(threads))
    result.threads, result.polygraphy_passed = counts, True
    for count in counts or [None]:
        runs = CpuRuns(original, opt_level, count, input_shapes, seed, iterations, ranges, fix)
        with quiet_logs(quiet), scratch("deform-surgeon-verify-", "the outputs verify compares") as folder:
            results = run_both(runs, patched, result, str(folder))
            compare_runs(results, result)
            del results  # (the outputs map files of `folder`, removed now)
            result.peak_rss["caller"] = peak_rss()
        if result.mismatch is not None:
            result.mismatch = dataclasses.replace(result.mismatch, threads=count)
            break
    result.identical = result.mismatch is None
    return result


def _seeded_inputs(original: str | Path, patched: str | Path,
                   input_shapes: dict[str, tuple[int, ...]] | None) -> list[list]:
    """Each model's graph inputs, the original's with the dims given by `input_shapes`: what the seeded inputs are
    made for, and what both models must take alike for one set of inputs to be fed to both."""
    from ..graph.input_shapes import fix_input_shapes

    inputs = [input_signature(path) for path in (original, patched)]
    if input_shapes:
        fix_input_shapes(inputs[0], input_shapes, original)
    return inputs


def _checked_ranges(original: str | Path, val_range: dict[str, tuple[float, float]] | None,
                    inputs: list) -> dict[str, tuple[float, float]]:
    """Every input's value range (`default_val_ranges`), refused before any run where `val_range` names no input
    of the model or gives no finite range: a typo would otherwise fall back to the default range unnoticed."""
    ranges = default_val_ranges(original, val_range, inputs)
    for name, (lo, hi) in (val_range or {}).items():
        if name not in ranges:
            raise SurgeonError(original, f"--val-range names '{name}', which is not an input of the model",
                               f"inputs: {', '.join(ranges) or 'none'}")
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise SurgeonError(None, f"--val-range {name}:[{lo},{hi}] is not a finite range with lo <= hi")
    return ranges


def _failure_hint(inputs: list) -> str:
    """What to change when a model fails on the seeded inputs: a symbolic dim is fed as 1, which the exporter's
    baked Reshapes (or a Resize) cannot take, and then the size, not the value range, is the cause."""
    from ..graph.input_shapes import has_symbolic_dims

    symbolic = [vi for vi in inputs if has_symbolic_dims(vi)]
    return (f"give the size the model will get with --input-shapes NAME:DIMS (its inputs have symbolic dims: "
            f"{_describe(symbolic)})" if symbolic else "choose input ranges the model is valid for with --val-range")


__all__ = [
    "DEFAULT_FLOAT_RANGE",
    "DEFAULT_INT_RANGE",
    "DEFAULT_ITERATIONS",
    "DEFAULT_SEED",
    "MAX_ITERATIONS",
    "MAX_SEED",
    "MAX_THREADS",
    "OPT_LEVELS",
    "VERIFY_OPTIONS",
    "Mismatch",
    "VerifyResult",
    "check_options",
    "check_verify_options",
    "compare_bytes",
    "default_val_ranges",
    "input_signature",
    "level_of",
    "verify",
]
