"""The one road data takes: load -> Graph -> prove/rewrite -> cleanup/toposort -> export -> check -> verify ->
atomic save -> report. The CLI and the Python API both call `patch` and `inspect` here."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..base.background import Background
from ..base.errors import SurgeonError, VerificationError, api_call
from ..base.scratch import TmpdirFull, scratch
from ..base.stages import StageClock, step
from ..checks.run_in_segments import SEGMENT_LEVEL
from ..checks.verify import DEFAULT_ITERATIONS, check_verify_options, level_of
from ..checks.verify import verify as verify_models
from ..files import (
    DATA_SUFFIXES,
    EXTERNAL_DATA_CHOICES,
    DataForm,
    TypeTable,
    Weights,
    Written,
    check_external_output,
    check_spliced,
    checked_types,
    copy_atomic,
    elem_nbytes,
    export_graph,
    load_model,
    save_model_atomic,
    single_file_problem,
    tidy,
    user_path,
    weights_external,
)
from ..files.io_check import check_io
from ..graph.budget import human, write_in_execution_order
from ..graph.device import DeviceProfile, resolve_profile
from ..graph.fold import fold_static, has_reduced_floats
from ..graph.input_shapes import check_input_shapes, fix_input_shapes, impossible_reshape, symbolic_inputs
from ..graph.kernels import KernelReport, kernel_report
from ..graph.ops import op_histogram
from ..graph.pipeline import SUM_MODES, Action, Context, Options, Outcome, Refuse, run_passes
from ..graph.region import Region, find_region, region_model, splice, type_boundary
from ..passes.bands import BandOversize
from ..passes.float16_slices import split_to_slices
from ..passes.registry import PASS_NAMES, check_pass_names, make_passes
from ..passes.run_state import RunState
from ..passes.split import SplitBlocks
from ..proofs.local_proof import unshown_threads
from .report import PatchReport

PATCH_STAGES = ("prove", "export", "write", "verify")  # what `patch(progress=...)` reports, in this order


MEMORY_ROUNDS = 6  # --max-memory: at most this many re-chunkings after the first patch


def default_passes(plan: RunState | None = None, skip: tuple[str, ...] = ()) -> list:
    """The passes `patch` runs, in order (to a fixed point): the pass registry's (passes/registry.py), but those
    named in `skip` (`--skip-pass`); the split and bands passes share `plan`."""
    return make_passes(plan, skip)


def passes_run(options: Options) -> list[str]:
    """The names of the passes a run with `options` runs, in order (what the report lists)."""
    return [name for name in PASS_NAMES if name not in options.skip_passes]


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


def _run(model_path: str | Path, options: Options, plan: RunState | None = None) -> Lifted:
    """Load, check, fold what is static, prove/rewrite, never copying weights: checker and shape inference see the
    model's skeleton, on a second core while the deform regions are found (background.py); the static float16
    computations are folded and float16 Splits become Slices on the whole model (fold.py, float16_slices.py); only the
    deform regions are lifted into a graph (see region.py), stored tensors as its typed inputs, read through
    `Weights.read` (see files/weights.py)."""
    model, weights = load_model(model_path)
    fixed = fix_input_shapes(model, options.input_shapes, model_path) if options.input_shapes else []
    checking = Background(checked_types, model, model_path, weights)
    try:
        ops_before = op_histogram(model)
        reduced = has_reduced_floats(model)
        early = None
        if not reduced:  # nothing to fold: lift while checking, assuming nothing is over the buffer limit
            try:
                early = _lift_region(model, find_region(model, options.storage_buffers, set(), weights))
            except Exception:  # a model the checker refuses: its verdict is the one to give
                early = None
        types = TypeTable(onnx.GraphProto.FromString(checking.result()))
    finally:
        checking.close()
    if fixed:
        impossible_reshape(model, types, model_path)
    whole = [Action("input-shape", line.split(":")[0], "Input", Outcome.REWRITTEN,
                    f"fixed to the given size ({line}): what is then static is folded, by fold.py for float16 or "
                    "by ORT when the session is created",
                    details={"shape": next(dims for name, dims in options.input_shapes.items()
                                           if line.startswith(f"{name}: "))})
             for line in fixed]
    whole += fold_static(model, types, weights) + split_to_slices(model, types) if reduced else []  # in place
    oversize, over_at_smallest = _over_limit(types, options.max_buffer)
    if oversize:  # the region grows by the nodes that make or read them: the early lift does not hold them
        early = None
    region, sub, graph = early or _lift_region(model, find_region(model, options.storage_buffers, oversize,
                                                                  weights))
    type_boundary(graph, types)
    ctx = Context(graph, types, options, reserved=region.names, stored=weights,
                  made_by_ort=_made_by_ort(model_path) if reduced and oversize else None)
    if plan is not None:
        plan.start_lift()
    actions = whole + run_passes(ctx, default_passes(plan, options.skip_passes))
    return Lifted(model, weights, region, sub, graph, actions, ops_before, types, ctx, oversize, over_at_smallest)


def _made_by_ort(model_path: str | Path) -> frozenset[str] | None:
    """passes/cut_and_join.py `made_by_ort`, once per file version (`patch` lifts a model several times); None where ORT
    CPU cannot make a session of the file (the cuts then keep float32 values everywhere, the whole-model check
    decides)."""
    stat = Path(model_path).stat()
    return _made_by_ort_cached(str(Path(model_path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _made_by_ort_cached(path: str, mtime_ns: int, size: int) -> frozenset[str] | None:
    from ..passes.cut_and_join import made_by_ort

    try:
        return made_by_ort(path)
    except TmpdirFull:
        raise
    except Exception:  # onnxruntime's own errors: the model's verdict is given where it is run (verify)
        return None


def _lift_region(model: onnx.ModelProto, region: Region) -> tuple[Region, onnx.ModelProto, gs.Graph]:
    sub = region_model(model, region)
    return region, sub, gs.import_onnx(sub)


def _over_limit(types: TypeTable, limit: int | None) -> tuple[set[str], dict[str, int]]:
    """In one walk of the type table (80,000 entries on BiRefNet-lite): the tensors whose inferred static size is
    over `limit` bytes, and those with a dim shape inference leaves symbolic whose size with every such dim taken
    as 1 is already over it, with that size (a tensor with a 0 dim is empty: none is). Neither without a limit.
    Why the second: a Swin block's shifted windows can leave the batch dim of its MLP unknown to ONNX inference
    (`[unk, 65536, 768]`), so the passes do not see it; at its smallest it is over the limit all the same, and the
    report must say so (`_over_profile_note`)."""
    if limit is None:
        return set(), {}
    big, at_smallest = set(), {}
    for name in types:
        elem, shape = types[name]
        if not shape:
            continue
        if all(isinstance(d, int) for d in shape):
            if (elem_nbytes(elem, shape) or 0) > limit:
                big.add(name)
        elif all(d != 0 for d in shape):
            size = elem_nbytes(elem, [d if isinstance(d, int) else 1 for d in shape]) or 0
            if size > limit:
                at_smallest[name] = size
    return big, at_smallest


_CHUNKING = (SplitBlocks.name, BandOversize.name)  # passes that make parallel chunks of one computation


@dataclass
class Lifted:
    model: onnx.ModelProto  # as loaded (and folded); `patched()` splices the rewritten region into it
    weights: Weights
    region: Region
    sub: onnx.ModelProto
    graph: gs.Graph
    actions: list
    ops_before: dict[str, int]  # of the model as loaded (`model` has its static float16 computations folded)
    types: TypeTable  # shape inference of the model as loaded
    ctx: Context | None = None  # the passes' context (its prover and runtime run the local proofs)
    oversize: set[str] = dataclasses.field(default_factory=set)  # the loaded model's tensors over --max-buffer
    over_at_smallest: dict[str, int] = dataclasses.field(default_factory=dict)  # see _over_limit
    _patched: tuple[onnx.ModelProto, onnx.ModelProto] | None = None

    def patched(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """The whole model with the rewritten region spliced in (`model` itself: its weights are never copied), and
        the rewritten region on its own (what `check_spliced` infers)."""
        if self._patched is None:
            region = export_graph(tidy(self.graph), self.sub)
            whole = splice(self.model, self.region, region, self.weights)
            if any(a.pass_name in _CHUNKING and a.action == Outcome.REWRITTEN for a in self.actions):
                write_in_execution_order(whole)  # the file's order is then the one budget measures the peak in
            self._patched = (whole, region)
        return self._patched

    def kernels(self, patched: bool) -> KernelReport:
        """The nodes without a WebGPU kernel (kernels.py) of the model as loaded (and folded), or as patched (the
        rewritten region's new tensors typed by shape inference of the region alone)."""
        if not patched:
            return kernel_report(self.model, self.types)
        whole, region = self.patched()
        region_types = TypeTable(onnx.shape_inference.infer_shapes(region).graph)
        return kernel_report(whole, self.types, region_types)


def _lift(model_path: str | Path, options: Options, plan: RunState, rounds: int = MEMORY_ROUNDS
          ) -> tuple[Lifted, str]:
    """`_run`, and with `--max-memory` more chunks per deform block until budget's peak of live tensors of the
    whole patched model fits; returns the lifted model and a line on the peak for the report ("" without it).

    Why a loop over the whole model: the peak is a property of the whole graph and its execution order (what else
    is live while a block runs), which the split pass, seeing the deform regions only, cannot know. Each round
    asks the block holding most of the peak for as many more chunks as the overshoot needs, if its tensors shrank
    in proportion, until it fits, a round changes nothing, or `MEMORY_ROUNDS` have run.
    """
    from ..graph.budget import analyze, human

    lifted = _run(model_path, options, plan)
    limit = options.max_memory
    if limit is None:
        return lifted, ""
    before = analyze(lifted.model, weights=lifted.weights).peak_bytes
    best = None
    for k in range(rounds + 1):
        peak = analyze(lifted.patched()[0], weights=lifted.weights)
        if best is None or peak.peak_bytes < best[0].peak_bytes:
            best = (peak, lifted, dict(plan.min_chunks))
        if peak.peak_bytes <= limit or k == rounds:
            break
        more = _more_chunks(peak, plan, limit)
        if not more:
            break
        plan.min_chunks.update(more)
        lifted = _run(model_path, options, plan)
    peak, lifted, plan.min_chunks = best  # more chunks can raise the peak (a Conv kept whole): keep the lowest
    fits = peak.peak_bytes <= limit
    line = (f"--max-memory {human(limit)}: peak of live activations (budget's measure) {human(before)} -> "
            f"{human(peak.peak_bytes)}, " + ("within the limit" if fits else
                                             f"REMAINS OVER the limit at {peak.peak_node}"))
    if not fits:
        held = max(peak.peak_blocks.items(), key=lambda kv: kv[1], default=None)
        line += (f" (largest share: {held[0]}, {human(held[1])}; the rest is live outside it)" if held else
                 " (none of it in a deform block)")
        line += "; largest tensors live there: " + ", ".join(f"'{t.name}' {human(t.nbytes)} from {t.producer}"
                                                            for t in peak.peak_live)
    return lifted, line


def _more_chunks(peak, plan: RunState, limit: int) -> dict[str, int]:
    """Chunks for the deform block holding most of the peak so that, were its live bytes proportional to its rows,
    the peak would fit; {} when no block can help (the rest of the peak alone is over the limit, or the block got
    no more chunks than asked last round)."""
    if not peak.peak_blocks:
        return {}
    label, held = max(peak.peak_blocks.items(), key=lambda kv: kv[1])
    conv = peak.block_convs.get(label)
    rest = peak.peak_bytes - held
    if conv is None or rest >= limit:
        return {}
    have = plan.chunks.get(conv, 1)
    if plan.min_chunks.get(conv, 1) > have:
        return {}  # asked for more than the block could give (one row per chunk, or refused)
    return {conv: max(have + 1, math.ceil(have * held / (limit - rest)))}


@api_call
def inspect(model_path: str | Path, *, allow_unproven: bool = False, sum_mode: str | None = None,
            max_buffer: int | str | None = None, max_memory: int | str | None = None,
            device_profile: str | Path | DeviceProfile | None = None,
            input_shapes: dict[str, list[int] | tuple[int, ...]] | None = None,
            skip_passes: list[str] | tuple[str, ...] | None = None) -> PatchReport:
    """Dry run: what `patch` would rewrite or refuse, and why. Writes nothing (so the whole-model verification a
    split Conv needs before it is written is not run either)."""
    model_path = user_path(model_path, "the model")
    options = _options(allow_unproven, sum_mode, max_buffer, max_memory, device_profile, input_shapes, skip_passes)
    lifted, memory = _lift(model_path, options, RunState())
    report = PatchReport(str(model_path), None, False, vars(options), lifted.ops_before, {}, lifted.actions,
                         passes=passes_run(options))
    _annotate(report, lifted, "inspect: dry run, nothing written", memory)  # (before the splice changes the model)
    report.ops_after, report.webgpu = op_histogram(lifted.patched()[0]), lifted.kernels(patched=True)
    return report


@api_call
@_fewer_gc_passes()
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
    written only once shown exact on its own (`_prove_locally`, proofs/local_proof.py); one that is not is undone
    (the report says why) and the rest is written. One without such a proof is written only after the whole
    patched model verified byte-identical, with or without `verify`.
    Raises `SurgeonError` (one line: file and problem) on bad input and `VerificationError` when the patched
    model's outputs differ; in both cases no output file exists afterwards.
    """
    model_path = user_path(model_path, "the model")
    output_path = None if output_path is None else user_path(output_path, "the output")
    options = _options(allow_unproven, sum_mode, max_buffer, max_memory, device_profile, input_shapes, skip_passes)
    _switches(verify=verify, copy_unchanged=copy_unchanged, strict=strict)
    external_data = "auto" if external_data is None else external_data
    if not isinstance(external_data, str) or external_data not in EXTERNAL_DATA_CHOICES:
        raise SurgeonError(None, f"unknown external_data {external_data!r}",
                           f"choose one of {', '.join(EXTERNAL_DATA_CHOICES)}")
    if data_suffix is not None and data_suffix not in DATA_SUFFIXES:
        raise SurgeonError(None, f"unknown data_suffix {data_suffix!r}", f"choose one of {', '.join(DATA_SUFFIXES)}")
    form = DataForm(external_data, data_suffix)
    if progress is not None and not callable(progress):
        raise SurgeonError(None, f"progress must be a function of the stage name, or None (got {progress!r})")
    check_verify_options(verify_options)  # also used without `verify`, by the whole-model check of a split Conv
    load_model(model_path) if not os.path.isfile(model_path) else None  # a missing input is named first
    if output_path is not None:
        check_io([model_path], output_path, external_data=external_data, data_suffix=data_suffix)
    clock = StageClock(None if progress is None else
                       lambda name: progress(_PROGRESS[name]) if name in _PROGRESS else None)
    try:
        return _stages(model_path, output_path, options, clock, verify=verify, copy_unchanged=copy_unchanged,
                       strict=strict, verify_options=verify_options, form=form)
    finally:
        clock.close()


_PROGRESS = {"lift": "prove", "export": "export", "write": "write", "verify": "verify"}  # stage -> PATCH_STAGES


def _stages(model_path: Path, output_path: Path | None, options: Options, clock: StageClock, *, verify: bool,
            copy_unchanged: bool, strict: bool, verify_options: dict | None, form: DataForm) -> PatchReport:
    """`patch` once its arguments are checked: lift (load, fold, find the regions, run the passes), prove each
    rewrite that is not exact by construction on its own, export (splice the region into the model), then write
    while the checks run (`_Writing`), each a stage of `clock`."""
    clock.enter("lift")
    plan = RunState(check_in_pass=output_path is None)  # written: each rewrite's own proof decides (below)
    lifted, memory = _lift(model_path, options, plan)
    weights = lifted.weights
    if output_path is not None:
        check_external_output(output_path, weights, form)
    report = PatchReport(str(model_path), None if output_path is None else str(output_path), False,
                         vars(options), lifted.ops_before, lifted.ops_before, lifted.actions,
                         passes=passes_run(options))
    report.stages = clock.rows
    _annotate(report, lifted, memory)
    report.weights = _weights_form(model_path, output_path, weights, form)
    if strict and report.findings and output_path is not None:
        _strict_note(report)
        return report
    if not report.changed:
        return _unchanged(report, lifted, output_path, copy_unchanged, form, clock)
    if output_path is not None:
        clock.enter("prove")
        lifted, memory = _prove_locally(model_path, options, plan, lifted, memory)
        report.actions = lifted.actions
        _annotate(report, lifted, memory)
        if strict and report.findings:  # a rewrite its proof undid is refused now
            _strict_note(report)
            return report
    clock.enter("export")
    patched, region = lifted.patched()
    report.ops_after = op_histogram(patched)
    report.webgpu = lifted.kernels(patched=True)
    if output_path is None:
        check_spliced(patched, region, f"{model_path} (patched)", weights)
        return report
    return _Writing(model_path, output_path, options, plan, report, lifted, memory, verify, verify_options or {},
                    form, strict, clock).run()


def _unchanged(report: PatchReport, lifted: Lifted, output_path: Path | None, copy_unchanged: bool,
               form: DataForm, clock: StageClock) -> PatchReport:
    """Nothing to rewrite: nothing written unless `copy_unchanged` (then an exact copy of the input)."""
    model_path, weights = Path(report.model), lifted.weights
    report.webgpu = lifted.kernels(patched=False)
    nothing = f"nothing to rewrite in {model_path}" + (
        f" ({len(report.refused)} node(s) refused: see their reasons)" if report.refused else "")
    report.note = "; ".join(x for x in (nothing, report.note) if x)
    if output_path is not None and copy_unchanged:
        if weights.external or report.weights["external_data"] or form.choice == "always":
            clock.enter("write")  # its data must move beside the copy (same tensors, re-pointed), or out of it
            written = save_model_atomic(lifted.model, output_path, weights=weights, form=form)
        else:  # (the copy's size as one file is the input's: "auto" decided by it)
            copy_atomic(model_path, output_path, check=weights.check_unchanged, inputs=weights.inputs.values())
            written = Written(None, os.path.getsize(output_path))
        report.written = True
        _data_written(report, written, weights, form)
        report.note += f"; wrote an unchanged copy to {output_path}"
    elif output_path is not None:
        report.note += "; no output written (--copy-unchanged writes an unchanged copy)"
    if not report.written:  # what a page would be given is the input, as it is
        report.weights = _weights_form(model_path, None, weights, DataForm(), as_is=True)
    return report


# what a model kept aside (`_Writing._aside`) is for, in the words TMPDIR's line names it by (base/scratch.py)
_KEPT_ASIDE = {"float16": "the model kept aside for the float16 proofs",
               "undo": "the model kept aside for the search of the rewrite at fault"}


class _Unshown(Exception):
    """Why a check did not show the rewrites not exact by construction exact, from the check to the undo:
    `undo`, the rewrites shown wrong and why (a float16 proof's difference); or `level` and `candidates`, the
    whole-model check that differed and the rewrites it checked (`_Writing.culprits` then finds which)."""

    def __init__(self, text: str, *, undo: dict[str, Refuse] | None = None, level: str = "all",
                 candidates: list[str] | None = None, options: dict | None = None) -> None:
        super().__init__(text)
        self.text, self.undo, self.level, self.candidates = text, undo or {}, level, candidates or []
        self.options = options or {}  # the comparison that differed (`verify`'s keywords): what the search asks


@dataclass
class _Writing:
    """The last stages of `patch`: write OUT while its checks run on the written file, and when a check shows a
    rewrite not exact, undo that rewrite only and write again.

    The checks, in order: each float16 rewrite's own proof (`_prove_float16`: on the nodes around it, held to the
    roundings ORT CPU chooses in the original and in the patched model); then, for the rewrites still not shown
    exact (and all with `verify`), the whole patched model against the original on ORT CPU at the levels they ask.
    A float16 proof that disproves a rewrite names it; a whole-model check that differs names only the level, and
    `culprits` finds the rewrite(s) that make the difference by a search over them, as `bisect` searches over
    prefixes of a model. The file takes OUT's place only after every check passed."""

    model_path: Path
    output_path: Path
    options: Options
    plan: RunState
    report: PatchReport
    lifted: Lifted
    memory: str
    verify: bool
    verify_options: dict
    form: DataForm
    strict: bool
    clock: StageClock
    undone: dict[str, Refuse] = dataclasses.field(default_factory=dict)

    def run(self) -> PatchReport:
        while True:
            self.clock.enter("write")
            patched, region = self.lifted.patched()
            check = self._check if self.verify or self._unproven() else None
            try:
                written = self._write(patched, region, check)
            except VerificationError as exc:
                cause = exc.__cause__
                if not isinstance(cause, _Unshown):
                    raise
                self.clock.enter("undo")
                found = cause.undo or self.culprits(cause)
                if not found:  # the model differs without the rewrites checked: not theirs to undo
                    raise
                self._undo(found)
                if self.strict and self.report.findings:  # the rewrites undone are refused now
                    _strict_note(self.report)
                    return self.report
                continue
            self.report.written = True
            _data_written(self.report, written, self.lifted.weights, self.form)
            return self.report

    def _unproven(self) -> list:
        return [a for a in self.report.actions if a.needs_verify and a.action == Outcome.REWRITTEN]

    def _write(self, patched: onnx.ModelProto, region: onnx.ModelProto,
               check: Callable[[Path], None] | None) -> Written:
        """Write `patched` while its spliced graph is checked on a second core; the file takes OUT's place only
        after that and `check(tmp)` passed. Returns what was written."""
        weights = self.lifted.weights
        checking = Background(check_spliced, patched, region, self.output_path, weights)
        try:
            return save_model_atomic(patched, self.output_path, verify=check, weights=weights,
                                     check=checking.result, form=self.form)
        finally:
            checking.close()

    def _check(self, tmp: Path) -> None:
        self.clock.enter("verify")
        float16 = [a for a in self._unproven() if a.details.get("float16")]
        if float16:
            self._prove_float16(float16, tmp)
        unproven = self._unproven()
        runs = self._runs(unproven)
        for kwargs in runs:
            result = self._compare(tmp, kwargs)
            if kwargs is runs[0]:  # the comparison the user asked for (the others only show rewrites exact)
                # (of the file that takes OUT's place: the report names OUT, not its temporary name)
                self.report.verification = dataclasses.replace(result, patched=str(self.output_path)) \
                    if self.verify else None
            if not result.identical:
                self.lifted.weights.check_unchanged()
                found = result.mismatch.text() if result.mismatch else "outputs differ"
                raise VerificationError(self.output_path, "patched model differs from the original, not written: "
                                        f"{found}") from (_Unshown(found, level=result.opt_level, candidates=[
                                            a.node for a in unproven], options=kwargs) if unproven else None)
        if unproven:
            checked = "; ".join(f"level '{r.get('opt_level') or 'all'}', "
                                f"{r.get('iterations') or DEFAULT_ITERATIONS} input(s), {_threads_said(r)}"
                                for r in runs)
            self._mark({a.node for a in unproven}, f"verified byte-identical before writing ({checked})",
                       {"shown_exact": "whole_model", "levels": [r.get("opt_level") or "all" for r in runs],
                        "threads": sorted({t for r in runs for t in _thread_list(r)})})

    def _runs(self, unproven: list) -> list[dict]:
        """The comparisons of the whole model: the user's (`verify`), and for the rewrites not shown exact, as many
        inputs as `verify` compares by default (one input can round a float16 difference away) at ORT's default
        level and at each level a rewrite asks for (a float16 rewrite: both), each at the thread counts that split
        those rewrites' kernels differently (`_threads`)."""
        runs = [self.verify_options] if self.verify else [self._unshown({**self.verify_options})] if unproven \
            else []
        if not unproven:
            return runs
        asked = [lvl for a in unproven for lvl in a.details.get("verify_levels", ())]
        segmented = runs[0].get("segment_memory") is not None
        # (runs in segments are at level disable: the whole model at ORT's default level was not asked for then,
        # and a level a rewrite asks for is run whole)
        for level in dict.fromkeys([*([] if segmented else ["all"]), *asked]):
            extra = self._at(level)
            if not any(_covers(r, extra) for r in runs):  # (the user's own may: same level, inputs and counts)
                runs.append(extra)
        return runs

    def _at(self, level: str) -> dict:
        extra = self._unshown({**self.verify_options, "opt_level": level})
        if level != SEGMENT_LEVEL:
            extra.pop("segment_memory", None)
        return extra

    def _unshown(self, options: dict) -> dict:
        """`options` for a comparison that decides the rewrites not shown exact on their own: at least `verify`'s
        default inputs, and the thread counts their kernels can differ at (`unshown_threads`) where the user named
        none."""
        options["iterations"] = max(options.get("iterations") or DEFAULT_ITERATIONS, DEFAULT_ITERATIONS)
        if options.get("threads") is None:
            options["threads"] = list(unshown_threads([self.plan.proofs.get(a.node) for a in self._unproven()]))
        return options

    def _compare(self, path: Path, kwargs: dict):
        step(f"the whole model against the original on ORT CPU, level '{kwargs.get('opt_level') or 'all'}'"
             + (f", in segments of {kwargs['segment_memory']}" if kwargs.get("segment_memory") else ""))
        try:
            return verify_models(self.model_path, path, **kwargs, input_shapes=self.options.input_shapes)
        except VerificationError:
            raise
        except SurgeonError as exc:
            self.lifted.weights.check_unchanged()  # an input changed under the comparison: the problem to name
            if exc.path != str(path):  # the original (or an option) is at fault: bad input
                raise
            problem = f"the patched model {exc.problem}, where the original runs; not written"
            unproven = self._unproven()
            raise VerificationError(self.output_path, problem) from (
                _Unshown(f"it could not be run: {exc.problem}", level=kwargs.get("opt_level") or "all",
                         candidates=[a.node for a in unproven], options=kwargs) if unproven else None)

    def _prove_float16(self, actions: list, tmp: Path) -> None:
        """The float16 rewrites' proofs (proofs/float16_proof.py): each connected group of the nodes they changed,
        between the model without them and the written file, held to ORT CPU's graphs of both. A group shown exact
        marks its rewrites so, one that differs is raised (its rewrites undone), and one whose proof cannot stand
        for the model leaves its rewrites to the whole-model check."""
        from ..proofs.float16_proof import ModelView, Unshown, groups, verdict
        from ..proofs.local_proof import LEVELS
        from ..proofs.precision import file_roundings

        shown, disproved, left, starts, counts = set(), {}, {}, {}, {}
        rows = {x: r for by_conv in self.plan.rows.values() for x, r in by_conv.items()}  # (the written lift's)
        step(f"the model without the {len(actions)} float16 rewrite(s), for their proofs")
        with self._aside([a.node for a in actions], "float16") as before_path:
            step("ORT CPU's graphs of it and of the written file, at each level")
            read = file_roundings([(before_path, level) for level in LEVELS] + [(tmp, level) for level in LEVELS],
                                  "ORT CPU's graphs of the models they compare")
            roundings = {(path == tmp, level): r for (path, level), r in read.items()}
            before, after = ModelView(before_path), ModelView(tmp)
            found = groups(before, after)
            for k, group in enumerate(found, 1):
                covered = [a.node for a in actions if group.made & set(a.new_nodes)]
                if not covered:
                    continue
                step(f"float16 proof {k} of {len(found)}: {len(covered)} rewrite(s), {len(group.whole)} node(s) "
                     f"replaced by {len(group.parts)}")
                proof = verdict(group, before, after, lambda patched, level: roundings[(patched, level)],
                                self.lifted.ctx.ort_cpu, rows)
                why = proof.why
                if why is None:
                    shown.update(covered)
                    starts.update(dict.fromkeys(covered, list(proof.starts_at)))
                    counts.update({n: sorted({*counts.get(n, ()), *proof.threads}) for n in covered})
                elif isinstance(why, Unshown):
                    left.update(dict.fromkeys(covered, str(why)))
                else:
                    disproved.update({node: why.prefixed("not shown exact: ", undone="on_its_own",
                                                         together=sorted(covered),
                                                         **({"proof_starts_at": list(proof.starts_at)}
                                                            if proof.starts_at else {})) for node in covered})
            del before, after
        shown -= set(left) | set(disproved)  # (a rewrite in two groups: each must show it)
        if disproved:
            raise VerificationError(self.output_path, f"{len(disproved)} float16 rewrite(s) not shown exact on "
                                    "their own") from _Unshown("a float16 proof differs", undo=disproved)
        levels = " and ".join(f"'{x}'" for x in LEVELS)
        self._mark(shown, "shown exact before writing, on its own: the nodes it changed (with the rewrites they "
                          "touch), beside the nodes they replaced, with their readers and the producers ORT CPU "
                          f"rounds their inputs by, on ORT CPU at levels {levels} and every intra-op thread count "
                          "(one count of each class that splits their Convs and GEMMs alike; seeded inputs of the real "
                          "shapes), where ORT CPU runs them as in the model without it and in the written file "
                          "(read from its graphs)", {"shown_exact": "on_its_own", "levels": list(LEVELS)})
        self.report.actions = [dataclasses.replace(a, reason=f"{a.reason}; its split Conv's proof starts at the "
                                                   f"Conv's input ({', '.join(starts[a.node])}): the nodes before it "
                                                   "compute each element in the chunks as in the whole block "
                                                   "(ORT CPU's graphs of both round it alike)",
                                                   details={**a.details, "proof_starts_at": starts[a.node]})
                               if starts.get(a.node) and a.node in shown else a for a in self.report.actions]
        self.report.actions = [dataclasses.replace(a, details={**a.details, "not_shown_on_its_own": left[a.node]})
                               if a.node in left and a.needs_verify else a for a in self.report.actions]
        self.report.actions = [dataclasses.replace(a, details={**a.details, "threads": counts[a.node]})
                               if a.node in shown and a.node in counts else a for a in self.report.actions]

    def _mark(self, nodes: set[str], how: str, details: dict) -> None:
        self.report.actions = [dataclasses.replace(a, needs_verify=False, reason=f"{a.reason}: {how}",
                                                   details={**a.details, **details})
                               if a.node in nodes and a.needs_verify else a for a in self.report.actions]

    def culprits(self, cause: _Unshown) -> dict[str, Refuse]:
        """The rewrites among `cause.candidates` that make the whole model differ, asked with the comparison that
        differed (`cause.options`: every input, level and thread count it ran): a search over prefixes of them
        (the model with a prefix applied and the rest undone), one rewrite found per binary search, each blamed
        with the difference measured with it applied and gone with it alone undone; {} when the model differs
        with all of them undone. A rewrite is kept unless a search shows it so."""
        rest, options = list(cause.candidates), cause.options or self._at(cause.level)
        if self._differs(rest, options) is not None:
            return {}
        bad: dict[str, Refuse] = {}
        while rest and (text := self._differs(list(bad), options)) is not None:
            lo, hi = 0, len(rest)  # rest[:lo] applied: identical; rest[:hi] applied (`bad` undone): differs (`text`)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                found = self._differs([*bad, *rest[mid:]], options)
                if found is None:
                    lo = mid
                else:
                    hi, text = mid, found
            bad[rest.pop(hi - 1)] = self._blame(len(cause.candidates), options, text)
        return bad

    @staticmethod
    def _blame(searched: int, options: dict, text: str) -> Refuse:
        level = options.get("opt_level") or "all"
        return Refuse(f"not shown exact on the whole model: with it the whole patched model was checked on ORT CPU "
                      f"and it differed from the original ({text}, opt level '{level}'), and with it alone undone it "
                      f"did not; found by a search over the {searched} rewrite(s) the check covered, with every "
                      "input and thread count the check ran, the others kept", undone="whole_model", level=level,
                      difference=text, threads=_thread_list(options))

    def _differs(self, undo: list[str], options: dict) -> str | None:
        """The whole model's first difference from the original under `options` (the comparison that failed) with
        `undo` kept whole and every other rewrite applied; None when byte-identical."""
        step(f"the search: {len(undo)} rewrite(s) kept whole")
        with self._aside(undo, "undo") as path:
            result = self._compare(path, options)
        return None if result.identical else (result.mismatch.text() if result.mismatch else "outputs differ")

    @contextmanager
    def _aside(self, undo: list[str], what: str) -> Iterator[Path]:
        """The patched model with `undo` kept whole, written to a `scratch` folder (removed after), the plan as it
        was after: what the undo search compares, and what a float16 proof's whole side is held to."""
        saved = self.plan.snapshot()
        self.plan.keep_whole.update({n: Refuse("kept whole aside") for n in undo})
        try:
            lifted, _ = _lift(self.model_path, self.options, self.plan, rounds=0)
            patched, _ = lifted.patched()
            with scratch(f"deform-surgeon-{what}-", _KEPT_ASIDE[what]) as folder:
                path = folder / self.output_path.name
                save_model_atomic(patched, path, weights=lifted.weights, form=self.form)
                del lifted, patched
                yield path
        finally:
            self.plan.restore(saved)

    def _undo(self, found: dict[str, Refuse]) -> None:
        """Keep `found` whole, lift again and prove again (keeping a node whole changes its neighbours' context)."""
        self.undone.update(found)
        self.plan.keep_whole.update(found)
        self.report.verification = None
        lifted, memory = _lift(self.model_path, self.options, self.plan, rounds=0)
        self.lifted, self.memory = _prove_locally(self.model_path, self.options, self.plan, lifted, memory)
        patched, _ = self.lifted.patched()
        self.report.actions, self.report.ops_after = self.lifted.actions, op_histogram(patched)
        self.report.webgpu = self.lifted.kernels(patched=True)
        kinds = Counter(a.pass_name for a in self.report.actions if a.node in self.undone)
        _annotate(self.report, self.lifted, f"{len(self.undone)} rewrite(s) undone ("
                  + ", ".join(f"{c} {k}" for k, c in sorted(kinds.items())) + "): not shown exact (see their lines); "
                  "the others written", self.memory)


def _covers(run: dict, needed: dict) -> bool:
    """Whether the comparison `run` asks at least what `needed` asks: its level, as many inputs, every thread
    count of it (ORT's default count stands only for itself)."""
    def level(r: dict) -> str:
        return level_of(r.get("opt_level"), r.get("segment_memory"))

    def inputs(r: dict) -> int:
        return r.get("iterations") or DEFAULT_ITERATIONS

    counts, wanted = set(_thread_list(run)), set(_thread_list(needed))
    return level(run) == level(needed) and inputs(run) >= inputs(needed) and (
        wanted <= counts if wanted else not counts)


def _every_count(counts: tuple[int, ...]) -> str:
    """How a proof run at `counts` covers every intra-op thread count (docs/runtime-facts.md, "Threads")."""
    said = ", ".join(map(str, counts))
    return (f"at every intra-op thread count (run at {said}: one count of each class that splits its Convs and "
            "GEMMs alike)")


def _thread_list(options: dict) -> list[int]:
    threads = options.get("threads")
    return [] if threads is None else [threads] if isinstance(threads, int) else list(threads)


def _threads_said(options: dict) -> str:
    """"intra-op threads 1, 2, 5" (or "ORT's default intra-op threads"): a comparison's thread counts, as said."""
    counts = _thread_list(options)
    return f"intra-op threads {', '.join(map(str, counts))}" if counts else "ORT's default intra-op threads"


def _prove_locally(model_path: str | Path, options: Options, plan: RunState, lifted: Lifted, memory: str,
                   rounds: int = 3) -> tuple[Lifted, str]:
    """Show each rewrite that is not exact by construction exact on its own (proofs/local_proof.py): the nodes
    it replaced and the nodes it made, each with the nodes reading them, on ORT CPU at the real shapes. One that
    is not shown exact is kept whole (`plan.keep_whole`) and the model lifted again, and the proofs run again
    (keeping a node whole changes its neighbours' context). A rewrite without a proof is left to the whole-model
    check `patch` runs before writing."""
    from ..proofs.local_proof import LEVELS, refusal

    undone = 0
    for _ in range(rounds):
        unproven = [a for a in lifted.actions if a.needs_verify and a.action == Outcome.REWRITTEN
                    and a.node in plan.proofs]
        if not unproven:
            break
        outside = _outside_readers(lifted)
        constant = _outside_constants(lifted)
        failed = {}
        for k, a in enumerate(unproven, 1):
            step(f"local proof {k} of {len(unproven)}: {a.pass_name} '{a.node}'")
            if (why := refusal(lifted.ctx, plan.proofs[a.node], outside, constant)) is not None:
                failed[a.node] = why
        if not failed:
            levels = " and ".join(f"'{x}'" for x in LEVELS)
            lifted.actions = [dataclasses.replace(a, needs_verify=False, reason=(
                f"{a.reason}: shown exact before writing, on its own: beside the nodes it replaced, with the nodes "
                f"reading it, on ORT CPU at levels {levels}, {_every_count(plan.proofs[a.node].threads)} (seeded "
                "inputs of the real shapes)"), details={**a.details, "shown_exact": "on_its_own",
                                                        "levels": list(LEVELS),
                                                        "threads": list(plan.proofs[a.node].threads)})
                if a in unproven else a for a in lifted.actions]
            break
        plan.keep_whole.update({node: why.prefixed("not shown exact: ", undone="on_its_own")
                                for node, why in failed.items()})
        undone += len(failed)
        lifted, memory = _lift(model_path, options, plan)
    if undone:
        memory = "; ".join(x for x in (f"{undone} rewrite(s) undone: not shown exact on their own (see their "
                                       "lines)", memory) if x)
    return lifted, memory


def _outside_constants(lifted: Lifted, limit: int = 32):
    """name -> its value when the model computes it from stored tensors and Constant nodes only, in at most
    `limit` nodes (what ORT's constant folding makes an initializer before it fuses), else None."""
    from ..base.ort_cpu import run_ort_cpu

    graph = lifted.model.graph
    producer = {o: n for n in graph.node for o in n.output}
    initializers = {t.name: t for t in graph.initializer}
    memo: dict[str, np.ndarray | None] = {}

    def stored(name: str) -> np.ndarray:
        if name in lifted.weights.tensors:
            return lifted.weights.read(name)
        return onnx.numpy_helper.to_array(initializers[name])

    def value(name: str) -> np.ndarray | None:
        if name in memo:
            return memo[name]
        memo[name] = None
        if name in lifted.weights.tensors or name in initializers:
            memo[name] = stored(name)
            return memo[name]
        nodes, stack, leaves = {}, [name], set()
        while stack:
            t = stack.pop()
            if not t or t in lifted.weights.tensors or t in initializers:
                leaves.add(t)
                continue
            n = producer.get(t)
            if n is None or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for a in n.attribute):
                return None
            if id(n) not in nodes:
                nodes[id(n)] = n
                if len(nodes) > limit:
                    return None
                stack.extend(n.input)
        order = {id(n): k for k, n in enumerate(graph.node)}
        inits = [onnx.numpy_helper.from_array(np.asarray(stored(t)), t) for t in leaves if t]
        try:
            typ = lifted.ctx.types[name]
            model = onnx.helper.make_model(onnx.helper.make_graph(
                sorted(nodes.values(), key=lambda n: order[id(n)]), "fold", [],
                [onnx.helper.make_tensor_value_info(name, typ[0], None)], inits),
                opset_imports=lifted.model.opset_import)
            memo[name] = run_ort_cpu(model, {}, "disable", threads=1, quiet=True)[0]
        except Exception:  # noqa: BLE001 (not computable here: the proof treats it as a value)
            memo[name] = None
        return memo[name]

    return value


def _outside_readers(lifted: Lifted):
    """name -> the nodes outside the lifted region reading that tensor, as NodeSpecs with their facts."""
    from ..proofs.local_proof import Facts, NodeSpec

    graph = lifted.model.graph
    inside = set(lifted.region.nodes)
    index: dict[str, list[int]] = {}
    for k, node in enumerate(graph.node):
        if k not in inside:
            for name in node.input:
                index.setdefault(name, []).append(k)
    made_by_constant = {o: k for k, n in enumerate(graph.node) if n.op_type == "Constant" for o in n.output}
    types = lifted.ctx.types

    def readers(name: str) -> list:
        out = []
        for k in index.get(name, []):
            node, facts = graph.node[k], Facts()
            for t in [*node.input, *node.output]:
                if not t or t in facts.types:
                    continue
                try:
                    elem, shape = types[t]
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
                except Exception:  # noqa: BLE001 (no type known: the proof says so)
                    elem, shape, dtype = 0, None, None
                facts.types[t] = (np.dtype(dtype), tuple(shape)) if dtype is not None and shape and all(
                    isinstance(d, int) for d in shape) else None
                value = None
                if t in lifted.weights.tensors:
                    value = lifted.weights.read(t)
                elif t in made_by_constant:
                    c = graph.node[made_by_constant[t]]
                    value = next((onnx.numpy_helper.to_array(a.t) for a in c.attribute if a.name == "value"), None)
                facts.constants[t] = value
            out.append((NodeSpec.of(node), facts))
        return out

    return readers


def _annotate(report: PatchReport, lifted: Lifted, *lines: str) -> None:
    """The report's note (`lines`, the --max-memory line among them, then what stays over the device profile and the
    symbolic-dims line) and its `stays_over`, from the same lift: the status (`PatchReport.status`, a tensor over
    the profile is a finding) and the note that names those tensors never tell two lifts apart."""
    left = _stays_over(lifted)
    report.stays_over = [o for _, o, _, _ in left]
    report.note = "; ".join(x for x in (*lines, _over_profile_note(lifted, left), _symbolic_note(lifted)) if x)


def _strict_note(report: PatchReport) -> None:
    """`--strict` and a finding: what was found, that nothing is written, then the rest of the note (the tensors
    over the profile are named only there)."""
    report.note = "; ".join(x for x in (f"--strict: {report.findings}; {report.output} not written", report.note)
                            if x)


def _stays_over(lifted: Lifted) -> list[tuple[int, str, onnx.NodeProto, bool]]:
    """The original model's tensors over the profile's buffer size that the patched model still makes, largest
    first, as (bytes, name, producer, size unknown), those of a size shape inference does not know included where
    they are over it even at their smallest (`_over_limit`). Why: the passes fit deform blocks, decoder Convs and
    Resizes, token-major MatMul chains and wide nodes, each where its shapes are known; anything else is left as it
    is, and a plain `patch`, which fits the profile by default, must say so (and exit as for a refused node, see
    `PatchReport.status`) rather than let the user find it out when the GPU refuses the buffer."""
    over, smallest = lifted.oversize, lifted.over_at_smallest
    if not over and not smallest:
        return []
    whole, _ = lifted.patched()
    return sorted((((elem_nbytes(*lifted.types[o]) or 0) if o in over else smallest[o], o, n, o in smallest)
                   for n in whole.graph.node for o in n.output if o in over or o in smallest),
                  key=lambda x: (-x[0], x[1]))


def _over_profile_note(lifted: Lifted, left: list[tuple[int, str, onnx.NodeProto, bool]]) -> str:
    """The note naming what `_stays_over` found ("" when nothing)."""
    if not left:
        return ""
    ops = Counter(n.op_type for _, _, n, _ in left).most_common()
    limit = lifted.ctx.options.max_buffer
    named = ", ".join(f"'{o}' {'at least ' if unknown else ''}{human(size)} from {n.op_type} '{n.name}'"
                      for size, o, n, unknown in left[:3])
    unknown = sum(u for *_, u in left)
    some = (f"; {unknown} of them with a dim shape inference leaves symbolic, over it even where that dim is 1, "
            "which no pass can compute in parts" if unknown else "")
    return (f"STAYS OVER the device profile: {len(left)} tensor(s) over {human(limit)} (made by "
            f"{', '.join(f'{op} {c}' for op, c in ops)}; largest {named}{', ...' if len(left) > 3 else ''}{some}): "
            "no pass computes them in parts (`deform-surgeon budget MODEL` lists every tensor of known size over a "
            "profile)")


def _symbolic_note(lifted: Lifted) -> str:
    """For a model with symbolic input dims patched as it is: for which sizes its deform blocks were proven, and
    what stays on the CPU ("" when every input dim is a number)."""
    symbolic = symbolic_inputs(lifted.model)
    if not symbolic:
        return ""
    sampled = sorted({str(list(lifted.types[n.input[0]][1])) for n in lifted.model.graph.node
                      if n.op_type in ("GatherND", "GatherElements") and n.input[0] in lifted.types
                      and lifted.types[n.input[0]][1] is not None})
    proven = (f"the deform blocks were proven for the sizes the export baked in (sampled data shapes "
              f"{', '.join(sampled[:4])}{', ...' if len(sampled) > 4 else ''}), not for other input sizes"
              if sampled else "no deform block has a static sampled shape")
    return (f"symbolic input dims ({'; '.join(symbolic)}): {proven}; the shape computations on the symbolic dims "
            "stay on the CPU EP; give --input-shape NAME:DIMS to patch for the size the model will get")


def _weights_form(model_path: Path, output_path: Path | None, weights: Weights, form: DataForm,
                  as_is: bool = False) -> dict:
    """Where the output's weights go and why, and what would keep a browser page from loading it, before anything
    is written (or, with no output or `as_is`, the input as it is), the input's size standing for the output's:
    the report's `weights` until `_data_written` puts what was written in its place."""
    size = sum(os.path.getsize(p) for p in [model_path, *sorted(weights.sources())])
    target = output_path or model_path
    external = weights.external if as_is else weights_external(form.choice, weights.external, size)
    data = form.data_path(target, weights.named_sources()).name if external else None
    return {"external_data": data, "why": _why(external, weights.external, form.choice, size),
            "browser_problem": None if external else single_file_problem(target.name, size)}


def _why(external: bool, input_external: bool, choice: str, size: int | None) -> str:
    """Why the output's weights are (or are not) in a data file: the report's `weights.why`."""
    if choice != "auto":
        return f"--external-data {choice}"
    if external and not input_external:
        return f"one file of {(size or 0) / 2**20:,.0f} MiB would not load in a browser page"
    return "as the input's"


def _data_written(report: PatchReport, written: Written, weights: Weights, form: DataForm) -> None:
    """The report's weights form as written (`Written`): the data file's name where one was written, and the
    output's own size as one file for the 512 MiB rule's reason and warning (the input's size said "one file of
    2,289 MiB" of a 510 KB output); none where the model had no stored tensor to put there (`--external-data
    always` of such a model named a file that did not exist)."""
    name = Path(report.output or report.model).name
    external = written.data is not None
    why = _why(external, weights.external, form.choice, written.one_file_size)
    if not external and (form.choice == "always" or (form.choice == "auto" and weights.external)):
        why += ", but it has no stored tensor to put in a data file: written as one file"
    problem = None if external or written.one_file_size is None else single_file_problem(name, written.one_file_size)
    report.weights = {"external_data": written.data.name if external else None, "why": why,
                      "browser_problem": problem}


def _switches(**flags: object) -> None:
    """On/off options must be booleans: a string such as "no" or "false" is true to Python, and
    `allow_unproven="no"` would rewrite unproven gathers."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise SurgeonError(None, f"{name} must be True or False (got {value!r})")


def _size(name: str, value: int | str | None) -> int | None:
    """A size option as the CLI and batch manifests take it: bytes or a string such as "256MiB" or "1.5GB"."""
    from ..graph.budget import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except SurgeonError as exc:
        raise SurgeonError(None, f"{name}: {exc.problem}", exc.hint) from None


def _options(allow_unproven: bool, sum_mode: str | None, max_buffer: int | str | None = None,
             max_memory: int | str | None = None, device_profile: str | Path | DeviceProfile | None = None,
             input_shapes: dict | None = None, skip_passes: list[str] | tuple[str, ...] | None = None) -> Options:
    """The rewrite options of `patch` and `inspect`, checked before any work (one-line `SurgeonError`s)."""
    _switches(allow_unproven=allow_unproven)
    sum_mode = "chain" if sum_mode is None else sum_mode
    if not isinstance(sum_mode, str) or sum_mode not in SUM_MODES:
        raise SurgeonError(None, f"unknown sum mode {sum_mode!r}", f"choose one of {', '.join(SUM_MODES)}")
    max_buffer, max_memory = _size("max_buffer", max_buffer), _size("max_memory", max_memory)
    profile = resolve_profile(device_profile)
    if max_buffer is None:  # fit the profile: no tensor over what one binding may hold, nor over one buffer
        max_buffer = min(profile.max_binding, profile.max_buffer)
    return Options(allow_unproven=allow_unproven, sum_mode=sum_mode, max_buffer=max_buffer, max_memory=max_memory,
                   device_profile=profile.name, storage_buffers=profile.storage_buffers,
                   input_shapes=check_input_shapes(input_shapes),
                   skip_passes=check_pass_names(skip_passes, "skip_passes"))
