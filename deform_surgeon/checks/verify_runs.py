"""The comparison's runs: both models on ORT CPU on the same seeded inputs, one after the other, each in its own
forked process (whole, or in segments), their outputs saved to files and compared."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..base.background import Background, ChildDied
from ..base.errors import SurgeonError
from ..base.ort_cpu import ort_level
from .verify_result import VerifyResult, compare_bytes


def _metadata(input_shapes: dict[str, tuple[int, ...]] | None):
    """polygraphy's TensorMetadata for the given input dims (dtype from the model), or None."""
    if not input_shapes:
        return None
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for name, dims in input_shapes.items():
        meta.add(name, None, tuple(dims))
    return meta


@contextmanager
def quiet_logs(quiet: bool) -> Iterator[None]:
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
class CpuRuns:
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


def run_both(runs: CpuRuns, patched: str | Path, result: VerifyResult, folder: str):
    """Run one model after the other, each in its own forked process (background.py) whose memory is all given back
    when it ends: the peak is the larger model's, not the sum (BiRefNet HR 2048's original alone peaks at 17.4 GB).
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


def compare_runs(results, result: VerifyResult) -> None:
    """polygraphy's verdict at zero tolerance, reported beside ours (`compare_bytes`), which is the verdict: both
    in `result`."""
    from polygraphy.comparator import Comparator
    from polygraphy.comparator.compare import SimpleCompareFunc

    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=0.0, rtol=0.0,
                                                                                     check_shapes=True))
    result.polygraphy_passed = result.polygraphy_passed and bool(accuracy)  # (every thread count's)
    (_, orig_iters), (_, patch_iters) = results[0], results[1]
    result.mismatch = compare_bytes(orig_iters, patch_iters, result)


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB; macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _run_one(name: str, path: str | Path, session: Callable[[str | Path], object], loader: Callable[[], object],
             folder: str, failure: Callable[[str | Path, BaseException], SurgeonError]
             ) -> tuple[list[list[tuple[str, str]]], int]:
    """Run one model on the seeded inputs (polygraphy's Comparator) and save every iteration's outputs
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
    return saved, peak_rss()


def _run_segments(name: str, path: str | Path, input_shapes: dict[str, tuple[int, ...]] | None, max_bytes: int,
                  session: Callable[[Path], object], loader: Callable[[], object], folder: str,
                  failure: Callable[[str | Path, BaseException], SurgeonError]
                  ) -> tuple[list[list[tuple[str, str]]], int, tuple[int, int]]:
    """`_run_one` in segments (checks/run_in_segments.py): the same seeded inputs (polygraphy's DataLoader given
    the model's input metadata, as Comparator gives it the runner's), each model's outputs saved in `folder`;
    returns them, the run's peak RSS, and the number of segments and the peak bytes on disk between them. Meant
    for a forked child, as `_run_one`."""
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
    return saved, peak_rss(), (count, disk)


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
