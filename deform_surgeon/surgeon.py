"""The one road data takes: load -> Graph -> prove/rewrite -> cleanup/toposort -> export -> check -> verify ->
atomic save -> report. The CLI and the Python API both call `patch` and `inspect` here."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from .errors import SurgeonError, VerificationError
from .fold import fold_static
from .model_io import (
    Weights,
    check_and_infer,
    check_external_output,
    check_output_path,
    check_spliced,
    copy_atomic,
    export_graph,
    import_graph,
    load_model,
    save_model_atomic,
    split_weights,
    stubbed_copy,
)
from .passes.gather_elements import LowerGatherElements
from .passes.gathernd import LowerGatherND
from .passes.residency import NarrowIndexChains
from .passes.split import SplitBlocks
from .passes.sum_chain import ChainSum
from .pipeline import Context, Options, run_passes
from .region import Region, find_region, region_model, splice
from .report import PatchReport, op_histogram
from .slices import split_to_slices
from .verify import verify as verify_models

SUM_MODES = ("chain", "tree", "none")
PATCH_STAGES = ("prove", "export", "write", "verify")  # what `patch(progress=...)` reports, in this order


def default_passes() -> list:
    """The passes `patch` runs, in order (to a fixed point)."""
    return [LowerGatherND(), LowerGatherElements(), NarrowIndexChains(), ChainSum(), SplitBlocks()]


@contextmanager
def _fewer_gc_passes() -> Iterator[None]:
    """Lifting a region creates tens of thousands of small objects (graph-surgeon nodes and tensors) that all
    live until the patch is written; with the default gen-0 threshold (700) the cyclic collector walks them over
    and over (measured: ~0.05 s of a 1.7 s patch of a 19,000-node model)."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _run(model_path: str | Path, options: Options) -> Lifted:
    """Load, check, fold what is static, prove/rewrite, never copying weights: checker and shape inference see a
    weight-less copy, the static float16 computations are folded and float16 Splits become Slices on the whole
    model (fold.py, slices.py), only the deform regions are lifted into a graph (see region.py), stored weights
    as lazy constants."""
    model = load_model(model_path)
    weights = split_weights(model, Path(model_path).parent)
    types = check_and_infer(model, model_path, weights)
    ops_before = op_histogram(model)
    whole = fold_static(model, types, weights) + split_to_slices(model, types)  # whole-model steps, in place
    region = find_region(model)
    sub = region_model(model, region, types, set(weights.tensors))
    graph = import_graph(sub, weights)
    ctx = Context(graph, types, options, reserved=region.names)
    actions = whole + run_passes(ctx, default_passes())
    return Lifted(model, weights, region, sub, graph, actions, ops_before)


@dataclass
class Lifted:
    model: onnx.ModelProto
    weights: Weights
    region: Region
    sub: onnx.ModelProto
    graph: gs.Graph
    actions: list
    ops_before: dict[str, int]  # of the model as loaded (`model` has its static float16 computations folded)

    def patched(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """The whole model with the rewritten region spliced in (stored weights as stubs, see model_io), and the
        rewritten region on its own (what `check_spliced` infers)."""
        self.graph.cleanup().toposort()
        region = export_graph(self.graph, self.sub, self.weights)
        return splice(self.model, self.region, region, set(self.weights.tensors), self.weights.stubbed), region


def inspect(model_path: str | Path, *, allow_unproven: bool = False, sum_mode: str | None = None,
            max_buffer: int | None = None) -> PatchReport:
    """Dry run: what `patch` would rewrite or refuse, and why. Writes nothing."""
    options = _options(allow_unproven, sum_mode, max_buffer)
    lifted = _run(model_path, options)
    return PatchReport(str(model_path), None, False, vars(options), lifted.ops_before,
                       op_histogram(lifted.patched()[0]), lifted.actions, note="inspect: dry run, nothing written")


@_fewer_gc_passes()
def patch(model_path: str | Path, output_path: str | Path | None = None, *, allow_unproven: bool = False,
          sum_mode: str | None = None, verify: bool = False, copy_unchanged: bool = False,
          strict: bool = False, verify_options: dict | None = None, max_buffer: int | None = None,
          progress: Callable[[str], None] | None = None) -> PatchReport:
    """Patch `model_path`; write `output_path` (atomically, and only after verification if `verify`).

    Weights are never loaded into memory as a whole (see model_io): a model with external data keeps it external,
    in the output's own `<OUT>.data`. `progress(stage)` is called as the work reaches each of `PATCH_STAGES`.

    With nothing to rewrite, nothing is written unless `copy_unchanged` (then an exact copy of the input).
    With `strict`, nothing is written if any node was refused.
    Raises `SurgeonError` (one line: file and problem) on bad input and `VerificationError` when the patched
    model's outputs differ; in both cases no output file exists afterwards.
    """
    options = _options(allow_unproven, sum_mode, max_buffer)
    load_model(model_path) if not Path(model_path).is_file() else None  # a missing input is named first
    if output_path is not None:
        check_output_path(output_path, [model_path])
    stage = progress or (lambda _: None)
    stage("prove")
    lifted = _run(model_path, options)
    model, weights, actions, before = lifted.model, lifted.weights, lifted.actions, lifted.ops_before
    if output_path is not None:
        check_external_output(output_path, model_path, weights)
    report = PatchReport(str(model_path), None if output_path is None else str(output_path), False,
                         vars(options), before, before, actions)
    if strict and report.refused and output_path is not None:
        report.note = f"--strict: {len(report.refused)} node(s) refused; {output_path} not written"
        return report
    if not report.changed:
        report.note = f"nothing to rewrite in {model_path}"
        if output_path is not None and copy_unchanged:
            if weights.external:  # its data must move beside the copy: same tensors, references re-pointed
                stage("write")
                save_model_atomic(stubbed_copy(model, weights), output_path, weights=weights)
            else:
                copy_atomic(model_path, output_path)
            report.written = True
            report.note += f"; wrote an unchanged copy to {output_path}"
        elif output_path is not None:
            report.note += "; no output written (--copy-unchanged writes an unchanged copy)"
        return report

    stage("export")
    patched, region = lifted.patched()
    report.ops_after = op_histogram(patched)
    check_spliced(patched, region, output_path or f"{model_path} (patched)", weights)
    if output_path is None:
        return report

    def _verify(tmp: Path) -> None:
        stage("verify")
        result = verify_models(model_path, tmp, **(verify_options or {}))
        report.verification = result
        if not result.identical:
            raise VerificationError(output_path, f"patched model differs from the original, not written: "
                                    f"{result.mismatch.text() if result.mismatch else 'outputs differ'}")

    stage("write")
    save_model_atomic(patched, output_path, verify=_verify if verify else None, weights=weights)
    report.written = True
    return report


def _options(allow_unproven: bool, sum_mode: str | None, max_buffer: int | None = None) -> Options:
    sum_mode = "chain" if sum_mode is None else sum_mode
    if sum_mode not in SUM_MODES:
        raise SurgeonError(None, f"unknown sum mode '{sum_mode}'", f"choose one of {', '.join(SUM_MODES)}")
    if max_buffer is not None and (isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1):
        raise SurgeonError(None, f"bad max buffer size {max_buffer!r}", "give a positive number of bytes")
    return Options(allow_unproven=allow_unproven, sum_mode=sum_mode, max_buffer=max_buffer)
