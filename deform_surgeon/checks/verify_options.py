"""What a comparison is given, checked before any work: its options (iterations, seed, opt level, value ranges,
thread counts, segments; `verify`'s and `patch(verify_options=...)`'s) and every graph input's value range."""

from __future__ import annotations

import numbers
import os
from pathlib import Path

from ..base.errors import SurgeonError
from .run_in_segments import SEGMENT_LEVEL

DEFAULT_ITERATIONS = 3
DEFAULT_SEED = 1
DEFAULT_FLOAT_RANGE = (0.0, 1.0)
DEFAULT_INT_RANGE = (0, 8)
OPT_LEVELS = ("disable", "basic", "extended", "all")
MAX_THREADS = 1024  # an intra-op thread count past any machine's cores: a typo, not a machine
MAX_ITERATIONS = 10_000  # every input's outputs are kept for the comparison: a bound, not a hang
MAX_SEED = 2**32 - 1  # numpy's (polygraphy's DataLoader's) largest seed


def default_val_ranges(model_path: str | Path, given: dict[str, tuple[float, float]] | None = None,
                       inputs: list | None = None) -> dict[str, tuple[float, float]]:
    """An explicit value range for every graph input: floats [0, 1), integers [0, 8] unless given."""
    import onnx

    ranges: dict[str, tuple[float, float]] = {}
    for vi in inputs if inputs is not None else input_signature(model_path):
        elem = vi.type.tensor_type.elem_type
        is_float = elem in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                            onnx.TensorProto.BFLOAT16)
        ranges[vi.name] = (given or {}).get(vi.name, DEFAULT_FLOAT_RANGE if is_float else DEFAULT_INT_RANGE)
    return ranges


def input_signature(model_path: str | Path) -> list:
    """The graph inputs a caller feeds (initializers excluded), as ValueInfoProtos, read without loading the
    model where the file scans cleanly; a missing, unreadable or non-ONNX file is a one-line SurgeonError."""
    from ..files import load_model, scan_model

    found = scan_model(model_path) if os.path.isfile(model_path) else None
    if found is not None and found.complete:
        try:
            return found.feed_inputs()
        except Exception:  # protobuf's DecodeError: load_model below names the problem
            pass
    model, _ = load_model(model_path)  # raises the one-line SurgeonError of a bad file
    init = {i.name for i in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in init]


def is_integer(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # (numpy's integers are Integral)


def check_options(iterations: object, seed: object, opt_level: object, val_range: object,
                  threads: object = None, segment_memory: object = None) -> None:
    """The comparison's options, checked before any work: a wrong one is a one-line `SurgeonError` naming it
    (`opt_level` None: the default, 'all', or 'disable' for a run in segments)."""
    if not is_integer(iterations) or not 1 <= iterations <= MAX_ITERATIONS:
        raise SurgeonError(None, f"iterations must be an integer from 1 to {MAX_ITERATIONS:,} (got {iterations!r})")
    if not is_integer(seed) or not 0 <= seed <= MAX_SEED + 1 - iterations:
        raise SurgeonError(None, f"seed must be an integer from 0 to {MAX_SEED:,} - iterations + 1 (got {seed!r})",
                           "input i is made with seed + i, and numpy's seeds end at 2**32 - 1")
    if opt_level is not None and opt_level not in OPT_LEVELS:
        raise SurgeonError(None, f"unknown opt level {opt_level!r}", f"choose one of {', '.join(OPT_LEVELS)}")
    if segment_memory is not None:
        from ..base.sizes import parse_size

        if isinstance(segment_memory, bool) or not isinstance(segment_memory, int | str):
            raise SurgeonError(None, f"segment_memory must be bytes or a size such as 8GB (got {segment_memory!r})")
        parse_size(segment_memory)  # (its own one line for a bad size)
        if opt_level not in (None, SEGMENT_LEVEL):
            raise SurgeonError(None, f"a run in segments equals the whole model's run only at opt level "
                                     f"'{SEGMENT_LEVEL}' (got '{opt_level}': ORT fuses nodes across a segment's edge "
                                     f"at the other levels)", f"give --opt-level {SEGMENT_LEVEL} or no --opt-level")
    if threads is not None and not (is_integer(threads) and 1 <= threads <= MAX_THREADS or isinstance(
            threads, list | tuple) and threads and all(is_integer(t) and 1 <= t <= MAX_THREADS for t in threads)):
        raise SurgeonError(None, f"threads must be an integer from 1 to {MAX_THREADS}, or a list of them (got "
                           f"{threads!r})", "e.g. --threads 1,4,8")
    if val_range is None:
        return
    if not isinstance(val_range, dict):
        raise SurgeonError(None, f"val_range must map input names to (lo, hi) (got {val_range!r})")
    for name, r in val_range.items():
        ok = isinstance(r, list | tuple) and len(r) == 2 and all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in r)
        if not isinstance(name, str) or not ok:
            raise SurgeonError(None, f"val_range {name!r}: {r!r} is not a pair of numbers (lo, hi)",
                               "e.g. {'image': (0.0, 1.0)}")


def level_of(opt_level: str | None, segment_memory: int | str | None = None) -> str:
    """The ORT level a comparison runs at: the one given, else 'all' (ORT's default), or 'disable' for a run in
    segments (the one level where segments give the whole run's bytes)."""
    if opt_level is not None:
        return opt_level
    return SEGMENT_LEVEL if segment_memory is not None else "all"


VERIFY_OPTIONS = ("iterations", "seed", "val_range", "opt_level", "threads", "quiet", "segment_memory")


def check_verify_options(options: dict | None) -> None:
    """`patch(verify_options=...)` checked before any work: known keys, and values `verify` accepts."""
    options = options or {}
    if not isinstance(options, dict):
        raise SurgeonError(None, f"verify_options must be a dict (got {options!r})")
    unknown = set(options) - set(VERIFY_OPTIONS)
    if unknown:
        raise SurgeonError(None, f"unknown verify option(s) {', '.join(sorted(map(str, unknown)))}",
                           f"known: {', '.join(VERIFY_OPTIONS)}")

    def given(key: str, default: object) -> object:
        return default if options.get(key) is None else options[key]

    check_options(given("iterations", DEFAULT_ITERATIONS), given("seed", DEFAULT_SEED), options.get("opt_level"),
                  options.get("val_range"), options.get("threads"), options.get("segment_memory"))
