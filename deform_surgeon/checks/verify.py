"""Before/after comparison on ONNX Runtime CPU: polygraphy at zero tolerance, backed by an exact byte comparison.

Why both: polygraphy's `--atol 0 --rtol 0` fails on two identical NaNs, passes `-0.0` against `+0.0` and skips an
output that one model lacks. The byte comparison (same output names, dtypes, shapes and bytes, NaN-aware because
identical NaN bits are equal bytes) is the verdict; polygraphy drives the runs (seeded inputs with explicit value
ranges, both sessions at the same graph optimisation level) and its own verdict is reported beside it.

The two models run one after the other, each in its own forked process, their outputs saved to files, so that the
peak is the larger model's and not the sum (a process that has run one large session keeps much of its memory;
docs/verify.md); the result reports each run's peak RSS.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..base.background import Background, ChildDied
from ..base.errors import SurgeonError, api_call
from ..base.ort_cpu import ort_level
from ..base.scratch import scratch
from .run_in_segments import SEGMENT_LEVEL
from .verdict import BYTE_IDENTICAL, Verdict, judge

if TYPE_CHECKING:  # (numpy is imported where it is used: `import deform_surgeon` stays light, see __init__)
    import numpy as np

DEFAULT_ITERATIONS = 3
DEFAULT_SEED = 1
DEFAULT_FLOAT_RANGE = (0.0, 1.0)
DEFAULT_INT_RANGE = (0, 8)
OPT_LEVELS = ("disable", "basic", "extended", "all")
MAX_THREADS = 1024  # an intra-op thread count past any machine's cores: a typo, not a machine
MAX_ITERATIONS = 10_000  # every input's outputs are kept for the comparison: a bound, not a hang
MAX_SEED = 2**32 - 1  # numpy's (polygraphy's DataLoader's) largest seed


@dataclass(frozen=True)
class Mismatch:
    iteration: int
    output: str
    problem: str
    index: tuple[int, ...] | None = None
    original: str | None = None
    patched: str | None = None
    threads: int | None = None  # the intra-op thread count of the runs that differed (None: ORT's default)

    def text(self) -> str:
        if not self.output:  # not about one output (the models' inputs differ)
            return self.problem
        at = "" if self.threads is None else f", {self.threads} intra-op thread(s)"
        where = f"output '{self.output}' (iteration {self.iteration}{at})"
        if self.index is None:
            return f"{where}: {self.problem}"
        return f"{where}: {self.problem} at index {list(self.index)}: original {self.original}, patched {self.patched}"


@dataclass
class VerifyResult:
    original: str
    patched: str
    iterations: int
    seed: int
    opt_level: str
    val_range: dict[str, tuple[float, float]]
    identical: bool = False
    polygraphy_passed: bool = False
    outputs_compared: list[str] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    # peak RSS in bytes of each model's run ("original", "patched": each in its own process where it can fork, else
    # this process's peak so far) and of the calling process, the comparison done ("caller")
    peak_rss: dict[str, int] = field(default_factory=dict)
    # `segment_memory`: each model was run in segments of at most this many bytes of tensors
    # (checks/run_in_segments.py); how many
    # and the most bytes the tensors between its segments held on disk at once
    segment_memory: int | None = None
    segments: dict[str, int] = field(default_factory=dict)
    segment_disk: dict[str, int] = field(default_factory=dict)
    # the ORT intra-op thread counts both models were run and compared at, in order (None: ORT's default, one
    # per physical core of this machine): a Conv's or GEMM's bytes depend on it (docs/runtime-facts.md)
    threads: list[int] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["val_range"] = {k: list(v) for k, v in self.val_range.items()}
        return d

    def summary(self) -> str:
        if self.identical:
            return (f"verify: PASSED: {len(self.outputs_compared)} output(s) {Verdict(BYTE_IDENTICAL, 0.0, 0.0).text} "
                    f"on {self.iterations} "
                    f"seeded input(s) (seed {self.seed}, ORT CPU, opt level '{self.opt_level}'{self.segment_text()}, "
                    f"{self.threads_text()}; "
                    f"polygraphy atol=0 rtol=0: {'passed' if self.polygraphy_passed else 'failed (NaNs)'})"
                    f"{self.peak_text()}")
        return f"verify: FAILED: {self.mismatch.text() if self.mismatch else 'outputs differ'}{self.peak_text()}"

    def threads_text(self) -> str:
        """"intra-op threads 1, 4, 8" or "ORT's default intra-op threads": the thread counts compared."""
        if not self.threads:
            return "ORT's default intra-op threads"
        return f"intra-op thread{'s' if len(self.threads) > 1 else ''} {', '.join(map(str, self.threads))}"

    def segment_text(self) -> str:
        """", in segments of at most 6.00 GB (5.59 GiB) of tensors: the original in 41 (at most 17.65 GB (16.44 GiB)
        on disk between them), the patched in 35 (...)"."""
        if self.segment_memory is None:
            return ""
        from ..base.sizes import human

        counts = ", ".join(f"the {k} in {n} (at most {human(self.segment_disk.get(k, 0))} on disk between them)"
                           for k, n in self.segments.items())
        return f", in segments of at most {human(self.segment_memory)} of tensors: {counts}"

    def peak_text(self) -> str:
        """"; peak RSS 7.90 GB (the original's run; the patched's 2.41 GB, the caller's 0.31 GB)": what the machine
        needed, the models run one after the other (the caller's: the process that compared them, a `patch` that
        asked for the comparison included)."""
        if not self.peak_rss:
            return ""
        top = max(self.peak_rss, key=self.peak_rss.get)
        rest = ", ".join(f"the {k}'s {self.peak_rss[k] / 1e9:.2f} GB" for k in self.peak_rss if k != top)
        what = "the caller" if top == "caller" else f"the {top}'s run"
        return f"; peak RSS {self.peak_rss[top] / 1e9:.2f} GB ({what}{'; ' + rest if rest else ''})"


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


def _describe(inputs: list) -> str:
    import onnx

    def one(vi) -> str:
        tt = vi.type.tensor_type
        dims = ",".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
        return f"{vi.name}: {onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else '?'}[{dims}]"

    return ", ".join(one(vi) for vi in inputs) or "none"


def _metadata(input_shapes: dict[str, tuple[int, ...]] | None):
    """polygraphy's TensorMetadata for the given input dims (dtype from the model), or None."""
    if not input_shapes:
        return None
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for name, dims in input_shapes.items():
        meta.add(name, None, tuple(dims))
    return meta


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # (numpy's integers are Integral)


def check_options(iterations: object, seed: object, opt_level: object, val_range: object,
                  threads: object = None, segment_memory: object = None) -> None:
    """The comparison's options, checked before any work: a wrong one is a one-line `SurgeonError` naming it
    (`opt_level` None: the default, 'all', or 'disable' for a run in segments)."""
    if not _is_int(iterations) or not 1 <= iterations <= MAX_ITERATIONS:
        raise SurgeonError(None, f"iterations must be an integer from 1 to {MAX_ITERATIONS:,} (got {iterations!r})")
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED + 1 - iterations:
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
    if threads is not None and not (_is_int(threads) and 1 <= threads <= MAX_THREADS or isinstance(
            threads, list | tuple) and threads and all(_is_int(t) and 1 <= t <= MAX_THREADS for t in threads)):
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
    the machine;
    at opt level 'disable' only, where that gives the whole model's bytes."""
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
    counts = None if threads is None else [threads] if _is_int(threads) else list(dict.fromkeys(threads))
    result.threads, result.polygraphy_passed = counts, True
    for count in counts or [None]:
        runs = _CpuRuns(original, opt_level, count, input_shapes, seed, iterations, ranges, fix)
        with _quiet_logs(quiet), scratch("deform-surgeon-verify-", "the outputs verify compares") as folder:
            results = _run_both(runs, patched, result, str(folder))
            _compare(results, result)
            del results  # (the outputs map files of `folder`, removed now)
            result.peak_rss["caller"] = _peak_rss()
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


@contextmanager
def _quiet_logs(quiet: bool) -> Iterator[None]:
    """polygraphy's and ORT's own failure lines silenced while the models run, when `quiet`: the verdict is ours,
    and theirs would only repeat it; so are numpy's RuntimeWarnings of polygraphy's statistics and input casts (a
    model with an empty input printed six lines of "Mean of empty slice" before PASSED, a --val-range past
    float16's an "overflow encountered in cast"), in this process and the forked children that run the models.
    polygraphy's severity and the warning filters are given back after."""
    import warnings

    import onnxruntime
    from polygraphy.logger import G_LOGGER

    old = G_LOGGER.module_severity
    if quiet:
        G_LOGGER.module_severity = G_LOGGER.CRITICAL
        onnxruntime.set_default_logger_severity(4)
    try:
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        G_LOGGER.module_severity = old


@dataclass(frozen=True)
class _CpuRuns:
    """The settings every run of one comparison shares: how a model's ORT CPU session is made, the seeded inputs it
    is fed, and the one line for a model that cannot run on them.

    Its bound methods are what `_run_one` and `_run_segments` are given in their forked child (background.py): the
    child sees this object as the caller had it (fork: nothing is pickled), and where no child can be had they run
    in the caller, the same."""

    original: str | Path
    opt_level: str
    threads: int | None
    input_shapes: dict[str, tuple[int, ...]] | None
    seed: int
    iterations: int
    ranges: dict[str, tuple[float, float]]
    fix: str  # the hint of a failure that is not an allocation (`_failure_hint`)

    def session_options(self):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = ort_level(self.opt_level)
        # no arena: ORT's CPU arena keeps what a run freed and grows in large steps, so one run of a large model
        # holds more than its live tensors; where the memory comes from changes no kernel and no byte (as in
        # run_ort_cpu)
        options.enable_cpu_mem_arena = False
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
            if self.threads > (os.cpu_count() or 1):  # more threads than cores: spinning ones take the others' time
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return options

    def session(self, path: str | Path):
        """A whole model's session; the original, given `input_shapes`, with its inputs fixed to them."""
        import onnxruntime

        options = self.session_options()
        # (the source is made here, in the run's own process: the fixed original's bytes are not held beside the
        # other model's run)
        source = (_ort_source(path) if not (self.input_shapes and path == self.original)
                  else _fixed(self.original, self.input_shapes))
        return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    def segment_session(self, file: Path):
        """One segment's session (checks/run_in_segments.py writes each segment to a file)."""
        import onnxruntime

        return onnxruntime.InferenceSession(str(file), self.session_options(), providers=["CPUExecutionProvider"])

    def loader(self):
        """polygraphy's DataLoader of the seeded inputs, the same for both models."""
        from polygraphy.comparator import DataLoader

        return DataLoader(seed=self.seed, iterations=self.iterations, val_range=dict(self.ranges),
                          input_metadata=_metadata(self.input_shapes))

    def failure(self, path: str | Path, exc: BaseException) -> SurgeonError:
        """The one line for a model that cannot run on the seeded inputs (in the run's own process)."""
        needs = _allocation(exc)
        if needs is not None:  # the size, not the values: say which size needs what
            given = " ".join(f"{k}:{','.join(map(str, v))}" for k, v in (self.input_shapes or {}).items())
            what = f"the size given with --input-shapes ({given})" if given else "the model's size"
            return SurgeonError(path, f"fails to run on ORT CPU with the seeded inputs: {what} needs {needs} in "
                                f"one allocation, which failed ({_one_line(exc)})")
        return SurgeonError(path, f"fails to run on ORT CPU with the seeded inputs ({_one_line(exc)})", self.fix)


def _run_both(runs: _CpuRuns, patched: str | Path, result: VerifyResult, folder: str):
    """Run one model after the other, each in its own forked process (background.py) whose memory is all given back
    when it ends: the peak is the larger model's, not the sum (issue 34: HR 2048's original alone peaks at 17.4 GB).
    Their outputs come back through files in `folder`, as polygraphy's RunResults; each run's peak RSS and, in
    segments, its segment counts go in `result`."""
    from polygraphy.comparator import IterationResult, RunResults

    results = RunResults()
    for name, path in (("original", runs.original), ("patched", patched)):
        try:
            if result.segment_memory is None:
                saved, peak = Background(_run_one, name, path, runs.session, runs.loader, folder, runs.failure,
                                         retry=False).result()
            else:
                fixed = runs.input_shapes if path == runs.original else None
                saved, peak, (result.segments[name], result.segment_disk[name]) = Background(
                    _run_segments, name, path, fixed, result.segment_memory, runs.segment_session, runs.loader,
                    folder, runs.failure, retry=False).result()
        except ChildDied as died:  # (not run again here: the system killed it, most likely for memory)
            raise SurgeonError(path, f"fails to run on ORT CPU with the seeded inputs: {died}",
                               "most likely out of memory: the run of one model needs what one ORT CPU "
                               "inference of it needs") from None
        results.append((name, [IterationResult(outputs=_load_outputs(files), runner_name=name) for files in saved]))
        result.peak_rss[name] = max(peak, result.peak_rss.get(name, 0))  # (the largest of its thread counts)
    return results


def _compare(results, result: VerifyResult) -> None:
    """polygraphy's verdict at zero tolerance, reported beside ours (`compare_bytes`), which is the verdict: both
    in `result`."""
    from polygraphy.comparator import Comparator
    from polygraphy.comparator.compare import SimpleCompareFunc

    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=0.0, rtol=0.0,
                                                                                     check_shapes=True))
    result.polygraphy_passed = result.polygraphy_passed and bool(accuracy)  # (every thread count's)
    (_, orig_iters), (_, patch_iters) = results[0], results[1]
    result.mismatch = compare_bytes(orig_iters, patch_iters, result)


def _peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB; macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _run_one(name: str, path: str | Path, session: Callable[[str | Path], object], loader: Callable[[], object],
             folder: str, failure: Callable[[str | Path, BaseException], SurgeonError]
             ) -> tuple[list[list[tuple[str, str]]], int]:
    """Run one model on the seeded inputs (polygraphy's Comparator, as before) and save every iteration's outputs
    as .npy files in `folder`; returns their names per iteration and the peak RSS of the run's process. Meant for
    a forked child (see `verify`): what it allocates goes back to the system when it ends."""
    import gc

    import numpy as np
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    collecting = gc.isenabled()
    gc.disable()  # in a child, its Python objects are the parent's pages: a collection would touch (copy) them all
    try:
        ran = Comparator.run([OnnxrtRunner(lambda: session(path), name=name)], data_loader=loader())
    except Exception as exc:
        raise failure(path, exc) from None
    finally:
        if collecting:
            gc.enable()
    saved = []
    for it, iteration in enumerate(ran[0][1]):
        files = []
        for k, (out, value) in enumerate(iteration.items()):
            file = os.path.join(folder, f"{name}.{it}.{k}.npy")
            np.save(file, np.asarray(value), allow_pickle=True)
            files.append((out, file))
        saved.append(files)
    return saved, _peak_rss()


def _run_segments(name: str, path: str | Path, input_shapes: dict[str, tuple[int, ...]] | None, max_bytes: int,
                  session: Callable[[Path], object], loader: Callable[[], object], folder: str,
                  failure: Callable[[str | Path, BaseException], SurgeonError]
                  ) -> tuple[list[list[tuple[str, str]]], int, tuple[int, int]]:
    """`_run_one` in segments (checks/run_in_segments.py): the same seeded inputs (polygraphy's DataLoader given
    the model's
    input metadata, as Comparator gives it the runner's), each model's outputs saved in `folder`; returns them, the
    run's peak RSS, and the number of segments and the peak bytes on disk between them. Meant for a forked child,
    as `_run_one`."""
    from polygraphy.backend.onnx.util import get_input_metadata

    from .run_in_segments import run_in_segments, segment_graph

    g = segment_graph(path, input_shapes)
    data = loader()
    data.input_metadata = get_input_metadata(g.model.graph)
    feeds = [dict(feed) for feed in data]
    try:
        saved, count, disk = run_in_segments(g, feeds, max_bytes, folder, session, name)
    except SurgeonError:
        raise
    except Exception as exc:
        raise failure(path, exc) from None
    return saved, _peak_rss(), (count, disk)


def _load_outputs(files: list[tuple[str, str]]) -> dict:
    """One iteration's outputs as `_run_one` saved them, mapped from their files rather than read into memory (an
    output that cannot be mapped, of Python objects, is read)."""
    from collections import OrderedDict

    import numpy as np

    out = OrderedDict()
    for name, file in files:
        try:
            out[name] = np.load(file, mmap_mode="r")
        except ValueError:
            out[name] = np.load(file, allow_pickle=True)
    return out


def compare_bytes(orig_iters, patch_iters, result: VerifyResult) -> Mismatch | None:
    """Exact comparison of every output of every iteration: names, dtypes, shapes, then bytes."""
    import numpy as np

    first: Mismatch | None = None
    for it, (a_out, b_out) in enumerate(zip(orig_iters, patch_iters, strict=True)):
        a_names, b_names = set(a_out.keys()), set(b_out.keys())
        if a_names != b_names:
            return Mismatch(it, ", ".join(sorted(a_names ^ b_names)), "output present in only one model")
        for name in sorted(a_names):
            a, b = np.asarray(a_out[name]), np.asarray(b_out[name])
            if name not in result.outputs_compared:
                result.outputs_compared.append(name)
            if a.dtype != b.dtype:
                return Mismatch(it, name, f"dtype differs: {a.dtype} vs {b.dtype}")
            if a.shape != b.shape:
                return Mismatch(it, name, f"shape differs: {list(a.shape)} vs {list(b.shape)}")
            diff = _max_abs_diff(a, b)
            result.max_abs_diff[name] = max(result.max_abs_diff.get(name, 0.0), diff)
            if a.tobytes() != b.tobytes() and first is None:
                av = a.reshape(-1).view(np.uint8).reshape(a.size, -1) if a.size else a
                bv = b.reshape(-1).view(np.uint8).reshape(b.size, -1) if b.size else b
                flat = int(np.nonzero((av != bv).any(axis=1))[0][0])
                idx = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.shape else ()
                verdict = judge({"max_abs_diff": diff, "dtype": str(a.dtype)}, same_runtime=True)
                first = Mismatch(it, name, verdict.text, idx,
                                 repr(a.reshape(-1)[flat].item()), repr(b.reshape(-1)[flat].item()))
    return first


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    import numpy as np

    if a.size == 0 or a.dtype == np.bool_:
        return 0.0 if a.size == 0 else float(np.count_nonzero(a != b))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[~np.isnan(d)]
    return float(d.max()) if d.size else (0.0 if np.array_equal(a, b, equal_nan=True) else math.inf)


def _fixed(path: str | Path, input_shapes: dict[str, tuple[int, ...]]) -> bytes:
    """The model at `path`, its weights in memory, with the given input dims (the reference of `--input-shapes`)."""
    import onnx

    from ..graph.input_shapes import fix_input_shapes

    model = onnx.load(str(path))
    fix_input_shapes(model, input_shapes, path)
    return model.SerializeToString()


def _ort_source(path: str | Path) -> str | bytes:
    """What to hand ONNX Runtime for `path`: the path, or the model's bytes when the path is not valid UTF-8
    (ORT's Python binding takes UTF-8 paths only); such a model with external data cannot be opened at all."""
    try:
        str(path).encode("utf-8")
        return str(path)
    except UnicodeEncodeError:
        from ..files.io_check import external_locations

        if external_locations(path):
            raise SurgeonError(path, "the path is not valid UTF-8 and the model has external data: ONNX Runtime "
                                     "cannot open it", "rename the file or its folder") from None
        return Path(path).read_bytes()


def _allocation(exc: BaseException) -> str | None:
    """The size of the allocation that failed, as numpy ("Unable to allocate 74.5 GiB ...") or ORT ("Failed to
    allocate memory for requested buffer of size N") word it; None when `exc` is no failed allocation."""
    import re

    text = str(exc)
    if m := re.search(r"Unable to allocate (\d+(?:\.\d*)?) ?([KMGTPE]?i?B)", text):
        return f"{m.group(1).rstrip('.')} {m.group(2)}"
    if m := re.search(r"allocate memory for requested buffer of size (\d+)", text):
        return f"{int(m.group(1)):,} bytes"
    return "more memory than there is" if isinstance(exc, MemoryError) else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300]
