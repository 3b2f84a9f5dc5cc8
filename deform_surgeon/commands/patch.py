"""The one road a model takes: load -> Graph -> prove/rewrite -> cleanup/toposort -> export -> check -> verify ->
atomic save -> report. The CLI and the Python API both call `patch` and `inspect` here; each is one `PatchRun`,
whose stages live beside it in `patching/`: `lift` (lift.py), `prove` (prove.py), `write`, `verify` and `undo`
(writing.py), and the report's notes (notes.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ..base.errors import SurgeonError, api_call
from ..base.stages import StageClock
from ..files import check_external_output, check_spliced, load_model, user_path
from ..files.io_check import check_io
from ..graph.device import DeviceProfile
from ..graph.ops import op_histogram
from ..graph.pipeline import Options, Refuse
from ..passes.registry import PASS_NAMES, make_passes
from ..passes.run_state import RunState
from .patching.lift import Lifted, fewer_gc_passes, lift_model, lift_within_memory
from .patching.notes import annotate, strict_note, weights_form
from .patching.options import (
    ComparisonOptions,
    WriteOptions,
    check_switches,
    comparison_options,
    rewrite_options,
    write_options,
)
from .patching.prove import prove_locally
from .patching.writing import Writing
from .report import PatchReport

PATCH_STAGES = ("prove", "export", "write", "verify")  # what `patch(progress=...)` reports, in this order
_PROGRESS = {"lift": "prove", "export": "export", "write": "write", "verify": "verify"}  # stage -> PATCH_STAGES
MEMORY_ROUNDS = 6  # --max-memory: at most this many re-chunkings after the first patch


def default_passes(state: RunState | None = None, skip: tuple[str, ...] = ()) -> list:
    """The passes `patch` runs, in order (to a fixed point): the pass registry's (passes/registry.py), but those
    named in `skip` (`--skip-pass`); the split, bands and deform_conv passes share the run's `state`."""
    return make_passes(state, skip)


def passes_run(options: Options) -> list[str]:
    """The names of the passes a run with `options` runs, in order (what the report lists)."""
    return [name for name in PASS_NAMES if name not in options.skip_passes]


@dataclass
class PatchRun(Writing):
    """One patch of one model, stage by stage: `lift` (load, fold, find the regions, run the passes), `prove`
    (each rewrite that is not exact by construction, on its own), `export` (splice the region into the model),
    then `write` while `verify` checks the written file, and `undo` a rewrite a check shows not exact (Writing).

    Its options by concern: `rewrite` (what the passes do and the device they fit), `writing` (where and how OUT
    is written; no output: nothing is), `comparison` (the whole-model check on ORT CPU). What the run owns:
    `state`, what it carries from one lift to the next (passes/run_state.py); `lifted`, the latest lift;
    `lift_note`, what the lifts and proofs put in the report's note (the `--max-memory` line, the rewrites the
    proofs undid); `report`; `undone`, the rewrites a check undid."""

    model_path: Path
    rewrite: Options = field(default_factory=Options)
    writing: WriteOptions = field(default_factory=WriteOptions)
    comparison: ComparisonOptions = field(default_factory=ComparisonOptions)
    clock: StageClock = field(default_factory=StageClock)
    state: RunState = field(default_factory=RunState)
    lifted: Lifted | None = None
    lift_note: str = ""
    report: PatchReport | None = None
    undone: dict[str, Refuse] = field(default_factory=dict)

    def lift_once(self) -> Lifted:
        """One lift of the model with the passes run on it, following and recording in `state`."""
        return lift_model(self.model_path, self.rewrite, self.state)

    def lift(self, rounds: int = MEMORY_ROUNDS) -> tuple[Lifted, str]:
        """`lift_once`, lifted again with more chunks until `--max-memory` fits (at most `rounds` more times);
        returns the lift and the report's line on the peak ("" without `--max-memory`)."""
        self.lifted, self.lift_note = lift_within_memory(self.lift_once, self.state, self.rewrite.max_memory,
                                                           rounds)
        return self.lifted, self.lift_note

    def prove(self) -> None:
        """Each rewrite not exact by construction shown exact on its own; one that is not is kept whole and the
        model lifted again (prove.py)."""
        self.lifted, self.lift_note = prove_locally(self.lifted, self.lift_note, self.state, self.lift)

    def run(self) -> PatchReport:
        """The road, each stage timed by `clock`: lift, prove, export, then write while verify runs (undo where a
        check shows a rewrite not exact); the report."""
        output, strict = self.writing.output, self.writing.strict
        self.clock.enter("lift")
        self.state.check_in_pass = output is None  # written: each rewrite's own proof decides (`prove`)
        lifted, note = self.lift()
        if output is not None:
            check_external_output(output, lifted.weights, self.writing.form)
        report = self.report = self._report(lifted, note)
        if strict and report.findings and output is not None:
            strict_note(report)
            return report
        if not report.changed:
            return self.write_unchanged()
        if output is not None:
            self.clock.enter("prove")
            self.prove()
            report.actions = self.lifted.actions
            annotate(report, self.lifted, self.lift_note)
            if strict and report.findings:  # a rewrite its proof undid is refused now
                strict_note(report)
                return report
        patched, region = self.export()
        if output is None:
            check_spliced(patched, region, f"{self.model_path} (patched)", self.lifted.weights)
            return report
        return self.write()

    def export(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """The whole model with the rewritten region spliced in, and the region; the report's op counts and
        WebGPU kernels are the patched model's from here on."""
        self.clock.enter("export")
        patched, region = self.lifted.patched()
        self.report.ops_after, self.report.webgpu = op_histogram(patched), self.lifted.kernels(patched=True)
        return patched, region

    def _report(self, lifted: Lifted, note: str) -> PatchReport:
        """The report of the first lift: its actions, notes and where the output's weights go."""
        output = self.writing.output
        report = PatchReport(str(self.model_path), None if output is None else str(output), False,
                             vars(self.rewrite), lifted.ops_before, lifted.ops_before, lifted.actions,
                             passes=passes_run(self.rewrite))
        report.stages = self.clock.rows
        annotate(report, lifted, note)
        report.weights = weights_form(self.model_path, output, lifted.weights, self.writing.form)
        return report


@api_call
def inspect(model_path: str | Path, *, allow_unproven: bool = False, sum_mode: str | None = None,
            max_buffer: int | str | None = None, max_memory: int | str | None = None,
            device_profile: str | Path | DeviceProfile | None = None,
            input_shapes: dict[str, list[int] | tuple[int, ...]] | None = None,
            skip_passes: list[str] | tuple[str, ...] | None = None) -> PatchReport:
    """Dry run: what `patch` would rewrite or refuse, and why. Writes nothing (so the whole-model verification a
    split Conv needs before it is written is not run either)."""
    model_path = user_path(model_path, "the model")
    options = rewrite_options(allow_unproven=allow_unproven, sum_mode=sum_mode, max_buffer=max_buffer,
                              max_memory=max_memory, device_profile=device_profile, input_shapes=input_shapes,
                              skip_passes=skip_passes)
    lifted, note = PatchRun(model_path, options).lift()
    report = PatchReport(str(model_path), None, False, vars(options), lifted.ops_before, {}, lifted.actions,
                         passes=passes_run(options))
    annotate(report, lifted, "inspect: dry run, nothing written", note)  # (before the splice changes the model)
    report.ops_after, report.webgpu = op_histogram(lifted.patched()[0]), lifted.kernels(patched=True)
    return report


@api_call
@fewer_gc_passes()
def patch(model_path: str | Path, output_path: str | Path | None = None, *, allow_unproven: bool = False,
          sum_mode: str | None = None, verify: bool = False, copy_unchanged: bool = False,
          strict: bool = False, verify_options: dict | None = None, max_buffer: int | str | None = None,
          max_memory: int | str | None = None, device_profile: str | Path | DeviceProfile | None = None,
          progress: Callable[[str], None] | None = None,
          input_shapes: dict[str, list[int] | tuple[int, ...]] | None = None,
          skip_passes: list[str] | tuple[str, ...] | None = None, external_data: str | None = None,
          data_suffix: str | None = None) -> PatchReport:
    """Patch `model_path`; write `output_path` (atomically, and only after verification if `verify`).

    `input_shapes` ({input: dims}, `--input-shape`) fixes the named inputs' symbolic dims first (input_shapes.py);
    without it, a model with symbolic input dims is patched as it is and the report says for which sizes.
    Every node is fitted to `device_profile` (default `spec-default`, see device.py): a Split / Concat / Max / Min
    binding more storage buffers than it allows becomes a tree of narrower ones, and no tensor stays over what one
    binding may hold (`max_buffer`, default min(maxStorageBufferBindingSize, maxBufferSize) of the profile): deform
    blocks in row chunks, Convs in row bands, Resizes in channel groups.
    Weights are never loaded into memory as a whole (see files): a model with external data keeps it external,
    in the output's own `<OUT>.data` (`<OUT>_data` when the input's is so named, as transformers.js names it).
    `external_data` ("auto", "always", "never"; `--external-data`) says where the output's weights go: by default a
    single file too large for a browser page to load (`files.BROWSER_SINGLE_FILE_LIMIT`) is written with its
    weights in `<OUT>_data` (the output's own size decides); the report's `weights` says which form was written, and
    why. `data_suffix` ("_data", ".data") names the data file `<OUT>` + it whatever the input's is named (`batch` of
    a transformers.js folder: `<name>.onnx_data`, the name it fetches).
    `progress(stage)` is called as the work reaches each of `PATCH_STAGES`.
    `skip_passes` names passes of the registry (passes/registry.py: `PASS_NAMES`) not to run, e.g. to find which
    rewrite a failing verification comes from; the report lists the passes that ran.

    With nothing to rewrite, nothing is written unless `copy_unchanged` (then an exact copy of the input).
    With `strict`, nothing is written on a finding: a node refused, or a tensor staying over the device profile
    (`PatchReport.findings`; the report's `status` is then `refused` either way).
    A rewrite that is not exact by construction (`Action.needs_verify`: a split Conv, a band, a channel group) is
    written only once shown exact on its own (`PatchRun.prove`, proofs/local_proof.py); one that is not is undone
    (the report says why) and the rest is written. One without such a proof is written only after the whole
    patched model verified byte-identical, with or without `verify`.
    Raises `SurgeonError` (one line: file and problem) on bad input and `VerificationError` when the patched
    model's outputs differ; in both cases no output file exists afterwards.
    """
    model_path = user_path(model_path, "the model")
    output_path = None if output_path is None else user_path(output_path, "the output")
    options = rewrite_options(allow_unproven=allow_unproven, sum_mode=sum_mode, max_buffer=max_buffer,
                              max_memory=max_memory, device_profile=device_profile, input_shapes=input_shapes,
                              skip_passes=skip_passes)
    check_switches(verify=verify, copy_unchanged=copy_unchanged, strict=strict)
    writing = write_options(output_path, copy_unchanged=copy_unchanged, strict=strict, external_data=external_data,
                            data_suffix=data_suffix)
    if progress is not None and not callable(progress):
        raise SurgeonError(None, f"progress must be a function of the stage name, or None (got {progress!r})")
    comparison = comparison_options(verify, verify_options)
    load_model(model_path) if not os.path.isfile(model_path) else None  # a missing input is named first
    if output_path is not None:
        check_io([model_path], output_path, external_data=writing.form.choice, data_suffix=data_suffix)
    clock = StageClock(None if progress is None else
                       lambda name: progress(_PROGRESS[name]) if name in _PROGRESS else None)
    try:
        return PatchRun(model_path, options, writing, comparison, clock).run()
    finally:
        clock.close()
