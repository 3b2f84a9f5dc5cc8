"""The one road data takes: load -> Graph -> prove/rewrite -> cleanup/toposort -> export -> check -> verify ->
atomic save -> report. The CLI and the Python API both call `patch` and `inspect` here."""

from __future__ import annotations

from pathlib import Path

import onnx_graphsurgeon as gs

from .errors import SurgeonError, VerificationError
from .model_io import (
    check_model,
    check_output_path,
    copy_atomic,
    export_graph,
    infer_value_types,
    load_model,
    save_model_atomic,
)
from .passes.gather_elements import LowerGatherElements
from .passes.gathernd import LowerGatherND
from .passes.residency import NarrowIndexChains
from .passes.sum_chain import ChainSum
from .pipeline import Context, Options, run_passes
from .report import PatchReport, op_histogram
from .verify import verify as verify_models

SUM_MODES = ("chain", "tree", "none")


def default_passes() -> list:
    """The passes `patch` runs, in order (to a fixed point)."""
    return [LowerGatherND(), LowerGatherElements(), NarrowIndexChains(), ChainSum()]


def _run(model_path: str | Path, options: Options):
    model = load_model(model_path)
    check_model(model, model_path)
    graph = gs.import_onnx(model)
    ctx = Context(graph, infer_value_types(model), options)
    before = op_histogram(graph)
    actions = run_passes(ctx, default_passes())
    return model, graph, before, actions


def inspect(model_path: str | Path, *, allow_unproven: bool = False, sum_mode: str | None = None) -> PatchReport:
    """Dry run: what `patch` would rewrite or refuse, and why. Writes nothing."""
    options = _options(allow_unproven, sum_mode)
    _, graph, before, actions = _run(model_path, options)
    graph.cleanup().toposort()
    return PatchReport(str(model_path), None, False, vars(options), before, op_histogram(graph), actions,
                       note="inspect: dry run, nothing written")


def patch(model_path: str | Path, output_path: str | Path | None = None, *, allow_unproven: bool = False,
          sum_mode: str | None = None, verify: bool = False, copy_unchanged: bool = False,
          strict: bool = False, verify_options: dict | None = None) -> PatchReport:
    """Patch `model_path`; write `output_path` (atomically, and only after verification if `verify`).

    With nothing to rewrite, nothing is written unless `copy_unchanged` (then an exact copy of the input).
    With `strict`, nothing is written if any node was refused.
    Raises `SurgeonError` (one line: file and problem) on bad input and `VerificationError` when the patched
    model's outputs differ; in both cases no output file exists afterwards.
    """
    options = _options(allow_unproven, sum_mode)
    load_model(model_path) if not Path(model_path).is_file() else None  # a missing input is named first
    if output_path is not None:
        check_output_path(output_path, [model_path])
    model, graph, before, actions = _run(model_path, options)
    report = PatchReport(str(model_path), None if output_path is None else str(output_path), False,
                         vars(options), before, before, actions)
    if strict and report.refused and output_path is not None:
        report.note = f"--strict: {len(report.refused)} node(s) refused; {output_path} not written"
        return report
    if not report.changed:
        report.note = f"nothing to rewrite in {model_path}"
        if output_path is not None and copy_unchanged:
            copy_atomic(model_path, output_path)
            report.written = True
            report.note += f"; wrote an unchanged copy to {output_path}"
        elif output_path is not None:
            report.note += "; no output written (--copy-unchanged writes an unchanged copy)"
        return report

    graph.cleanup().toposort()
    report.ops_after = op_histogram(graph)
    patched = export_graph(graph, model)
    check_model(patched, output_path or f"{model_path} (patched)")
    if output_path is None:
        return report

    def _verify(tmp: Path) -> None:
        result = verify_models(model_path, tmp, **(verify_options or {}))
        report.verification = result
        if not result.identical:
            raise VerificationError(output_path, f"patched model differs from the original, not written: "
                                    f"{result.mismatch.text() if result.mismatch else 'outputs differ'}")

    save_model_atomic(patched, output_path, verify=_verify if verify else None)
    report.written = True
    return report


def _options(allow_unproven: bool, sum_mode: str | None) -> Options:
    sum_mode = "chain" if sum_mode is None else sum_mode
    if sum_mode not in SUM_MODES:
        raise SurgeonError(None, f"unknown sum mode '{sum_mode}'", f"choose one of {', '.join(SUM_MODES)}")
    return Options(allow_unproven=allow_unproven, sum_mode=sum_mode)
