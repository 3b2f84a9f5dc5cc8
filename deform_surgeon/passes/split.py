"""Split a deformable-conv block into row chunks so that none of its tensors exceeds a GPU buffer limit.

Why: at 1024x1024 the exporter's largest sampling tensor in BiRefNet is `[1, 1, 3211264, 64]` (49 sampling
points x 256 x 256 output pixels x 64 channels, 822 MB in fp32), and every elementwise step after the gather
(transpose, the four bilinear weights, the weighted sum, the mask, the im2col-style reshape) makes another tensor
of that size. A WebGPU buffer larger than the device's `maxBufferSize` (256 MiB by the spec's default) is an
error.

What: every sampling point belongs to exactly one output pixel, so the sampling points split exactly into the
points of output rows `[r0, r1)`. For each chunk of rows the block is rebuilt on its own points:

    index [B, G, K*h*w] --(rows r0..r1 of h)--> [B, G, K*hc*w] --Gather--> [B, G, K*hc*w, C] --Transpose,
    Reshape--> [B, G, C, K, hc, w] --Mul by the weights' rows r0..r1, Add chain, Mul by the mask's rows-->
    --Reshape, Transpose, Reshape--> [B, C, hc*kh, w*kw]                          (one per chunk)
    Concat(chunks, axis=2) = the Conv input [B, C, h*kh, w*kw]      (or, see below: per chunk Conv -> Add ->
                                                                      BatchNorm -> Relu, then Concat)

Exact, by construction: every op carried per chunk is either pure data movement (Gather, Transpose, Reshape,
Concat, Slice) or elementwise (Mul, Add, Sum, Cast, ...), so each element of each chunk is computed by the same
operation from the same operands as in the original, and the Concat puts the elements back where they were.
The gather data itself is never split (a chunk's points may read any row of it).

The Conv: it stays whole, fed by the Concat, while its input fits the limit (then it is exact by construction).
When its input is itself over the limit, the Conv (kernel == stride, so each output row reads its own band of
input rows) is split into the same chunks and the per-channel ops after it (the exporter's bias Add,
BatchNormalization, Relu) are carried per chunk too, so ORT's Conv+Add / Conv+BatchNorm fusions see the same
pattern in every chunk; one Concat joins the small outputs. Whether a Conv kernel sums a pixel's C*kh*kw
products in the same order for fewer output pixels is the implementation's choice (ORT CPU's MLAS picks its K
blocking from the number of output pixels), so that split is made only after a run of the real shapes on ORT
CPU, at graph optimisation levels none and all, gives the whole Conv's bytes; otherwise the Conv input stays
whole and the report says it REMAINS OVER the limit, with the measured difference. That run sees the Conv and its
tail only, while ORT optimises the whole graph (fusions, NCHWc layout): the action is marked `needs_verify`, and
`patch` writes it only after the whole patched model verified byte-identical, keeping the Conv whole otherwise
(`RunState.keep_whole`). On the real BiRefNet-lite export the BatchNorm's parameters are Identity nodes of
initializers torch's exporter shared; the prover reads constants through them, so the tail includes the
BatchNorm and each chunk fuses as the whole did.

Float16 blocks (transformers.js's fp16 and q4f16 files): ORT CPU has no float16 kernel for most of the block's ops
(Mul, Add, Sub, Conv, BatchNormalization, Relu, Pad); it runs them in float32 behind Casts and drops the Casts
between two of them, so most of the block's float16 tensors are float32 values never rounded to float16. An op
the split inserts that has a float16 kernel (Slice, Concat) would round such a value where the whole block does
not (measured: 4.9e-4 on decoder_gathernd_fp16). So in a float16 block the rows of the weights and mask are cut by
Pads with negative pads (no float16 CPU kernel: ORT runs them in float32 like their neighbours), and a join of the
Conv's tail is followed by a Pad with zero pads, so that ORT runs the Concat in float32 too (cut_and_join.py). Where ORT
rounds depends on the graph, not on values, but a local proof of the region cannot show it (its inputs would be
float16 graph inputs, rounded already): the split is `needs_verify` with levels disable and all, written only
once the whole patched model is byte-identical at both, and the block is kept whole otherwise (docs/variants.md).

Chunks for `--max-memory`: `patch` measures the peak of live tensors of the whole patched model (budget) and asks
this pass, through `RunState.min_chunks`, for more chunks of the block holding it; the Conv is then split too,
as its joined input would be as large as what the chunks avoid.

Chunk count: the smallest `n` for which every chunk tensor, with `ceil(h / n)` rows, fits the limit; rows are
spread evenly (chunk sizes differ by at most one row).

The block is found by the one block finder (`blocks.gather_blocks`): from its gathers (`Gather` on flattened
data, as the gathernd / gather_elements passes leave it, or an unlowered `GatherND`), followed forward through
elementwise and data-movement ops to the Conv that consumes it; where the row axis lies in each tensor is derived
backward from the Conv (kernel == stride, no padding along the rows). Anything else (a tensor also used outside
the block, a reshape that cuts the rows apart, a partial broadcast) is refused with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..base.stages import step
from ..graph.blocks import GATHERS, GatherBlock, conv_tail, gather_blocks
from ..graph.budget import human
from ..graph.ops import ELEMENTWISE_NARY, ELEMENTWISE_UNARY, SHAPE_OPS
from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse
from ..graph.shapes import Shapes
from ..proofs.local_proof import proof_threads, record
from .cut_and_join import FLOAT16_NOTE, cut, float16_details, join
from .run_state import RunState


@dataclass(frozen=True)
class Rows:
    """Where the output rows live in a tensor: dim `axis` is `outer * h * inner` in row-major order."""

    axis: int
    outer: int
    inner: int

    def chunk_shape(self, shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
        s = list(shape)
        s[self.axis] = self.outer * rows * self.inner
        return tuple(s)


def reshape_rows(out_shape: tuple[int, ...], rows: Rows, h: int, in_shape: tuple[int, ...]) -> Rows | None:
    """The rows of a reshape's input, given the rows of its output (row-major order is kept by a reshape)."""
    above = math.prod(out_shape[: rows.axis]) * rows.outer
    below = rows.inner * math.prod(out_shape[rows.axis + 1:])
    for b in range(len(in_shape)):
        prefix = math.prod(in_shape[:b])
        if above % prefix:
            continue
        outer = above // prefix
        if in_shape[b] % (outer * h):
            continue
        inner = in_shape[b] // (outer * h)
        if inner * math.prod(in_shape[b + 1:]) == below:
            return Rows(b, outer, inner)
    return None


class RowWalk:
    """Where the output rows live in every tensor of a block, walked back from the Conv's input: one step per
    node (`_op_<family>`, dispatched by op like the prover's), each telling its inputs' rows from its output's.
    A tensor made inside the block gets one row layout (`layout`); one read from outside gets how a chunk slices
    it (`side`, None: read whole)."""

    def __init__(self, block: GatherBlock, shapes: Shapes, layout: dict[str, Rows]) -> None:
        self.block, self.shapes, self.layout = block, shapes, layout
        self.side: dict[tuple[int, int], Rows | None] = {}
        self.produced = {o.name for n in block.nodes for o in n.outputs}

    _STEPS = {**dict.fromkeys(ELEMENTWISE_UNARY, "_op_unary"), **dict.fromkeys(ELEMENTWISE_NARY, "_op_nary"),
              **dict.fromkeys(SHAPE_OPS, "_op_reshape"), "Transpose": "_op_Transpose",
              **dict.fromkeys(GATHERS, "_op_gather")}

    def step(self, k: int) -> None:
        n = self.block.nodes[k]
        if len(n.outputs) != 1 or n.outputs[0].name not in self.layout:
            raise Refuse(f"{n.op} '{n.name}' has outputs that do not lead to the Conv")
        out = n.outputs[0]
        rows, os_ = self.layout[out.name], self.shapes.shape(out)
        if os_ is None:
            raise Refuse(f"shape of '{out.name}' is not known statically")
        method = self._STEPS.get(n.op)
        if method is None:  # pragma: no cover - find_blocks only collects the ops above
            raise Refuse(f"{n.op} '{n.name}' is not carried")
        getattr(self, method)(n, k, rows, os_)

    def assign(self, t: gs.Tensor, rows: Rows | None, k: int, slot: int) -> None:
        if t.name in self.produced:
            if rows is None:
                raise Refuse(f"'{t.name}' is broadcast along the rows inside the block")
            if self.layout.setdefault(t.name, rows) != rows:
                raise Refuse(f"'{t.name}' is read with its rows in two different places")
        else:
            self.side[(k, slot)] = rows

    def _op_unary(self, n: gs.Node, k: int, rows: Rows, os_: tuple[int, ...]) -> None:
        self.assign(n.inputs[0], rows, k, 0)

    def _op_nary(self, n: gs.Node, k: int, rows: Rows, os_: tuple[int, ...]) -> None:
        for slot, t in enumerate(n.inputs):
            s = self.shapes.shape(t)
            if s is None:
                raise Refuse(f"shape of '{t.name}' is not known statically")
            ax = rows.axis - (len(os_) - len(s))
            if ax < 0 or s[ax] == 1:
                self.assign(t, None, k, slot)
            elif s[ax] == os_[rows.axis]:
                self.assign(t, Rows(ax, rows.outer, rows.inner), k, slot)
            else:
                raise Refuse(f"'{t.name}' {list(s)} is partly broadcast against {list(os_)} in {n.op} '{n.name}'")

    def _op_reshape(self, n: gs.Node, k: int, rows: Rows, os_: tuple[int, ...]) -> None:
        s = self.shapes.shape(n.inputs[0])
        got = None if s is None else reshape_rows(os_, rows, self.block.rows, s)
        if got is None:
            raise Refuse(f"{n.op} '{n.name}' cuts the output rows apart ({s} -> {list(os_)})")
        self.assign(n.inputs[0], got, k, 0)

    def _op_Transpose(self, n: gs.Node, k: int, rows: Rows, os_: tuple[int, ...]) -> None:
        perm = n.attrs.get("perm") or list(reversed(range(len(os_))))
        self.assign(n.inputs[0], Rows(int(perm[rows.axis]), rows.outer, rows.inner), k, 0)

    def _op_gather(self, n: gs.Node, k: int, rows: Rows, os_: tuple[int, ...]) -> None:
        data, index = n.inputs[0], n.inputs[1]
        ds, is_ = self.shapes.shape(data), self.shapes.shape(index)
        if ds is None or is_ is None:
            raise Refuse(f"shapes of the inputs of {n.op} '{n.name}' are not known statically")
        if n.op == "Gather":
            first, count = int(n.attrs.get("axis", 0)) % len(ds), len(is_)
        else:
            first, count = int(n.attrs.get("batch_dims", 0)), len(is_) - 1 - int(n.attrs.get("batch_dims", 0))
        if not first <= rows.axis < first + count:
            raise Refuse(f"the rows of {n.op} '{n.name}' are not an axis of its index")
        self.assign(index, Rows(rows.axis - first if n.op == "Gather" else rows.axis, rows.outer, rows.inner), k, 1)
        self.side[(k, 0)] = None


@dataclass(frozen=True)
class BlockMatch:
    """A block with something to cut: its largest tensor over the limit, or chunks `--max-memory` asks for."""

    block: GatherBlock
    why: str | None  # why no chunk can be carried through it (`gather_blocks`), or None
    biggest: tuple[int, str] | None  # its largest tensor: (bytes, name)
    limit: int | None
    want: int  # chunks --max-memory asks for (1: none)

    @property
    def over(self) -> bool:
        return self.biggest is not None and self.limit is not None and self.biggest[0] > self.limit


@dataclass(frozen=True)
class ChunkPlan:
    """The row chunks one block is cut into, and the sizes the report gives."""

    counts: list[int]  # output rows per chunk
    sizes: list[tuple[int, gs.Tensor]]  # the bytes of every tensor of the block
    float16: bool = False  # a float16 block: cut where ORT CPU rounds as it did (cut_and_join.py)


class SplitBlocks(Pass):
    """Split each deformable-conv block whose tensors exceed `--max-buffer` into the fewest row chunks that fit
    (or into as many as `RunState.min_chunks` asks for, for `--max-memory`)."""

    name = "split"

    def __init__(self, run_state: RunState | None = None) -> None:
        self.run_state = run_state if run_state is not None else RunState()

    def matches(self, ctx: Context) -> Iterator[BlockMatch]:
        """The blocks over the limit (or asked for chunks), each sized just before its turn."""
        limit = getattr(ctx.options, "max_buffer", None)
        if limit is None and not self.run_state.min_chunks:
            return
        self.shapes = Shapes(ctx)
        for block, why in gather_blocks(ctx.graph):
            want = self.run_state.min_chunks.get(block.conv.name, 1) if block.conv is not None else 1
            match = BlockMatch(block, why, self._largest(block), limit, want)
            if match.over or want > 1:  # else nothing of it is over the limit (or its size is unknown): left alone
                yield match

    def refused(self, match: BlockMatch, why: Refuse) -> Action:
        """Named by the block's Conv (by its first gather when it reaches none), with what stays over the limit."""
        block, biggest = match.block, match.biggest
        node = block.conv if block.conv is not None else block.seeds[0]
        what = (f"{human(biggest[0])} tensor '{biggest[1]}' stays over the {human(match.limit)} limit"
                if match.over else f"--max-memory asked for {match.want} chunks")
        details = {**({"tensor": biggest[1], "size_bytes": biggest[0]} if biggest is not None else {}),
                   "limit_bytes": match.limit, **why.details}
        if match.want > 1:
            details["asked_chunks"] = match.want
        return Action(self.name, node.name, node.op, Outcome.REFUSED, f"block not split ({what}): {why}",
                      details=details)

    def _largest(self, block: GatherBlock) -> tuple[int, str] | None:
        sizes = [(self.shapes.nbytes(o), o.name) for n in block.nodes for o in n.outputs]
        known = [s for s in sizes if s[0] is not None]
        return max(known) if known else None

    # -- where the rows are ------------------------------------------------------------------------------------
    def layout(self, ctx: Context, block: GatherBlock, shapes: Shapes) -> None:
        conv, x = block.conv, block.sink
        xs = shapes.shape(x)
        if xs is None or len(xs) != 4:
            raise Refuse("the Conv input's shape is not known statically as [N, C, H, W]")
        kernel = list(conv.attrs.get("kernel_shape") or [])
        if not kernel:
            ws = shapes.shape(conv.inputs[1])
            kernel = list(ws[2:]) if ws is not None else []
        strides = list(conv.attrs.get("strides") or [1, 1])
        pads = list(conv.attrs.get("pads") or [0, 0, 0, 0])
        dil = list(conv.attrs.get("dilations") or [1, 1])
        auto_pad = conv.attrs.get("auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if len(kernel) != 2 or kernel[0] != strides[0] or dil[0] != 1 or pads[0] or pads[2] or \
                auto_pad not in ("NOTSET", "VALID"):
            raise Refuse(f"Conv '{conv.name}' does not read disjoint row bands (kernel {kernel}, strides {strides}, "
                         f"pads {pads}, dilations {dil}): its input rows do not split into its output rows")
        kh = kernel[0]
        if xs[2] % kh:
            raise Refuse(f"Conv input height {xs[2]} is not a multiple of the kernel height {kh}")
        h = xs[2] // kh
        if h < 2:
            raise Refuse("the Conv has a single output row: nothing to split along")
        block.rows = h
        walk = RowWalk(block, shapes, {x.name: Rows(2, 1, kh)})
        for k in range(len(block.nodes) - 1, -1, -1):
            walk.step(k)
        block.layout, block.side = walk.layout, walk.side

    # -- the check -------------------------------------------------------------------------------------------------
    def check(self, ctx: Context, match: BlockMatch) -> ChunkPlan:
        """The fewest row chunks whose tensors fit the limit (None: no limit), and at least as many as `--max-memory`
        asks for; or `Refuse` with the reason the block cannot be cut."""
        if match.why is not None:
            raise Refuse(match.why)
        block, shapes, limit, want = match.block, self.shapes, match.limit, match.want
        self.layout(ctx, block, shapes)
        h = block.rows
        half = sorted({str(shapes.dtype(t)) for n in block.nodes for t in [*n.inputs, *n.outputs]
                       if shapes.dtype(t) is not None and np.dtype(shapes.dtype(t)).kind == "f"
                       and np.dtype(shapes.dtype(t)).itemsize < 4})
        if any(d != "float16" for d in half):
            raise Refuse(f"{'/'.join(half)} block: where ORT CPU rounds such a chain was not measured", dtype=half)
        if half and (why := self.run_state.keep_whole.get(block.conv.name)) is not None:
            raise why  # the whole model was not byte-identical with the float16 split: the block stays whole
        region = [o for n in block.nodes for o in n.outputs]
        sizes = []
        for t in region:
            size = shapes.nbytes(t)
            if size is None:
                raise Refuse(f"size of '{t.name}' is not known statically", tensor=t.name)
            sizes.append((size, t))
        fit = h if limit is None else min(limit * h // size for size, _ in sizes)
        if fit < 1:
            size, t = max(sizes, key=lambda p: p[0])
            raise Refuse(f"one output row of '{t.name}' alone needs {human(size // h)}, more than the limit",
                         tensor=t.name, row_bytes=size // h, rows=h)
        n = max(math.ceil(h / fit), min(want, h))
        base, extra = divmod(h, n)
        return ChunkPlan([base + (1 if c < extra else 0) for c in range(n)], sizes, bool(half))

    # -- the rewrite -------------------------------------------------------------------------------------------
    def rewrite(self, ctx: Context, match: BlockMatch, plan: ChunkPlan) -> Action:
        """Cut `match`'s block into `plan`'s row chunks (and its Conv too, where that is shown exact)."""
        block, shapes, limit, want = match.block, self.shapes, match.limit, match.want
        h, counts = block.rows, plan.counts

        self.memo.clear()  # shared by the chunks of this block only
        chunks = []
        r0 = 0
        for c, rows in enumerate(counts):
            chunks.append(self._chunk(ctx, block, shapes, c, r0, r0 + rows))
            r0 += rows
        sink, conv = block.sink, block.conv
        sink_size = shapes.nbytes(sink)
        tail = conv_tail(ctx, conv, shapes)
        # the Conv is split too when its whole input would be over the limit, or would undo a --max-memory split
        # (the joined input is as large as the tensors the chunks were made to avoid)
        over = limit is not None and sink_size > limit
        why_whole = self._why_conv_whole(ctx, block, tail, counts) if over or want > 1 else ""
        self.run_state.rows[conv.name] = self._rows_of(chunks, counts, sink, shapes.shape(sink)[2] // h)
        if why_whole is None:
            end = (tail[-1] if tail else conv).outputs[0]
            proof = None if plan.float16 else record(ctx, shapes, [conv, *tail], [end])
            if proof is not None:  # (a float16 block's proof is float16_proof.py's, on the written file)
                proof.parts_inputs.update(self.run_state.rows[conv.name])
                self.run_state.proofs[conv.name] = proof
            joined = [self._chunk_tail(ctx, conv, tail, shapes, c, chunk, rows)
                      for c, (chunk, rows) in enumerate(zip(chunks, counts, strict=True))]
            for node in [conv, *tail]:
                node.outputs.clear()
            join(ctx, f"{conv.name}/split/join", joined, end, 2, shapes)
            if proof is not None:
                proof.taken(ctx, shapes)
            carried = "".join(f" -> {node.op}" for node in tail)
            because = "would be over the limit" if over else "would hold the whole block again (--max-memory)"
            verdict = (f"the Conv{carried} is split into the same chunks (its input '{sink.name}', "
                       f"{human(sink_size)}, {because}); the chunks alone give the whole chain's bytes on ORT CPU "
                       "(levels none and all), but ORT fuses a node with its neighbours, so it is written only once "
                       "shown exact in their company")
        else:
            sink.inputs[0].outputs.clear()
            ctx.node("Concat", f"{conv.name}/split/join", chunks, [sink], {"axis": 2})  # (float16: the chunks
            # end in a Reshape, which has a float16 kernel: the sink is rounded to float16 as in the whole block)
            verdict = (f"Conv input '{sink.name}' ({human(sink_size)}) stays whole"
                       + (", within the limit" if not over else " and REMAINS OVER the limit")
                       + (f": {why_whole}" if why_whole else ""))
        self.run_state.chunks[conv.name] = len(counts)
        return self._action(match, plan, tail, sink_size, why_whole, verdict)

    @staticmethod
    def _rows_of(chunks: list[gs.Tensor], counts: list[int], sink: gs.Tensor, rows_per_output_row: int
                 ) -> dict[str, tuple[str, int, int, int]]:
        """Each chunk's Conv input -> (the whole Conv input, axis 2, first row, end row) it holds (`RunState.rows`:
        where a proof starts at the Conv's input)."""
        found, r0 = {}, 0
        for chunk, rows in zip(chunks, counts, strict=True):
            found[chunk.name] = (sink.name, 2, r0 * rows_per_output_row, (r0 + rows) * rows_per_output_row)
            r0 += rows
        return found

    def _why_conv_whole(self, ctx: Context, block: GatherBlock, tail: list[gs.Node], counts: list[int]
                        ) -> Refuse | None:
        """Why the block's Conv stays whole where its whole input would be over the limit or undo a --max-memory
        split, or None when it is split into the chunks too: what the whole patched model showed
        (`RunState.keep_whole`), else its chunks against it whole on ORT CPU (`_conv_split_refusal`, once per Conv and
        chunks, and not at all without `RunState.check_in_pass`: `patch` shows the split exact with its proof)."""
        conv = block.conv
        why_whole = self.run_state.keep_whole.get(conv.name)
        if why_whole is None:
            key = (conv.name, tuple(counts))
            if key not in self.run_state.checked:
                if self.run_state.check_in_pass:
                    step(f"Conv '{conv.name}' in {len(counts)} chunks against it whole, on ORT CPU")
                self.run_state.checked[key] = (self._conv_split_refusal(ctx, block, tail, self.shapes, counts)
                                          if self.run_state.check_in_pass else None)
            why_whole = self.run_state.checked[key]
        return why_whole

    def _action(self, match: BlockMatch, plan: ChunkPlan, tail: list[gs.Node], sink_size: int,
                why_whole: Refuse | str | None, verdict: str) -> Action:
        """What the report says of a block cut into `plan`'s chunks: its largest tensor before and after, and the
        `verdict` on its Conv (split too when `why_whole` is None, else whole and why)."""
        block, limit, want = match.block, match.limit, match.want
        h, counts, sizes, n, sink = block.rows, plan.counts, plan.sizes, len(plan.counts), block.sink
        before_size, before_tensor = max(sizes, key=lambda p: p[0])  # the first in topological order
        before_name = before_tensor.name
        after_size = max(-(-s * max(counts) // h) for s, _ in sizes)
        over = limit is not None and sink_size > limit
        needs_verify = why_whole is None or plan.float16
        details = {"chunks": n, "chunk_rows": counts, "rows": h, "gathers": len(block.seeds),
                   "nodes_per_chunk": len(block.nodes), "tensor": before_name, "size_bytes": before_size,
                   "chunk_bytes": after_size, "limit_bytes": limit, "conv_input": sink.name,
                   "conv_input_bytes": sink_size, "conv_split": why_whole is None,
                   "carried": [node.op for node in tail] if why_whole is None else [],
                   "over_limit": why_whole is not None and over}
        details.update(float16_details(plan.float16))
        if want > 1:
            details["asked_chunks"] = want
        if isinstance(why_whole, Refuse):
            details.update(why_whole.details)
        asked = f"; --max-memory asked for {want}" if want > 1 else ""
        shown = human(limit) if limit else "(no --max-buffer)"
        reason = (f"split into {n} chunks of {'/'.join(str(x) for x in sorted(set(counts), reverse=True))} "
                  f"output rows (of {h}) along the sampling points ({len(block.seeds)} gathers, {len(block.nodes)} "
                  f"nodes per chunk): largest tensor {human(before_size)} ('{before_name}') -> "
                  f"{human(after_size)} per chunk, limit {shown}{asked}; "
                  f"{verdict}" + (FLOAT16_NOTE if plan.float16 else ""))
        return Action(self.name, block.conv.name, block.conv.op, Outcome.REWRITTEN, reason, needs_verify=needs_verify,
                      details=details)

    def _chunk_tail(self, ctx: Context, conv: gs.Node, tail: list[gs.Node], shapes: Shapes, c: int,
                    chunk: gs.Tensor, rows: int) -> gs.Tensor:
        """Chunk `c` through the Conv and its tail: `[N, M, rows, w]`."""
        mapped: dict[int, gs.Tensor] = {}
        current = chunk
        for n in [conv, *tail]:
            out = n.outputs[0]
            full = shapes.shape(out) or shapes.shape(conv.outputs[0])
            y = ctx.var(f"{out.name}/chunk{c}", shapes.dtype(out) or shapes.dtype(conv.outputs[0]),
                        (*full[:2], rows, *full[3:]))
            inputs = [current if n is conv and k == 0 else mapped.get(id(i), i) for k, i in enumerate(n.inputs)]
            ctx.node(n.op, f"{n.name}/chunk{c}", inputs, [y], dict(n.attrs))
            mapped[id(out)] = current = y
        return current

    @staticmethod
    def _conv_split_refusal(ctx: Context, block: GatherBlock, tail: list[gs.Node], shapes: Shapes,
                            counts: list[int]) -> Refuse | None:
        """Why the Conv must stay whole, or None when its row chunks give the whole Conv's bytes on ORT CPU.

        Each output pixel of a Conv with kernel == stride reads only its own band of input rows, so the chunks
        compute the same dot products. Whether a kernel sums them in the same order is the implementation's
        choice: ORT CPU's MLAS picks its K blocking from the GEMM's N (the output pixels it is given), so chunks
        with fewer output pixels than C*kh*kw products can round differently (measured: 1.9e-6 on
        decoder_gathernd_b2g2 in 16 one-row chunks). That order depends on shapes, never on values, so a run of
        the real shapes (Conv and its carried tail) on seeded random data, at the graph optimisation levels
        `verify` uses most (none and all), decides it for every input.
        """
        conv, x = block.conv, block.sink
        xs, dtype = shapes.shape(x), shapes.dtype(x)
        end = (tail[-1] if tail else conv).outputs[0]
        out_shape = shapes.shape(end) or shapes.shape(conv.outputs[0])
        if out_shape is None or len(out_shape) != 4 or out_shape[2] != block.rows or \
                dtype not in (np.float32, np.float16):
            return Refuse("the Conv output's shape or type is not known statically")
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        helper, consts, inits = onnx.helper, {}, []

        def const_name(t: gs.Tensor) -> str | None:
            if id(t) not in consts:
                value = ctx.prover.constant(t)
                if value is None:
                    return None
                consts[id(t)] = f"c{len(consts)}"
                inits.append(onnx.numpy_helper.from_array(np.asarray(value), consts[id(t)]))
            return consts[id(t)]

        def chain(x_name: str, suffix: str) -> tuple[list[onnx.NodeProto], str] | None:
            nodes, names, current = [], {}, x_name
            for k, n in enumerate([conv, *tail]):
                ins = []
                for slot, i in enumerate(n.inputs):
                    if n is conv and slot == 0:
                        ins.append(x_name)
                    elif id(i) in names:
                        ins.append(names[id(i)])
                    elif not i.name:
                        ins.append("")
                    elif (name := const_name(i)) is not None:
                        ins.append(name)
                    else:
                        return None
                current = f"n{k}{suffix}"
                names[id(n.outputs[0])] = current
                nodes.append(helper.make_node(n.op, ins, [current], **n.attrs))
            return nodes, current

        whole = chain("x", "")
        if whole is None:
            return Refuse("the Conv's weights are not constants, so its chunks cannot be checked")
        nodes, parts, r0, kh = list(whole[0]), [], 0, xs[2] // block.rows
        inits.append(onnx.numpy_helper.from_array(np.array([2], np.int64), "axis"))
        for c, rows in enumerate(counts):
            inits += [onnx.numpy_helper.from_array(np.array([r0 * kh], np.int64), f"b{c}"),
                      onnx.numpy_helper.from_array(np.array([(r0 + rows) * kh], np.int64), f"e{c}")]
            nodes.append(helper.make_node("Slice", ["x", f"b{c}", f"e{c}", "axis"], [f"x{c}"]))
            part_nodes, part = chain(f"x{c}", f"_{c}")
            nodes += part_nodes
            parts.append(part)
            r0 += rows
        nodes.append(helper.make_node("Concat", parts, ["split"], axis=2))
        model = helper.make_model(helper.make_graph(
            nodes, "conv_split_check", [helper.make_tensor_value_info("x", elem, xs)],
            [helper.make_tensor_value_info(n, elem, out_shape) for n in (whole[1], "split")],
            inits), opset_imports=[helper.make_opsetid("", 17)])
        feed = {"x": np.random.default_rng(0).standard_normal(xs, dtype=np.float32).astype(dtype)}
        for level in ("disable", "all"):
            for threads in proof_threads(None, model):
                a, b = ctx.ort_cpu(model, feed, level, threads=threads)
                if a.tobytes() != b.tobytes():
                    diff = float(np.abs(a - b).max())
                    return Refuse(f"its {len(counts)} row chunks do not give the whole Conv's bytes on ORT CPU (max "
                                  f"diff {diff:.2g} at level '{level}', {threads} intra-op thread(s); the kernel's "
                                  "summation order depends on the number of output pixels and threads it is given)",
                                  level=level, threads=threads, max_diff=diff)
        return None

    def _chunk(self, ctx: Context, block: GatherBlock, shapes: Shapes, c: int, r0: int, r1: int) -> gs.Tensor:
        mapped: dict[str, gs.Tensor] = {}
        rows_n = r1 - r0
        for k, n in enumerate(block.nodes):
            inputs: list[gs.Tensor] = []
            for slot, t in enumerate(n.inputs):
                if t.name in mapped:
                    inputs.append(mapped[t.name])
                elif (k, slot) in block.side:
                    rows = block.side[(k, slot)]
                    inputs.append(t if rows is None else self._slice(ctx, t, rows, block.rows, r0, r1, shapes))
                elif n.op == "Reshape" and slot == 1:
                    out_shape = block.layout[n.outputs[0].name].chunk_shape(shapes.shape(n.outputs[0]), rows_n)
                    inputs.append(self._shape_const(ctx, f"{n.name}/chunk{c}_shape", out_shape))
                else:
                    inputs.append(t)  # parameters: Squeeze/Unsqueeze axes
            out = n.outputs[0]
            shape = block.layout[out.name].chunk_shape(shapes.shape(out), rows_n)
            new = ctx.var(f"{out.name}/chunk{c}", shapes.dtype(out), shape)
            ctx.node(n.op, f"{n.name}/chunk{c}", inputs, [new], dict(n.attrs))
            mapped[out.name] = new
        return mapped[block.sink.name]

    def _shape_const(self, ctx: Context, base: str, shape: tuple[int, ...]) -> gs.Constant:
        key = ("shape", shape)
        if key not in self.memo:
            self.memo[key] = ctx.const(base, np.array(shape, dtype=np.int64))
        return self.memo[key]

    def _slice(self, ctx: Context, t: gs.Tensor, rows: Rows, h: int, r0: int, r1: int, shapes: Shapes) -> gs.Tensor:
        """Rows `r0..r1` of a tensor computed outside the block (weights, mask, index), as a new tensor."""
        key = ("slice", t.name, rows, r0, r1)
        if key in self.memo:
            return self.memo[key]
        shape = shapes.shape(t)
        split = shape[: rows.axis] + (rows.outer, h, rows.inner) + shape[rows.axis + 1:]
        chunk = rows.chunk_shape(shape, r1 - r0)
        base = f"{t.name}/rows{r0}_{r1}"
        values = ctx.prover.constant(t)
        if values is not None:
            part = np.take(values.reshape(split), np.arange(r0, r1), axis=rows.axis + 1).reshape(chunk)
            out: gs.Tensor = ctx.const(base, np.ascontiguousarray(part))
            self.memo[key] = out
            return out
        dtype = shapes.dtype(t)
        src, axis = t, rows.axis
        if rows.outer != 1 or rows.inner != 1:
            src = self.memo.get(("split", t.name, rows))
            if src is None:
                src = ctx.var(f"{t.name}/by_rows", dtype, split)
                ctx.node("Reshape", f"{t.name}/by_rows", [t, self._shape_const(ctx, f"{t.name}/by_rows_shape", split)],
                         [src])
                self.memo[("split", t.name, rows)] = src
            axis = rows.axis + 1
        part_shape = split[:axis] + (r1 - r0,) + split[axis + 1:] if src is not t else chunk
        part = ctx.var(base, dtype, part_shape)
        if dtype is not None and np.dtype(dtype).kind == "f":
            # float16: a Pad (cut_and_join.py), where ORT keeps float32 values
            cut(ctx, base, src, r0, r1, axis, part, h)
        else:
            ctx.node("Gather", base, [src, ctx.const(f"{base}/rows", np.arange(r0, r1, dtype=np.int64))], [part],
                     {"axis": axis})
        out = part
        if src is not t:
            out = ctx.var(f"{base}/joined", dtype, chunk)
            ctx.node("Reshape", f"{base}/joined", [part, self._shape_const(ctx, f"{base}/joined_shape", chunk)], [out])
        self.memo[key] = out
        return out
