"""What one run of the bands pass (bands.py) knows and its three planners share: the limit, the tensors read outside
the rewritten part, the run state `patch` carries between lifts, and which channel group is a part of which tensor.

Why a module of its own: the pass computes a Resize in channel groups (resize_groups.py), a Conv in row bands
(conv_bands.py) and a MatMul chain in row chunks (matmul_chunks.py), each deciding on its own, but all three cut a
tensor as ORT CPU held it (a channel group as the tensor it is part of), record a local proof the same way and word
a rewrite that is not exact by construction alike; those are written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Outcome
from ..graph.shapes import Shapes
from ..proofs.local_proof import LocalProof, record
from .cut_and_join import FLOAT16_NOTE
from .run_state import RunState


def even_parts(count: int, n: int) -> list[tuple[int, int]]:
    """`[start, end)` of `n` consecutive parts of `count` rows (or channels) whose sizes differ by at most one."""
    base, extra = divmod(count, n)
    out, r0 = [], 0
    for k in range(n):
        r1 = r0 + base + (1 if k < extra else 0)
        out.append((r0, r1))
        r0 = r1
    return out


def concat_axis(node: gs.Node, rank: int) -> int:
    """The axis a Concat joins on, counted from the front."""
    return int(node.attrs.get("axis", 0)) % rank


@dataclass
class OversizeRun:
    """One run of the bands pass over a graph: what its planners read and the channel groups they made.

    `outside`: the ids of the graph outputs (a tensor read outside the rewritten part is needed whole);
    `origin`: a channel group -> the tensor it is a part of (`held`)."""

    name: str
    run_state: RunState
    shapes: Shapes
    limit: int
    outside: set[int]
    origin: dict[int, gs.Tensor] = field(default_factory=dict)

    def held(self, ctx: Context, t: gs.Tensor) -> bool:
        """Whether ORT CPU holds float16 `t` in float32 (cut_and_join.py), a channel group as the tensor it is part of:
        the cut of a group made by a Cast to float16 must round as that Cast's readers saw it round."""
        return ctx.held_in_float32(self.origin.get(id(t), t))

    def proof(self, ctx: Context, key: str, nodes: list[gs.Node], ends: list[gs.Tensor], float16: bool
              ) -> LocalProof | None:
        """The local proof of a rewrite (local_proof.py), or None for a float16 one: a region's inputs would be
        float16 graph inputs, rounded already, so only the whole model shows where ORT CPU rounds (cut_and_join.py)."""
        if float16:
            return None
        proof = self.run_state.proofs[key] = record(ctx, self.shapes, nodes, ends)
        return proof

    def live(self, node: gs.Node, seen: set[int] | None = None) -> bool:
        """Whether something the graph computes reads what `node` makes (a graph output, or a live reader): a node
        an earlier rewrite of this pass replaced stays in the graph, without readers, until cleanup."""
        seen = set() if seen is None else seen
        if id(node) in seen:
            return False
        seen.add(id(node))
        return any(id(t) in self.outside or any(self.live(r, seen) for r in t.outputs) for t in node.outputs)

    def rewritten(self, node: gs.Node, reason: str, details: dict, float16: bool, needs_verify: bool = True) -> Action:
        """The action of a rewrite of `node`: one not exact by construction (`needs_verify`: written only once shown
        exact), with the float16 note where it cuts float16 tensors."""
        return Action(self.name, node.name, node.op, Outcome.REWRITTEN, reason + (FLOAT16_NOTE if float16 else ""),
                      needs_verify=needs_verify, details=details)


def kernels_choice(kernel: str) -> str:
    """The end of the reason of a rewrite whose parts read the same values as the whole: why it is not exact by
    construction all the same."""
    return (f"the summation order of a {kernel} kernel on fewer rows is the implementation's choice, so it is written "
            "only once shown exact")
