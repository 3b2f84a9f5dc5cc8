"""Show float16 rewrites exact on the nodes around them, at the cost of those nodes, not of the whole model.

Why a proof of its own: in a float16 model ORT CPU decides where values are rounded to float16 from the graph
around each node (passes/cuts.py, passes/precision.py), so a rewrite run on its own, its inputs given as float16
graph inputs, would be rounded elsewhere than in the model. This proof therefore takes its nodes from the two
models ORT will really run, and holds it to ORT's own graphs of them:

* the **diff** of the model without the float16 rewrites (as the passes before them left it, `before`) and the
  patched file (`after`): the nodes only `before` has are the whole side, those only `after` has the rewritten
  side, in connected groups (rewrites that read each other's nodes, such as a Conv's bands and the channel groups
  of the Resize after it, are one group: each one's readers are the other's rewritten nodes);
* **around** each group, what ORT rounds it by (`context`): the producers of inputs the model holds in float32
  (a graph input would be rounded), the model's own index chain where the group reads integers (its clamps keep
  every gather in range), the readers of the group's outputs, compared byte for byte (read out through a Cast to
  float32 where the model holds them in float32, which reads ORT's float32 copy as it is), and their readers in
  turn where the read-out itself changes how ORT runs them; a stored tensor the model shares between more nodes
  is shared in the proof too (`local_proof._shared`);
* **held** to the models: at each level, ORT's graph of each side (precision.Rounding) must write and read every
  tensor of the side and of its readers as ORT's graph of `before` (the whole side) and of `after` (the rewritten
  side) does. Only then are the two sides run on seeded inputs at the real shapes, at levels `disable` and `all`.

A group whose context does not get there is `Unshown`: neither shown exact nor disproved, it is left to the
whole-model check. A group whose sides differ is disproved, with the level and the difference.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..pipeline import Refuse
from .local_proof import LEVELS, Facts, LocalProof, NodeSpec, Runner, compare_sides, side_models
from .precision import GIVEN_ROUNDED, PAST_PRODUCER, TYPED, Rounding, rounding


class Unshown(Refuse):
    """A proof that cannot stand for the model (ORT would run its nodes otherwise than in the model): the rewrites
    it covers are neither shown exact nor disproved, and are left to the whole-model check."""


class ModelView:
    """A model file read for proofs: its nodes by name, who makes and reads each tensor, their types (the file's
    own declarations first, then shape inference of its skeleton, contrib ops included) and the values of its
    stored tensors and Constant nodes, read from the file when asked (model_io: no weight is loaded whole)."""

    def __init__(self, path: str | Path) -> None:
        from ..model_io import infer_value_types, load_model

        self.path = Path(path)
        model, self.weights = load_model(path)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self.graph = model.graph
        self.nodes = list(model.graph.node)
        self.by_name = {n.name: n for n in self.nodes}
        self.unique = len(self.by_name) == len(self.nodes) and all(n.name for n in self.nodes)
        self.order = {n.name: k for k, n in enumerate(self.nodes)}
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.nodes:
            for i in dict.fromkeys(n.input):
                if i:
                    self.readers[i].append(n)
        self.stored = {t.name: t for t in model.graph.initializer}
        self.declared = {vi.name: vi for vi in model.graph.value_info}
        self.inferred = infer_value_types(model, self.weights)

    def type(self, name: str) -> tuple[np.dtype, tuple[int, ...]] | None:
        if name in self.declared:
            tt = self.declared[name].type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            if tt.elem_type and tt.HasField("shape") and all(d is not None for d in dims):
                return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims
        if name not in self.inferred:
            return None
        elem, shape = self.inferred[name]
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)), tuple(shape)

    def value(self, name: str) -> np.ndarray | None:
        if name in self.weights.tensors:
            return self.weights.read(name)
        if name in self.stored:
            return onnx.numpy_helper.to_array(self.stored[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return next((onnx.numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        return None

    def spec(self, node: onnx.NodeProto, facts: Facts) -> NodeSpec:
        """`node` as a proof's NodeSpec, the types and stored values of what it reads and makes learned into
        `facts`."""
        for t in [*node.input, *node.output]:
            if t and t not in facts.types:
                facts.types[t] = self.type(t)
                facts.constants[t] = None if t in node.output else self.value(t)
        if node.op_type == "Constant" and any(a.name == "value" for a in node.attribute):
            # (its bytes may be a stored tensor, cut out of the loaded model: read from the file)
            return NodeSpec("Constant", node.name, (), tuple(node.output), {"value": self.value(node.output[0])})
        return NodeSpec.of(node)


@dataclass
class Group:
    """Connected nodes only `before` has (`whole`) and only `after` has (`parts`), and the tensors the whole side
    makes for the rest of the model (`ends`, which the rewritten side makes too)."""

    whole: list[onnx.NodeProto]
    parts: list[onnx.NodeProto]
    ends: list[str] = field(default_factory=list)

    @property
    def made(self) -> set[str]:
        return {n.name for n in self.parts}


def groups(before: ModelView, after: ModelView) -> list[Group]:
    """The diff of two models as connected groups of nodes: two nodes of it are in one group where one reads what
    the other makes, or both make the same tensor (a rewrite's side and the whole side it replaced)."""
    def same(a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
        return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)

    whole = [n for n in before.nodes if n.name not in after.by_name or not same(n, after.by_name[n.name])]
    parts = [n for n in after.nodes if n.name not in before.by_name or not same(n, before.by_name[n.name])]
    keys = [("b", n.name) for n in whole] + [("a", n.name) for n in parts]
    parent = {k: k for k in keys}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    by_tensor: dict[str, list] = defaultdict(list)
    for side, nodes in (("b", whole), ("a", parts)):
        made = {o for n in nodes for o in n.output if o}
        for n in nodes:
            for t in [*n.output, *(i for i in n.input if i in made)]:
                if t:
                    by_tensor[t].append((side, n.name))
    for members in by_tensor.values():
        for k in members[1:]:
            parent[find(k)] = find(members[0])
    found: dict = defaultdict(lambda: Group([], []))
    for side, nodes in (("b", whole), ("a", parts)):
        for n in nodes:
            g = found[find((side, n.name))]
            (g.whole if side == "b" else g.parts).append(n)
    out = []
    for g in found.values():
        inside = {n.name for n in g.whole}
        outputs = {o.name for o in before.graph.output}
        g.ends = list(dict.fromkeys(o for n in g.whole for o in n.output if o and (
            o in outputs or any(r.name not in inside for r in before.readers.get(o, [])))))
        out.append(g)
    return out


Roundings = Callable[[bool, str], Rounding]  # (patched?, level) -> ORT's graph of before / after


def refusal(group: Group, before: ModelView, after: ModelView, roundings: Roundings, run: Runner
            ) -> Refuse | None:
    """None when the group's rewritten side gives the whole side's bytes where ORT runs both as in the models;
    `Unshown` when the proof cannot stand for them; a `Refuse` with the level and the difference otherwise."""
    if not group.whole or not group.parts:
        return Unshown("the rewrite only adds or only removes nodes")
    if not before.unique or not after.unique:
        return Unshown("the model's node names are not unique")
    made_after = {o for n in group.parts for o in n.output}
    if not group.ends or any(e not in made_after for e in group.ends):
        return Unshown("the rewritten nodes do not make every tensor the nodes they replace make for the model")
    facts = Facts()
    whole = [before.spec(n, facts) for n in group.whole]
    parts = [after.spec(n, facts) for n in group.parts]
    inside = {n.name for n in group.whole}
    readers = list({r.name: before.spec(r, facts) for e in group.ends for r in before.readers.get(e, [])
                    if r.name not in inside}.values())
    proof = LocalProof(whole, [_Named(e) for e in group.ends], facts, parts=parts, readers=readers, float16=True,
                       opset=before.opset)
    context = context_of(proof, Hood(before, facts), roundings)
    if isinstance(context, Refuse):
        return context
    runs = []
    for level in LEVELS:
        models = side_models(None, proof, parts, *context[level])
        if isinstance(models, Refuse):
            return Unshown(str(models))
        runs.append((level, models, False))
    why = compare_sides(proof, runs, run)
    if why is not None and "max_diff" not in why.details:
        return Unshown(str(why))  # (not run: not disproved)
    return why


@dataclass(frozen=True)
class _Named:
    """A tensor by its name, where a LocalProof names its ends by graph-surgeon tensors."""

    name: str


class Hood:
    """Where a group's neighbours are found: the model without the rewrites (the rewritten side's neighbours are
    the same nodes), each learned into the proof's facts."""

    def __init__(self, view: ModelView, facts: Facts) -> None:
        self.view, self.facts = view, facts

    def producer(self, name: str) -> NodeSpec | None:
        node = self.view.producer.get(name)
        return None if node is None else self.view.spec(node, self.facts)

    def consumers(self, name: str) -> list[NodeSpec]:
        return [self.view.spec(n, self.facts) for n in self.view.readers.get(name, [])]

    def order(self, name: str) -> int:
        return self.view.order.get(name, -1)

    def count(self, name: str) -> int:
        return len(self.view.readers.get(name, []))


def context_of(proof: LocalProof, hood: Hood, roundings: Roundings, rounds: int = 6) -> dict | Refuse:
    """The nodes around the proof, per level: level -> (producers before, readers after, tensors compared, shared,
    those compared through a Cast to float32); see the module docstring. `Unshown` with the first difference where
    they do not get ORT to run the proof's nodes as in the models."""
    parts, readers = proof.parts, proof.readers
    chain = _index_chain(proof, hood)
    if chain is None:
        return Unshown("an integer input of the rewrite is computed where the proof cannot follow it")
    context: dict = {}
    for level in LEVELS:
        original, patched = roundings(False, level), roundings(True, level)
        halo, after, observed = list(chain), list(readers), list(readers)
        if level == "disable":  # no fusion: each node's kernel reads only its inputs, as they are read
            if any(original.read.get((r.name, e)) != patched.read.get((r.name, e))
                   for r in readers for e in r.inputs if e in {t.name for t in proof.ends}):
                return Unshown("the rewrite's readers read its outputs otherwise after it (level 'disable')")
            after, observed = [], []  # compared at the ends: the readers run the same kernels on the same bytes
        found: dict[str, str] = {}
        for _ in range(rounds):
            compared = list(dict.fromkeys(o for r in observed for o in r.outputs if o)) or \
                [t.name for t in proof.ends]
            gone = [o for o in compared if original.made.get(o) is None or original.made[o] != patched.made.get(o)]
            cast = {o for o in compared if original.made.get(o, (TYPED,))[0] != TYPED}
            sides = None if gone else side_models(None, proof, parts, halo, after, compared, hood.count, cast)
            if isinstance(sides, Refuse):
                return Unshown(str(sides))
            found = {o: f"'{o}' is fused away in the model, or written otherwise after the rewrite" for o in gone}
            pairs = [] if sides is None else [(sides[0], proof.whole, original), (sides[1], parts, patched)]
            for (model, inputs), nodes, whole in pairs:
                core = [(s.name, s.inputs, s.outputs) for s in [*nodes, *after]]
                try:
                    found.update(whole.differences(rounding(model, level), core, inputs))
                except Exception as exc:  # noqa: BLE001 (ORT's own errors: the whole-model check decides)
                    return Unshown(f"ORT CPU's graph of the proof could not be read ({str(exc).splitlines()[0]})")
            if not found:
                break
            have = {s.name for s in [*halo, *proof.whole, *parts, *after]}
            given = [t for t, line in found.items() if GIVEN_ROUNDED in line or PAST_PRODUCER in line]
            up = {p.name: p for t in given if (p := hood.producer(t)) is not None and p.name not in have}
            flipped = [s for s in observed if any(o in found for o in s.outputs)]
            down = {c.name: c for s in flipped for o in s.outputs if o for c in hood.consumers(o)
                    if c.name not in have}
            if not observed and any(t.name in found for t in proof.ends):  # the ends, read out: their readers
                down = {r.name: r for r in readers if r.name not in have}
            if not up and not down:
                break
            halo = sorted({s.name: s for s in [*halo, *up.values()]}.values(), key=lambda s: hood.order(s.name))
            after += down.values()
            observed = [s for s in observed if s not in flipped] + list(down.values())
        if found:
            line = next(iter(found.values()))
            return Unshown(f"ORT CPU would run the proof's nodes otherwise than the model's at level '{level}' "
                           f"({line}{f'; {len(found) - 1} more' if len(found) > 1 else ''})",
                           tensor=next(iter(found)), level=level)
        context[level] = (halo, after, compared, hood.count, cast)
    return context


def _index_chain(proof: LocalProof, hood: Hood, limit: int = 64) -> list[NodeSpec] | None:
    """The nodes computing the whole side's integer inputs (a deform block's gather indices) from float tensors
    and stored values, in the model's order: seeded integers would index anywhere, the model's own chain clamps
    them (None: not followed within `limit` nodes)."""
    made = {o for s in proof.whole for o in s.outputs}
    stack = [i for s in proof.whole for i in s.inputs if i and i not in made]
    found: dict[str, NodeSpec] = {}
    while stack:
        t = stack.pop()
        typ = proof.facts.types.get(t)
        if not t or proof.facts.constants.get(t) is not None or (typ is not None and typ[0].kind == "f"):
            continue
        spec = hood.producer(t)
        if spec is None:
            return None
        if spec.name in found:
            continue
        found[spec.name] = spec
        if len(found) > limit:
            return None
        stack.extend(spec.inputs)
    return sorted(found.values(), key=lambda s: hood.order(s.name))

