"""A token-major MatMul chain in row chunks (the bands pass, bands.py): which nodes make up the chain from a MatMul
by a constant matrix, which of its inputs each chunk slices, which ends are joined, and how many chunks.

Why apart from the pass: a chain is decided row by row (a token: the second-to-last axis), from what each op
computes of a row, not by a Conv's window or a Resize's channels, which the same pass also cuts. The module
docstring of bands.py says why it is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.budget import human
from ..graph.ops import ELEMENTWISE_NARY, ELEMENTWISE_UNARY
from ..graph.pipeline import Action, Context, Refuse
from ..graph.shapes import Shapes, along_rows
from .cut_and_join import cut, float16_details, join
from .oversize import OversizeRun, even_parts, kernels_choice


@dataclass(frozen=True)
class RowChunkPlan:
    """The row chunks a MatMul chain is computed in: the chain's `nodes` (from `seed`), the inputs each chunk
    slices (`sliced`), the `ends` joined, the ops `carried` after them, the row `axis` and its `rows`, the chunks as
    `[r0, r1)` each and the largest chunk tensor (`worst`)."""

    seed: gs.Node
    nodes: list[gs.Node]
    sliced: list[gs.Tensor]
    ends: list[gs.Tensor]
    carried: list[gs.Node]
    axis: int
    rows: int
    chunks: list[tuple[int, int]]
    worst: int

    @property
    def tensors(self) -> list[gs.Tensor]:
        """Every tensor a chunk makes its rows of: the sliced inputs and the chain's outputs."""
        return [*self.sliced, *(o for n in self.nodes for o in n.outputs)]


class MatMulRowChunks:
    """Finds and builds the row chunks of MatMul chains (the pass's `rows` matches); `chained` keeps the nodes of
    the chains met so far, so that each chain is matched once."""

    def __init__(self, run: OversizeRun) -> None:
        self.run = run
        self.chained: set[int] = set()

    @staticmethod
    def seeds(ctx: Context, node: gs.Node, shapes: Shapes, limit: int) -> bool:
        """Whether `node` is a MatMul by a constant 2-D matrix that makes or reads a tensor over the limit: where a
        row chain is looked for (the chain itself is found from it by `_row_chain`)."""
        if node.op != "MatMul" or len(node.inputs) != 2 or len(node.outputs) != 1:
            return False
        if not any((shapes.nbytes(t) or 0) > limit for t in (node.inputs[0], node.outputs[0])):
            return False
        b = shapes.shape(node.inputs[1])
        return b is not None and len(b) == 2 and ctx.prover.constant(node.inputs[1]) is not None

    def _row_wise(self, ctx: Context, node: gs.Node, shapes: Shapes, axis: int, rows: int,
                  varying: gs.Tensor | None = None) -> str | None:
        """None when each row of `node`'s output (along `axis`, of `rows`) is computed from the same row of its
        inputs that are not constants (a MatMul by a constant 2-D matrix, an elementwise op whose constants do not
        vary along the rows), else why not. `varying`: the input it is reached by, which must not be a MatMul's
        right-hand side."""
        what = f"{node.op} '{node.name}'"
        if node.op not in ELEMENTWISE_UNARY | ELEMENTWISE_NARY | {"MatMul"}:
            return f"{what} is not a MatMul by a constant matrix or an elementwise op"
        out = node.outputs[0] if len(node.outputs) == 1 else None
        shape = shapes.shape(out) if out is not None else None
        if out is None or shape is None or len(shape) != axis + 2 or shape[axis] != rows:
            return f"{what} does not make one tensor of known shape with the chain's {rows} rows on axis {axis}"
        if node.op == "MatMul":
            b = shapes.shape(node.inputs[1])
            if varying is node.inputs[1] or b is None or len(b) != 2 or ctx.prover.constant(node.inputs[1]) is None:
                return f"{what} does not multiply the rows by a constant 2-D matrix"
            return None
        for i in (i for i in node.inputs if i.name):
            known = ctx.prover.constant(i)
            if known is None and shapes.shape(i) != shape:
                return f"{what} broadcasts '{i.name}', which is not a constant, to its output's shape"
            if known is not None and not along_rows(shape, known.shape, axis):
                return f"{what} reads a constant '{i.name}' that varies along the rows"
        return None

    def _row_chain(self, ctx: Context, seed: gs.Node, shapes: Shapes, limit: int, outside: set[int], head: str
                   ) -> tuple[list[gs.Node], list[gs.Tensor], list[gs.Tensor], list[gs.Node], int, int]:
        """The chain computed in row chunks from `seed`: every node making or reading a tensor of it over the
        limit, each computing its rows from the same rows of its inputs (`_row_wise`), then the ops after its ends
        whose other inputs are constants (a bias Add: carried per chunk so that ORT's MatMul+Add fusion sees the
        same pattern in every chunk). Returns (nodes in graph order, the inputs sliced per chunk, the ends joined,
        the carried ops, the row axis, the rows); `Refuse` when a tensor over the limit cannot be made so."""
        shape = shapes.shape(seed.outputs[0])
        if shape is None or len(shape) < 2:
            raise Refuse(f"{head}: the shape of '{seed.outputs[0].name}' is not known statically")
        axis, rows = len(shape) - 2, shape[len(shape) - 2]
        chain: dict[int, gs.Node] = {}
        stack: list[tuple[gs.Node, gs.Tensor | None]] = [(seed, None)]
        problems: list[Refuse] = []  # the whole chain is walked first, so that each is matched (and refused) once
        while stack:
            node, reached = stack.pop()
            if id(node) in chain or id(node) in self.chained:
                continue
            self.chained.add(id(node))
            why = self._row_wise(ctx, node, shapes, axis, rows, reached)
            if why is not None:
                problems.append(Refuse(f"{head}: {why}, so the chain of '{seed.name}' cannot be computed in row "
                                       "chunks", node=node.name))
                continue
            chain[id(node)] = node
            for i in node.inputs:
                if (shapes.nbytes(i) or 0) > limit and ctx.prover.constant(i) is None:
                    if len(i.inputs) != 1:
                        problems.append(Refuse(f"{head}: '{i.name}' ({human(shapes.nbytes(i))}) is an input of the "
                                               "rewritten part, needed whole", read_elsewhere=i.name))
                    stack.extend((p, None) for p in i.inputs)
            for o in node.outputs:
                if (shapes.nbytes(o) or 0) > limit:
                    if id(o) in outside:
                        problems.append(Refuse(f"{head}: '{o.name}' is read outside the rewritten part or is a "
                                               "graph output, so it would be needed whole anyway",
                                               read_elsewhere=o.name))
                    stack.extend((r, o) for r in o.outputs)
        if problems:
            raise problems[0]
        order = {id(n): k for k, n in enumerate(ctx.graph.nodes)}
        nodes = sorted(chain.values(), key=lambda n: order[id(n)])
        carried: list[gs.Node] = []
        for node in list(nodes):  # the per-row ops after an end with constants only, as the bands carry a tail
            t = node.outputs[0]
            while id(t) not in outside and len(t.outputs) == 1 and id(t.outputs[0]) not in chain and \
                    t.outputs[0].op in ELEMENTWISE_UNARY | ELEMENTWISE_NARY and \
                    all(i is t or ctx.prover.constant(i) is not None for i in t.outputs[0].inputs if i.name) and \
                    self._row_wise(ctx, t.outputs[0], shapes, axis, rows, t) is None:
                chain[id(t.outputs[0])] = t.outputs[0]
                carried.append(t.outputs[0])
                t = t.outputs[0].outputs[0]
        nodes = sorted(chain.values(), key=lambda n: order[id(n)])
        made = {id(o) for n in nodes for o in n.outputs}
        sliced = list({id(i): i for n in nodes for i in n.inputs
                       if i.name and id(i) not in made and ctx.prover.constant(i) is None}.values())
        ends = [o for n in nodes for o in n.outputs
                if id(o) in outside or any(id(r) not in chain for r in o.outputs)]
        for t in ends:
            if (shapes.nbytes(t) or 0) > limit:
                raise Refuse(f"{head}: the chain's end '{t.name}' ({human(shapes.nbytes(t))}) is over the limit "
                             "too", end=t.name, end_bytes=shapes.nbytes(t))
        return nodes, sliced, ends, carried, axis, rows

    def plan(self, ctx: Context, seed: gs.Node) -> RowChunkPlan:
        """The fewest equal row chunks of the chain of `seed` (`_row_chain`) whose tensors fit the limit; `Refuse`
        where one row of the chain does not fit."""
        shapes, limit, outside = self.run.shapes, self.run.limit, self.run.outside
        big = max([*(i for i in seed.inputs if i.name), *seed.outputs], key=lambda t: shapes.nbytes(t) or 0)
        head = f"'{big.name}' ({human(shapes.nbytes(big))}) stays over the {human(limit)} limit"
        nodes, sliced, ends, carried, axis, rows = self._row_chain(ctx, seed, shapes, limit, outside, head)
        why = self.run.run_state.keep_whole.get(seed.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        tensors = [*sliced, *(o for n in nodes for o in n.outputs)]
        row_bytes = max(-(-(shapes.nbytes(t) or 0) // rows) for t in tensors)
        most = limit // row_bytes
        if most < 1:
            raise Refuse(f"{head}: one row of the chain is {human(row_bytes)}", rows=rows, row_bytes=row_bytes)
        chunks = even_parts(rows, math.ceil(rows / most))
        worst = max((r1 - r0) * (shapes.nbytes(t) or 0) // rows for t in tensors for r0, r1 in chunks)
        return RowChunkPlan(seed, nodes, sliced, ends, carried, axis, rows, chunks, worst)

    def rewrite(self, ctx: Context, plan: RowChunkPlan) -> Action:
        """The chain computed in `plan`'s chunks: each chunk slices its rows of the chain's inputs and runs the
        chain's copies, one Concat per end joins the chunks; and what the report says of them."""
        shapes, limit = self.run.shapes, self.run.limit
        seed, nodes, sliced, ends, carried, axis, rows, chunks, worst = (
            plan.seed, plan.nodes, plan.sliced, plan.ends, plan.carried, plan.axis, plan.rows, plan.chunks, plan.worst)
        tensors, n = plan.tensors, len(plan.chunks)
        biggest = max(tensors, key=lambda t: shapes.nbytes(t) or 0)
        over = [o.name for n in nodes for o in n.outputs if (shapes.nbytes(o) or 0) > limit]
        float16 = any(shapes.dtype(t) == np.float16 for t in tensors)
        proof = self.run.proof(ctx, seed.name, nodes, ends, float16)
        pieces: dict[int, list[gs.Tensor]] = {id(t): [] for t in ends}
        for k, (r0, r1) in enumerate(chunks):
            tag = f"rows{k}"
            made: dict[int, gs.Tensor] = {}
            for t in sliced:
                s = shapes.shape(t)
                made[id(t)] = cut(ctx, f"{t.name}/{tag}/slice", t, r0, r1, axis,
                                  ctx.var(f"{t.name}/{tag}", shapes.dtype(t), (*s[:axis], r1 - r0, *s[axis + 1:])),
                                  rows, self.run.held(ctx, t))
            for node in nodes:
                outs = []
                for o in node.outputs:
                    s = shapes.shape(o)
                    made[id(o)] = ctx.var(f"{o.name}/{tag}", shapes.dtype(o), (*s[:axis], r1 - r0, *s[axis + 1:]))
                    outs.append(made[id(o)])
                ctx.node(node.op, f"{node.name}/{tag}", [made.get(id(i), i) for i in node.inputs], outs,
                         dict(node.attrs))
            for t in ends:
                pieces[id(t)].append(made[id(t)])
        for node in nodes:
            node.outputs.clear()
        for t in ends:
            join(ctx, f"{t.name}/rows/join", pieces[id(t)], t, axis, shapes, self.run.held(ctx, t))
        if proof is not None:
            proof.taken(ctx, shapes)

        counts = "/".join(str(c) for c in sorted({r1 - r0 for r0, r1 in chunks}, reverse=True))
        details = {"chunks": n, "chunk_rows": [r1 - r0 for r0, r1 in chunks], "rows": rows, "axis": axis,
                   "tensor": biggest.name, "size_bytes": shapes.nbytes(biggest), "chunk_bytes": worst,
                   "limit_bytes": limit, "chain": [x.op for x in nodes], "made_in_rows": over,
                   "sliced": [t.name for t in sliced], "ends": [t.name for t in ends],
                   "carried": [x.op for x in carried], **float16_details(float16)}
        return self.run.rewritten(
            seed, f"computed in {n} row chunks of {counts} rows (of {rows}, axis {axis}) with the {len(nodes)} "
            f"nodes of its chain ({' -> '.join(x.op for x in nodes)}): {len(over)} tensor(s) were over the "
            f"{human(limit)} limit, the largest '{biggest.name}' ({human(shapes.nbytes(biggest))}); each chunk reads "
            f"a Slice of the rows of {', '.join(repr(t.name) for t in sliced)}, one Concat per end joins the chunks "
            f"({', '.join(repr(t.name) for t in ends)}); largest chunk tensor {human(worst)}; each output row reads "
            "only its own input row, but " + kernels_choice("MatMul"), details, float16)

