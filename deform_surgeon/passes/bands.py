"""Compute an ordinary Conv in row bands, a Resize in channel groups and a token-major MatMul chain in row chunks,
so that no tensor exceeds `--max-buffer`.

Why: outside its deform blocks (the split pass's work) BiRefNet ends at full resolution. At 1024x1024 its decoder
makes a 480 MiB channel Concat (the upsampled features and the image-patch branch) read by the last 1x1 Conv, the
384 MiB Resize feeding it, a 320 MiB Concat of the ASPP branches at 256x256 read by a 1x1 Conv, and a 256 MiB Conv
output read by a 3x3 Conv. A WebGPU buffer over the device's `maxBufferSize` (or bound over
`maxStorageBufferBindingSize`) is an error when the kernel runs (docs/runtime-facts.md section 7).

What, and why each is exact:

* **Resize in channel groups.** A Resize over the limit whose output only Concats on the channel axis read, with
  scale 1 on the batch and channel axes, is computed per group of channels from a Slice of its input, and the
  groups replace its output among the Concats' inputs (the groups' `sizes` are constants of the inferred shape).
  Where a Conv of one group makes the Resize's input, each group's input is that Conv for the group's output
  channels instead of a Slice (see `ResizeGroups._channel_source`: it keeps ORT's NCHWc path).
  Each output element is interpolated from its own channel with weights that depend on the spatial sizes only,
  and a Concat of the groups is the whole output element for element; but at level `all` ORT may run the whole
  Resize in its NCHWc layout with a kernel of its own (measured: 3-channel groups of a 6-channel Resize differ
  by 3e-8 there and nowhere else), so this too is `needs_verify` (below).
* **Conv in row bands.** A Conv whose input X is over the limit, read by that Conv alone, is computed for output
  rows `[o0, o1)` at a time from the rows of X those outputs read (the kernel's halo included; zero padding only
  where the original pads, beyond X's edges), and one Concat on the rows joins the bands. X is never made whole:
  per band its rows come from its producer, a channel Concat (slices of each input, concatenated), a Concat on
  the rows (a split deform block's join: slices of the inputs holding the band's rows) or a Conv
  (computed in turn for those rows from a slice of its own input, through the per-channel ops between the two).
  An input of that Concat or Conv that is itself over the limit is made for the band's rows the same way, by its
  own producer (the full BiRefNet's last Conv reads a channel Concat of the Resize's groups and a 192 MiB Conv
  output, itself made from a 256 MiB one), so each band computes its rows through the whole chain, halos
  included, and nothing over the limit is made whole; a Conv inside such a chain gets no bands of its own unless
  the outer one is refused.
  The per-channel ops after the banded Conv (bias Add, BatchNormalization, Relu) are carried per band, so ORT's
  Conv fusions see the same pattern in every band. Each output pixel reads the same values as before, but whether
  a Conv kernel sums them in the same order for fewer output rows is the implementation's choice: the action is
  marked `needs_verify`, `patch` writes it only after the whole patched model verified byte-identical, and
  undoes it otherwise (`RunState.keep_whole`, shared with the split pass).

* **MatMul chain in row chunks.** The full BiRefNet's Swin backbone (swin_v1_l) runs its stage-1 MLP on 65,536
  tokens at 1024x1024: LayerNorm -> MatMul [1, 65536, 192] x [192, 768] -> bias Add -> GELU (Div, Erf, Add, Mul,
  Mul) -> MatMul x [768, 192] -> bias Add, seven [1, 65536, 768] tensors of 192 MiB. From a MatMul by a constant
  2-D matrix that makes or reads a tensor over the limit, the chain is every node making or reading a tensor of it
  over the limit, each computing a row (a token: the second-to-last axis) of its output from the same row of its
  inputs that are not constants: a MatMul by a constant 2-D matrix, an elementwise op whose constants do not vary
  along the rows (`MatMulRowChunks._row_wise`). The ops after its ends whose other inputs are such constants (the
  bias Add after fc2) are carried per chunk, as the bands carry a Conv's tail: at level `all` ORT CPU fuses a MatMul
  and its bias Add into a Gemm, which a Concat between them would stop. Each chunk Slices its rows of the chain's
  inputs and runs the chain's copies; one Concat on the rows per end joins the chunks (an end over the limit is
  refused).
  Each output row reads only its own input row, but how MLAS's SGEMM sums for fewer rows (and what ORT fuses) is
  the implementation's choice: `needs_verify`, shown exact by its local proof like the others.

Bands (and chunks): the fewest equal bands (sizes differ by at most one row) for which every band tensor fits the
limit.

Where each is decided: `resize_groups.py` (a Resize in channel groups, and a channel Concat several nodes read taken
apart by its readers), `conv_bands.py` (a Conv in row bands), `matmul_chunks.py` (a MatMul chain in row chunks);
`oversize.py` holds what one run shares between them. This module is the pass: what it matches, in which order,
and how it words a refusal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse
from ..graph.shapes import Shapes
from .conv_bands import ConvRowBands
from .matmul_chunks import MatMulRowChunks
from .oversize import OversizeRun, concat_axis
from .resize_groups import ResizeGroups
from .run_state import RunState


class BandOversize(Pass):
    """Resize in channel groups, Conv in row bands and MatMul chains in row chunks wherever a tensor outside the
    deform blocks is over `--max-buffer` (see the module docstring).

    Matches, in order: every Resize whose output is over the limit, then every Conv whose input is, then every
    MatMul by a constant 2-D matrix that makes or reads a tensor over the limit (once per chain). A Conv whose
    output, over the limit too, an outer Conv's bands compute in rows (the nested form: a channel Concat read by a
    Conv reads that Conv's output) waits for the outer one: banded alone first, its joined output would be made
    whole. It is matched right after the outer one only if that one was refused (`matches` is a generator that
    reads the refusals `refused` records), and never otherwise."""

    name = "bands"

    def __init__(self, run_state: RunState | None = None) -> None:
        self.run_state = run_state if run_state is not None else RunState()

    def matches(self, ctx: Context) -> Iterator[tuple[str, gs.Node, Any]]:
        limit = ctx.options.max_buffer
        if limit is None:
            return
        state = self.state = OversizeRun(self.name, self.run_state, Shapes(ctx), limit,
                                         {id(t) for t in ctx.graph.outputs})
        self.groups, self.bands, self.chunks = ResizeGroups(state), ConvRowBands(state), MatMulRowChunks(state)
        shapes = self.shapes = state.shapes
        self.refused_ids: set[int] = set()
        resizes = [n for n in ctx.graph.nodes if n.op == "Resize" and (shapes.nbytes(n.outputs[0]) or 0) > limit]
        for node in resizes:  # first: the Convs below are found in the graph their groups made
            yield "resize", node, None
        shared = [n for n in ctx.graph.nodes if n.op == "Concat" and len(n.outputs) == 1
                  and (shapes.nbytes(n.outputs[0]) or 0) > limit and len(n.outputs[0].outputs) > 1
                  and shapes.shape(n.outputs[0]) is not None and len(shapes.shape(n.outputs[0])) == 4
                  and concat_axis(n, 4) == 1 and id(n.outputs[0]) not in self.state.outside
                  and any(r.op in ("Shape", "Resize") and self.state.live(r) for r in n.outputs[0].outputs)]
        for node in shared:  # then: its readers read their parts (the Resizes' groups' Convs among them), and
            yield "shared", node, None  # each Conv, its own Concat's one reader, is found below
        convs = [(n, self.bands.feeding(ctx, n.inputs[0], shapes)) for n in ctx.graph.nodes
                 if n.op == "Conv" and n.inputs and (shapes.nbytes(n.inputs[0]) or 0) > limit]
        waiting: dict[int, list] = {}
        for node, feeders in convs:
            if feeders is not None:
                try:
                    inner = self.bands.source(ctx, node.inputs[0], feeders, "", node).nodes()
                except Refuse:
                    continue
                waiting[id(node)] = [(n, f) for n, f in convs if any(n is m for m in inner)]
        deferred = {id(n) for pending in waiting.values() for n, _ in pending}
        done: set[int] = set()

        def in_turn(node: gs.Node, feeders) -> Iterator[tuple[str, gs.Node, Any]]:
            done.add(id(node))
            yield "conv", node, feeders
            if id(node) in self.refused_ids:
                for inner, f in waiting.get(id(node), []):
                    if id(inner) not in done:
                        yield from in_turn(inner, f)

        for node, feeders in convs:
            if feeders is not None and id(node) not in deferred:  # else not this pass's pattern (a deform
                yield from in_turn(node, feeders)  # block's join, for one: not reported) or waiting for an outer Conv
        for node in [n for n in ctx.graph.nodes if self.chunks.seeds(ctx, n, shapes, limit)]:
            if id(node) not in self.chunks.chained:  # (each chain is matched once)
                yield "rows", node, None

    def check(self, ctx: Context, match: tuple[str, gs.Node, Any]) -> Any:
        """The plan of the match's kind, or `Refuse`: a Resize's channel groups, the readers that take a shared
        Concat apart, a Conv's row bands, a MatMul chain's row chunks. (The pieces are not exact by construction:
        each rewrite is `needs_verify`, shown exact by its local proof before it is written.)"""
        kind, node, feeders = match
        if kind == "resize":
            return self.groups.plan(ctx, node)
        if kind == "shared":
            return self.groups.readers(ctx, node)
        if kind == "rows":
            return self.chunks.plan(ctx, node)
        return self.bands.plan(ctx, node, feeders)

    def rewrite(self, ctx: Context, match: tuple[str, gs.Node, Any], plan: Any) -> Action:
        kind, node, _ = match
        if kind == "resize":
            return self.groups.rewrite(ctx, plan)
        if kind == "shared":
            return self.groups.unshared(ctx, node, plan)
        if kind == "rows":
            return self.chunks.rewrite(ctx, plan)
        return self.bands.rewrite(ctx, plan)

    def refused(self, match: tuple[str, gs.Node, Any], why: Refuse) -> Action:
        """The refusal with the tensor over the limit, its size and the limit; a refused Conv lets the Convs
        waiting for it be matched next."""
        kind, node, _ = match
        self.refused_ids.add(id(node))
        t = node.outputs[0] if kind in ("resize", "shared") else node.inputs[0]
        if kind == "rows":  # the MatMul's tensor over the limit (`why.details` names the chain's largest)
            t = max([*(i for i in node.inputs if i.name), *node.outputs], key=lambda x: self.shapes.nbytes(x) or 0)
        details = {"tensor": t.name, "size_bytes": self.shapes.nbytes(t), "limit_bytes": self.state.limit,
                   **why.details}
        return Action(self.name, node.name, node.op, Outcome.REFUSED, str(why), details=details)

