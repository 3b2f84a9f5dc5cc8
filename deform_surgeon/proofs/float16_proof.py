"""Show float16 rewrites exact on the nodes around them, at the cost of those nodes, not of the whole model.

Why a proof of its own: in a float16 model ORT CPU decides where values are rounded to float16 from the graph
around each node (passes/cut_and_join.py, proofs/precision.py), so a rewrite run on its own, its inputs given as float16
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

* **from the Conv's input** where the group holds a split block whose Conv is split too (`cut_at_conv_inputs`):
  the nodes before the Conv compute each element in the chunks as in the whole block, which ORT's graphs of both
  models are held to, so the proof runs the Conv part alone on a seeded input (on the real BiRefNet-lite 1024
  fp16 the whole 7x7 block's side took 3.3 GB; its Conv part 1.9 GB), and the whole group where that cannot be
  shown.

A group whose context does not get there is `Unshown`: neither shown exact nor disproved, it is left to the
whole-model check. A group whose sides differ is disproved, with the level and the difference.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..base.scratch import TmpdirFull
from ..graph.pipeline import Refuse
from .local_proof import LEVELS, Facts, LocalProof, NodeSpec, Runner, compare_sides, side_models
from .precision import GIVEN_ROUNDED, PAST_PRODUCER, TYPED, Rounding, rounding


class Unshown(Refuse):
    """A proof that cannot stand for the model (ORT would run its nodes otherwise than in the model): the rewrites
    it covers are neither shown exact nor disproved, and are left to the whole-model check."""


class ModelView:
    """A model file read for proofs: its nodes by name, who makes and reads each tensor, their types (the file's
    own declarations first, then shape inference of its skeleton, contrib ops included) and the values of its
    stored tensors and Constant nodes, read from the file when asked (files: no weight is loaded whole)."""

    def __init__(self, path: str | Path) -> None:
        from ..files import infer_value_types, load_model

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


@dataclass(frozen=True)
class Verdict:
    """A group's proof: `why` it is not shown exact (None: it is; `Unshown`: the proof cannot stand for the
    models), and the split Convs' inputs it started at (`cut_at_conv_inputs`; empty: the whole group was run)."""

    why: Refuse | None
    starts_at: tuple[str, ...] = ()
    threads: tuple[int, ...] = ()  # the intra-op thread counts its sides were compared at (none: nothing was run)


def verdict(group: Group, before: ModelView, after: ModelView, roundings: Roundings, run: Runner,
            rows: Rows | None = None) -> Verdict:
    """Whether the group's rewritten side gives the whole side's bytes where ORT runs both as in the models: a
    `Verdict` whose `why` is None when it does, `Unshown` when the proof cannot stand for them, a `Refuse` with the
    level and the difference otherwise. `rows` (chunk input -> (whole Conv input, axis, first row, end row),
    `RunState.rows`): split blocks whose proof may start at their Conv's input (`cut_at_conv_inputs`); where that
    proof cannot stand for the models, the whole group is proven as it is."""
    cut = cut_at_conv_inputs(group, before, after, rows or {}, roundings)
    ran: set[int] = set()
    if cut is not None:
        starts = tuple(dict.fromkeys(r[0] for r in cut[1].values()))
        if not cut[0].whole and _joined_as_made(*cut, before, after, roundings):
            return Verdict(None, starts)
        why = refusal(*cut, before, after, roundings, run, ran)
        if not isinstance(why, Unshown):
            return Verdict(why, starts, tuple(sorted(ran)))
    why = refusal(group, {}, before, after, roundings, run, ran)
    return Verdict(why, threads=tuple(sorted(ran)))


def _joined_as_made(group: Group, rows: Rows, before: ModelView, after: ModelView, roundings: Roundings) -> bool:
    """Whether what is left of a group cut at its Conv's input (`cut_at_conv_inputs`) is only the join of the
    chunks' Conv inputs into the whole one, which the rest of the model reads as it read the whole block's: one
    Concat of the chunks in row order along their axis, covering every row; its output written in the same form by
    both graphs at each level (as typed, or in float32; in the plain layout, not ORT's NCHWc) and read in the same
    form by every reader at level `disable`; every reader's outputs written as before at each level. (A block whose
    Conv stays whole: nothing is left to run; the chunks' elements are the whole block's, and a Concat moves
    them.)"""
    if len(group.parts) != 1 or group.parts[0].op_type != "Concat" or list(group.parts[0].output) != group.ends:
        return False
    join, (end,) = group.parts[0], group.ends
    spans = [rows.get(x) for x in join.input]
    axis = next((a.i for a in join.attribute if a.name == "axis"), None)
    typ = before.type(end)
    if typ is None or any(s is None or s[0] != end or s[1] != axis for s in spans) or \
            [s[2] for s in spans] != [0, *(s[3] for s in spans[:-1])] or spans[-1][3] != typ[1][axis]:
        return False
    for level in LEVELS:
        original, patched = roundings(False, level), roundings(True, level)
        made = original.made.get(end), patched.made.get(end)  # (by the whole block's last node, by the Concat)
        if None in made or made[0][0] != made[1][0] or any("nchwc" in op.lower() for _, op in made):
            return False  # (a plain tensor in both: its readers choose their kernels on the same input layout)
        readers = before.readers.get(end, [])
        if any(original.made.get(o) != patched.made.get(o) for r in readers for o in r.output if o):
            return False  # (a reader fused or run otherwise after the join)
        if level == "disable" and any(original.read.get((r.name, end)) != patched.read.get((r.name, end))
                                      for r in readers):
            return False
    return True


def refusal(group: Group, parts_inputs: Rows, before: ModelView, after: ModelView, roundings: Roundings,
            run: Runner, ran: set[int] | None = None) -> Refuse | None:
    """The group's proof as it is (`parts_inputs`: rewritten-side inputs that hold rows of a whole-side input);
    the thread counts its sides ran at are added to `ran`."""
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
                       opset=before.opset, parts_inputs=dict(parts_inputs))
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
    if ran is not None:
        ran.update(proof.threads)
    if why is not None and "max_diff" not in why.details:
        return Unshown(str(why))  # (not run: not disproved)
    return why


Rows = dict[str, tuple[str, int, int, int]]  # chunk input -> (whole input, axis, first row, end row)

# ops each of whose output elements is its input elements moved, or one correctly rounded operation of them: the
# same bytes for an element whatever else the tensor holds (how many rows, which chunk)
MOVEMENT = {"Pad", "Slice", "Gather", "GatherND", "GatherElements", "Reshape", "Concat", "Identity", "Squeeze",
            "Unsqueeze", "Flatten", "Transpose", "Expand"}
PER_ELEMENT = MOVEMENT | {"Cast", "Mul", "Add", "Sub", "Div", "Neg", "Abs", "Floor", "Ceil", "Clip", "Min", "Max",
                          "Where", "Relu", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And",
                          "Or", "IsNaN", "Constant"}
SHAPE_INPUTS = {("Reshape", 1), ("Expand", 1), ("Slice", 1), ("Slice", 2), ("Slice", 3), ("Slice", 4),
                ("Squeeze", 1), ("Unsqueeze", 1), ("Pad", 1)}  # integer inputs that say a shape, not values
_CHUNK = re.compile(r"(.+)/chunk(\d+)")


def cut_at_conv_inputs(group: Group, before: ModelView, after: ModelView, rows: Rows, roundings: Roundings
                       ) -> tuple[Group, Rows] | None:
    """The group without the nodes that only compute its split Convs' inputs, those inputs given instead (the
    whole Conv's input, and each chunk's rows of it: `rows`), or None where that does not stand for the models.

    Why: a split deform block's whole side holds the block's largest tensors (on the real BiRefNet-lite 1024 fp16
    the 7x7 block's float32 sums: 3.3 GB in ORT), and its bytes up to the Conv's input are the same element by
    element in the chunks: every node there moves elements or computes each from its own inputs with one
    correctly rounded operation (`PER_ELEMENT`), in the same order on each, so an element's bytes do not depend
    on which rows the tensor holds. What the kernels may choose by shape is the Conv's summation order, which the
    proof still measures, and where ORT CPU rounds, which is held to its graphs here: each chunk's node
    (`<node>/chunk<k>`) runs as its whole node does (writes its outputs in the same form, by the same kind of node,
    at each level; reads its inputs in the same form at level `disable`), reads the same tensor, its own chunk of
    it, or rows cut from it by nodes that only move elements and never round a tensor the model holds unrounded
    (`_alike`). This is the argument the float32 proofs of a split block make by construction (their proof is the
    Conv and its tail, local_proof.py); here ORT's roundings are checked as well."""
    made_b = {o: n for n in group.whole for o in n.output if o}
    made_a = {o: n for n in group.parts for o in n.output if o}
    cut = {x: r for x, r in rows.items() if x in made_a and r[0] in made_b}
    if not cut:
        return None
    drop_b = _feeding_only(group.whole, {r[0] for r in cut.values()}, before)
    drop_a = _feeding_only(group.parts, set(cut), after)
    if drop_b is None or drop_a is None or not _alike(drop_b, drop_a, after, roundings):
        return None
    return Group([n for n in group.whole if n.name not in drop_b], [n for n in group.parts if n.name not in drop_a],
                 group.ends), cut


def _feeding_only(nodes: list[onnx.NodeProto], sinks: set[str], view: ModelView
                  ) -> dict[str, onnx.NodeProto] | None:
    """The nodes of `nodes` whose outputs are read only on the way to `sinks` (by name); None where a sink's own
    producer is read otherwise too."""
    by_output = {o: n for n in nodes for o in n.output if o}
    found: dict[str, onnx.NodeProto] = {}
    stack = list(sinks)
    while stack:
        n = by_output.get(stack.pop())
        if n is not None and n.name not in found:
            found[n.name] = n
            stack.extend(i for i in n.input if i)
    outputs = {o.name for o in view.graph.output}
    changed = True
    while changed:
        changed = False
        for name, n in list(found.items()):
            if any(o and o not in sinks and (o in outputs or any(r.name not in found for r in view.readers.get(o, [])))
                   for o in n.output):
                del found[name]
                changed = True
    return found if all(by_output[s].name in found for s in sinks) else None


def _alike(drop_b: dict[str, onnx.NodeProto], drop_a: dict[str, onnx.NodeProto], after: ModelView,
           roundings: Roundings) -> bool:
    """Whether the chunks' nodes `drop_a` compute their elements as the whole nodes `drop_b` do (see
    `cut_at_conv_inputs`)."""
    if any(n.op_type not in PER_ELEMENT for n in [*drop_b.values(), *drop_a.values()]):
        return False
    copies = {}
    for n in drop_a.values():
        m = _CHUNK.fullmatch(n.name)
        whole = drop_b.get(m.group(1)) if m else None
        if whole is not None:
            if whole.op_type != n.op_type or list(whole.attribute) != list(n.attribute) or \
                    len(whole.input) != len(n.input) or len(whole.output) != len(n.output):
                return False
            copies[n.name] = (whole, m.group(2))
        elif n.op_type not in MOVEMENT:
            return False
    for level in LEVELS:
        original, patched = roundings(False, level), roundings(True, level)
        for name, (whole, k) in copies.items():
            copy = drop_a[name]
            # (a node both graphs drop: a Cast of the pairs ORT removes, a Transpose its layout optimizer moves,
            # the same in both and changing no value; another node gone is fused with others: not followed here)
            if any(original.made.get(w) != patched.made.get(c) or (original.made.get(w) is None and
                                                                   whole.op_type not in MOVEMENT | {"Cast"})
                   for w, c in zip(whole.output, copy.output, strict=True)):
                return False
            for slot, (w, c) in enumerate(zip(whole.input, copy.input, strict=True)):
                if c == w or c == f"{w}/chunk{k}":
                    if level == "disable" and original.read.get((whole.name, w)) != patched.read.get((name, c)):
                        return False
                elif (copy.op_type, slot) in SHAPE_INPUTS and _integer_constant(after, c):
                    continue
                elif _cut_root(c, drop_a, copies, patched, original) not in (w, f"{w}/chunk{k}"):
                    return False
    return True


def _cut_root(name: str, drop_a: dict[str, onnx.NodeProto], copies: dict, patched: Rounding, original: Rounding
              ) -> str | None:
    """The tensor `name` holds rows of, through nodes of `drop_a` that only move elements (a Pad, Gather or Slice
    of rows, a Reshape), or None where one of them rounds what the model holds unrounded (a float32 tensor
    written as typed float16)."""
    by_output = {o: n for n in drop_a.values() for o in n.output if o}
    for _ in range(len(drop_a) + 1):
        n = by_output.get(name)
        if n is None or n.name in copies:
            return name
        if not n.input:  # (a Constant: rows of nothing)
            return None
        data = n.input[0]
        held = patched.made.get(data, original.made.get(data, (TYPED, "")))
        if held[0] != TYPED and patched.made.get(name, (TYPED, ""))[0] == TYPED:
            return None
        name = data
    return None


def _integer_constant(view: ModelView, name: str) -> bool:
    typ = view.type(name)
    return typ is not None and typ[0].kind in "iu" and view.value(name) is not None


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
                    found.update(whole.differences(rounding(model, level, what="ORT CPU's graph of a proof"), core,
                                                   inputs))
                except TmpdirFull:
                    raise
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

