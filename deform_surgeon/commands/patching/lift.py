"""The first stage of a patch run: the model loaded, checked, its static float16 computations folded, its deform
regions lifted into an onnx-graphsurgeon graph and the passes run on it (`lift_model`, once), and with
`--max-memory` lifted again with more chunks until the peak of live tensors fits (`lift_within_memory`).

Weights are never copied: checker and shape inference see the model's skeleton, on a second core while the deform
regions are found (base/background.py); only the deform regions are lifted into a graph (graph/region.py), stored
tensors as its typed inputs, read through `Weights.read` (files/weights.py)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from ...base.background import Background
from ...base.scratch import TmpdirFull
from ...files import TypeTable, Weights, checked_types, elem_nbytes, export_graph, load_model, tidy
from ...graph.budget import BudgetReport, write_in_execution_order
from ...graph.device import WASM
from ...graph.fold import fold_static, has_reduced_floats
from ...graph.input_shapes import fix_input_shapes, impossible_reshape
from ...graph.kernels import KernelReport, kernel_report
from ...graph.ops import op_histogram
from ...graph.pipeline import Action, Context, Options, Outcome, run_passes
from ...graph.region import Region, find_region, region_model, splice, type_boundary
from ...passes.bands import BandOversize
from ...passes.float16_slices import split_to_slices
from ...passes.registry import make_passes
from ...passes.run_state import RunState
from ...passes.split import SplitBlocks
from ...passes.unfold import PASS as UNFOLD
from ...passes.unfold import stored_by_ort, unfold_large_broadcasts

CHUNKING = (SplitBlocks.name, BandOversize.name)  # passes that make parallel chunks of one computation


@dataclass
class Lifted:
    """One lift of a model: the model as loaded (and folded), its rewritten region, the passes' actions."""

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
    over_at_smallest: dict[str, int] = dataclasses.field(default_factory=dict)  # see over_limit
    _patched: tuple[onnx.ModelProto, onnx.ModelProto] | None = None

    def patched(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """The whole model with the rewritten region spliced in (`model` itself: its weights are never copied), and
        the rewritten region on its own (what `check_spliced` infers)."""
        if self._patched is None:
            region = export_graph(tidy(self.graph), self.sub)
            whole = splice(self.model, self.region, region, self.weights)
            if any(a.pass_name in CHUNKING and a.action == Outcome.REWRITTEN for a in self.actions):
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


@contextmanager
def fewer_gc_passes() -> Iterator[None]:
    """Lifting a region creates tens of thousands of small objects (graph-surgeon nodes and tensors) that all
    live until the patch is written; with the default gen-0 threshold (700) the cyclic collector walks them over
    and over (measured: ~0.05 s of a 1.7 s patch of a 19,000-node model)."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def lift_model(model_path: str | Path, options: Options, state: RunState | None = None) -> Lifted:
    """Load, check, fold what is static, lift the deform regions and run the passes on them, once (see the module
    docstring); the static float16 computations are folded and float16 Splits become Slices on the whole model
    (fold.py, float16_slices.py). The passes follow `state` and record in it."""
    model, weights = load_model(model_path)
    fixed = fix_input_shapes(model, options.input_shapes, model_path) if options.input_shapes else []
    checking = Background(checked_types, model, model_path, weights)
    reduced = has_reduced_floats(model)
    stored = StoredByOrt(model_path) if options.device_profile == WASM and not (reduced or fixed) else None
    try:
        ops_before = op_histogram(model)
        early = None
        if not reduced:  # nothing to fold: lift while checking, assuming nothing is over the buffer limit
            try:
                early = graph_of_region(model, find_region(model, options.storage_buffers, set(), weights))
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
    if stored is not None:  # in place: new nodes, so the region is found again
        unfolded = stored.unfold(model, types)
        early = None if any(a.action is Outcome.REWRITTEN for a in unfolded) else early
        whole += unfolded
    elif options.device_profile == WASM and fixed and not reduced:
        whole.append(Action(UNFOLD, "(the model)", "-", Outcome.REFUSED, "not asked: ORT reads the file, whose input "
                            "dims --input-shapes fixed only in memory; patch a file with fixed dims for the wasm heap"))
    oversize, over_at_smallest = over_limit(types, options.max_buffer)
    if oversize:  # the region grows by the nodes that make or read them: the early lift does not hold them
        early = None
    region, sub, graph = early or graph_of_region(model, find_region(model, options.storage_buffers, oversize,
                                                                     weights))
    type_boundary(graph, types)
    ctx = Context(graph, types, options, reserved=region.names, stored=weights,
                  made_by_ort=made_by_ort(model_path) if reduced and oversize else None)
    if state is not None:
        state.start_lift()
    actions = whole + run_passes(ctx, make_passes(state, options.skip_passes))
    return Lifted(model, weights, region, sub, graph, actions, ops_before, types, ctx, oversize, over_at_smallest)


class StoredByOrt:
    """What ORT CPU stores when it folds a file (passes/unfold.py), asked on a second core while the model is
    checked, once per file version (`--max-memory` lifts a model again)."""

    _known: dict[tuple, dict[str, tuple[int, ...]] | str] = {}  # one file version: its answer, or why none

    def __init__(self, model_path: str | Path) -> None:
        stat = Path(model_path).stat()
        self.key = (str(Path(model_path).resolve()), stat.st_mtime_ns, stat.st_size)
        self.job = None if self.key in self._known else Background(stored_by_ort, model_path)

    def unfold(self, model: onnx.ModelProto, types: TypeTable) -> list[Action]:
        if self.job is not None:
            try:
                answer: dict[str, tuple[int, ...]] | str = self.job.result()
            except TmpdirFull:
                raise
            except Exception as exc:  # onnxruntime's own errors: said in the report, where verify gives its verdict
                answer = f"ORT CPU could not make a session of the file ({str(exc).strip().splitlines()[0][:200]})"
            finally:
                self.job.close()
            StoredByOrt._known = {self.key: answer}
            self.job = None
        answer = self._known[self.key]
        if isinstance(answer, str):
            return [Action(UNFOLD, "(the model)", "-", Outcome.REFUSED, f"not asked: {answer}")]
        return unfold_large_broadcasts(model, types, answer, {t.name for t in model.graph.initializer})


def made_by_ort(model_path: str | Path) -> frozenset[str] | None:
    """passes/cut_and_join.py `made_by_ort`, once per file version (`patch` lifts a model several times); None where ORT
    CPU cannot make a session of the file (the cuts then keep float32 values everywhere, the whole-model check
    decides)."""
    stat = Path(model_path).stat()
    return _made_by_ort_cached(str(Path(model_path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _made_by_ort_cached(path: str, mtime_ns: int, size: int) -> frozenset[str] | None:
    from ...passes.cut_and_join import made_by_ort

    try:
        return made_by_ort(path)
    except TmpdirFull:
        raise
    except Exception:  # onnxruntime's own errors: the model's verdict is given where it is run (verify)
        return None


def graph_of_region(model: onnx.ModelProto, region: Region) -> tuple[Region, onnx.ModelProto, gs.Graph]:
    """`region` of `model` as a model of its own and as the onnx-graphsurgeon graph the passes rewrite."""
    sub = region_model(model, region)
    return region, sub, gs.import_onnx(sub)


def over_limit(types: TypeTable, limit: int | None) -> tuple[set[str], dict[str, int]]:
    """In one walk of the type table (80,000 entries on BiRefNet-lite): the tensors whose inferred static size is
    over `limit` bytes, and those with a dim shape inference leaves symbolic whose size with every such dim taken
    as 1 is already over it, with that size (a tensor with a 0 dim is empty: none is). Neither without a limit.
    Why the second: a Swin block's shifted windows can leave the batch dim of its MLP unknown to ONNX inference
    (`[unk, 65536, 768]`), so the passes do not see it; at its smallest it is over the limit all the same, and the
    report must say so (notes.py, `over_profile_note`)."""
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


def lift_within_memory(lift_once: Callable[[], Lifted], state: RunState, limit: int | None, rounds: int
                       ) -> tuple[Lifted, str]:
    """`lift_once()`, and with a `--max-memory` `limit` more chunks per deform block until budget's peak of live
    tensors of the whole patched model fits; returns the lifted model and a line on the peak for the report (""
    without a limit).

    Why a loop over the whole model: the peak is a property of the whole graph and its execution order (what else
    is live while a block runs), which the split pass, seeing the deform regions only, cannot know. Each round
    asks the block holding most of the peak for as many more chunks as the overshoot needs, if its tensors shrank
    in proportion, until it fits, a round changes nothing, or `rounds` have run.
    """
    from ...graph.budget import analyze

    lifted = lift_once()
    if limit is None:
        return lifted, ""
    before = analyze(lifted.model, weights=lifted.weights).peak_bytes
    best = None
    for k in range(rounds + 1):
        peak = analyze(lifted.patched()[0], weights=lifted.weights)
        if best is None or peak.peak_bytes < best[0].peak_bytes:
            best = (peak, lifted, dict(state.min_chunks))
        if peak.peak_bytes <= limit or k == rounds:
            break
        more = more_chunks(peak, state, limit)
        if not more:
            break
        state.min_chunks.update(more)
        lifted = lift_once()
    peak, lifted, state.min_chunks = best  # more chunks can raise the peak (a Conv kept whole): keep the lowest
    return lifted, _peak_line(peak, before, limit)


def _peak_line(peak: BudgetReport, before: int, limit: int) -> str:
    """The report's line on the peak of live activations with `--max-memory`: before and after, and what holds it
    where it stays over the limit."""
    from ...graph.budget import human

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
    return line


def more_chunks(peak: BudgetReport, state: RunState, limit: int) -> dict[str, int]:
    """Chunks for the deform block holding most of the peak so that, were its live bytes proportional to its rows,
    the peak would fit; {} when no block can help (the rest of the peak alone is over the limit, the block ends in
    no Conv, or it got no more chunks than asked last round)."""
    if not peak.peak_blocks:
        return {}
    label, held = max(peak.peak_blocks.items(), key=lambda kv: kv[1])
    conv = peak.block_convs.get(label)
    rest = peak.peak_bytes - held
    if conv is None or rest >= limit:
        return {}
    have = state.chunks.get(conv, 1)
    if state.min_chunks.get(conv, 1) > have:
        return {}  # asked for more than the block could give (one row per chunk, or refused)
    return {conv: max(have + 1, math.ceil(have * held / (limit - rest)))}
