"""The deformable-conv blocks of a model, found once from its structure: the one block finder.

Why from structure: exported models do not always carry scoped names (the committed fixtures use short ones), so
a block is found by its shape. deform-conv2d-onnx-exporter starts every deformable conv's sampling at a `Floor`
of the sampling coordinates and ends it in the `Conv` that consumes the sampled values:

- `sampling`: every node forward of the Floor, through anything but heavy ops, from which the Conv is reached
  (the index arithmetic, the gathers, the bilinear weights, the weighted sum, the im2col-style reshape);
- `conv` and `tail`: that Conv and the per-channel ops right after it (bias Add, BatchNormalization, Relu);
- `feeders`: what computes the sampling's inputs, walked backward up to heavy ops (the offset and mask paths from
  their Convs, the grid Add, shape computations) and, for the sampled data, its value-moving ops (Pad, Reshape,
  Transpose) only, so that the previous layer is not taken for part of this one.

The region the passes see, the budget's and placement's per-block tables all read these blocks, so a node has the
same block everywhere. A block is labelled by its Conv's name, which a patch never changes (a split Conv's chunks
are named `<conv>/chunk<k>`), so an original model and its patched form line up.

torch's dynamo exporter writes a deformable conv as one ONNX `DeformConv`: that node is a block by itself (its
`conv`, with its feeders and tail). Lowered (passes/deform_conv.py), it becomes a sampling that starts at a Floor
and ends in a `MatMul` named as the DeformConv was; both are labelled `DeformConv '<name>'`.

The passes see a block in their own graph (an onnx_graphsurgeon graph of the lifted region, mutated as they go):
`gather_blocks` finds, from each gather the gathernd / gather_elements passes leave (or an unlowered GatherND),
the part of the sampling a row chunk is carried through, up to the Conv, and `conv_tail` the Conv's per-channel
ops a chunk or a band is carried through after it (the split and bands passes). `find_blocks` walks from the
Floor and labels the whole block; `gather_blocks` walks from the gathers and tells why a block cannot be cut (a
tensor read outside it, an op no chunk is carried through): the same blocks, at two depths.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
import onnx_graphsurgeon as gs

from .ops import (
    BLOCK_GEMMS,
    CONTROL_FLOW,
    DEFORM_CONV,
    ELEMENTWISE_NARY,
    ELEMENTWISE_UNARY,
    EXPORTED_SAMPLERS,
    HEAVY,
    SAMPLERS,
    SAMPLING_START,
    SHAPE_OPS,
    TAIL_OPS,
    TAIL_STEPS,
)
from .shapes import along_rows

if TYPE_CHECKING:
    from .pipeline import Context
    from .shapes import Shapes

FORWARD_LIMIT = 2000  # nodes forward of one start before it is taken for something other than a deform block
_DATA_PATH = {"Pad", "Reshape", "Transpose", "Flatten", "Cast", "Unsqueeze", "Squeeze", "Identity", "Constant"}
_WALK_STOPS = {"Pad", "Shape"}  # a backward walk takes these and does not go past them (their input is a layer's)
_SUBGRAPH = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
_SPLIT_CHUNK = re.compile(r"(/(chunk|group)\d+)+$")  # a split Conv's chunks, a lowered DeformConv's groups
_UNNAMED = re.compile(r"^(onnx::|t_\d)")  # the exporter's generated initializer names


class GraphIndex:
    """A graph's nodes as plain lists (protobuf field access is the cost on 19,000 nodes), with their producers,
    consumers and the nodes that hold subgraphs."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.nodes = list(model.graph.node)
        self.ops = [n.op_type for n in self.nodes]
        self.ins = [list(n.input) for n in self.nodes]
        self.outs = [list(n.output) for n in self.nodes]
        self.consumers: dict[str, list[int]] = defaultdict(list)
        self.producer: dict[str, int] = {}
        for k, names in enumerate(self.ins):
            for i in names:
                self.consumers[i].append(k)
        for k, names in enumerate(self.outs):
            for o in names:
                self.producer[o] = k
        self.consumers.pop("", None)
        self.producer.pop("", None)
        self.initializers = {t.name for t in model.graph.initializer}
        self.nested = {k for k, n in enumerate(self.nodes)
                       if (self.ops[k] in CONTROL_FLOW or n.domain not in ("", "ai.onnx"))
                       and any(a.type in _SUBGRAPH for a in n.attribute)}

    def name(self, k: int) -> str:
        """A node's name, or its first output's for an unnamed node."""
        return self.nodes[k].name or self.outs[k][0]

    def tail(self, conv: int) -> tuple[int, ...]:
        """The per-channel ops right after `conv`, each the only reader of the one before."""
        tail, k = [], conv
        for _ in range(TAIL_STEPS):
            names = [o for o in self.outs[k] if o]
            if len(names) != 1 or len(self.consumers.get(names[0], ())) != 1:
                break
            k = self.consumers[names[0]][0]
            if self.ops[k] not in TAIL_OPS:
                break
            tail.append(k)
        return tuple(tail)


@dataclass(frozen=True)
class DeformBlock:
    """One deformable conv (see the module docstring); node sets are indices into `GraphIndex.nodes`."""

    label: str
    start: int
    conv: int | None
    sampling: frozenset[int]
    tail: tuple[int, ...]
    feeders: frozenset[int]
    conv_name: str | None = None  # the name of the Conv it ends in, as its label gives it (None: no Conv)

    @property
    def nodes(self) -> frozenset[int]:
        return self.sampling | self.feeders | set(self.tail) | ({self.conv} if self.conv is not None else set())


def block_conv_name(name: str) -> str:
    """The name a block is labelled by: a split Conv's chunks keep their original Conv's name before `/chunk<k>`,
    a lowered DeformConv's per-group MatMuls before `/group<k>`."""
    return _SPLIT_CHUNK.sub("", name)


def find_blocks(index: GraphIndex) -> list[DeformBlock]:
    """Every deform block, in graph order of its start. A start is a `Floor`, or an exported sampler that no Floor
    reaches; its forward walk must reach a sampler and stay under `FORWARD_LIMIT` nodes."""
    found: dict[str, tuple[int, int | None, set[int]]] = {}  # label -> start, conv, sampling
    covered: set[int] = set()
    for k, op in enumerate(index.ops):
        if op == DEFORM_CONV and k not in index.nested:
            found[_label(index, k)] = (k, k, set())
            continue
        if (op != SAMPLING_START and op not in EXPORTED_SAMPLERS) or k in covered or k in index.nested:
            continue
        walk = _forward(index, k)
        if walk is None or not any(index.ops[n] in SAMPLERS for n in walk):
            continue
        covered |= walk
        convs = [n for gemm in BLOCK_GEMMS for n in sorted(walk) if index.ops[n] == gemm]  # a Conv first
        conv = convs[0] if convs else None
        sampling = _reaching(index, walk, conv) if conv is not None else walk
        label = _label(index, conv) if conv is not None else f"{op} '{index.name(k)}'"
        if label in found:  # a second Floor (or sampler) of the same deformable conv
            found[label][2].update(sampling)
        else:
            found[label] = (k, conv, set(sampling))
    return [DeformBlock(label, start, conv, frozenset(sampling), index.tail(conv) if conv is not None else (),
                        _feeders(index, frozenset(sampling or {start})), _conv_name(index, conv))
            for label, (start, conv, sampling) in found.items()]


def _conv_name(index: GraphIndex, conv: int | None) -> str | None:
    """The name a block's Conv (or a q8 file's ConvInteger) is labelled by; None for a DeformConv or no Conv."""
    if conv is None or index.ops[conv] not in ("Conv", "ConvInteger"):
        return None
    return block_conv_name(index.name(conv))


def _label(index: GraphIndex, conv: int) -> str:
    """`Conv '<name>'`, with its weight's name when the exporter kept the module's (`Conv 'Conv_1004'` alone says
    little; `(decoder_blocks.0.dec_att.aspp_deforms.2.atrous_conv.weight)` says which layer)."""
    op = index.ops[conv]
    slot = 0 if op == "MatMul" else 1
    weight = index.ins[conv][slot] if len(index.ins[conv]) > slot else ""
    for _ in range(2 if op == "MatMul" else 0):  # the lowered DeformConv's weight, reshaped (and its group picked)
        k = index.producer.get(weight)
        if k is not None and index.ops[k] in ("Reshape", "Gather"):
            weight = index.ins[k][0]
    named = weight in index.initializers and not _UNNAMED.match(weight)
    kind = "Conv" if op in ("Conv", "ConvInteger") else DEFORM_CONV  # a q8 file's ConvInteger: the exporter's Conv
    return f"{kind} '{block_conv_name(index.name(conv))}'" + (f" ({weight})" if named else "")


@dataclass(frozen=True)
class ModelBlocks:
    """A model's deform blocks by name: which block each node belongs to, and the Conv each block ends in."""

    owner: dict[str, str]  # node name -> block label (the first block wins a shared node)
    convs: dict[str, str]  # block label -> the name of the Conv it ends in (blocks without one: absent)


def model_blocks(model: onnx.ModelProto) -> ModelBlocks:
    """The deform blocks of `model` by name (`ModelBlocks`)."""
    index = GraphIndex(model)
    owner: dict[str, str] = {}
    convs: dict[str, str] = {}
    for block in find_blocks(index):
        for k in sorted(block.nodes):
            owner.setdefault(index.name(k), block.label)
        if block.conv_name is not None:
            convs[block.label] = block.conv_name
    return ModelBlocks(owner, convs)


def deform_blocks(model: onnx.ModelProto) -> dict[str, str]:
    """Map node name -> block label for every node of every deform block (the first block wins a shared node)."""
    return model_blocks(model).owner


def _forward(index: GraphIndex, start: int) -> set[int] | None:
    """`start` and the nodes forward of it, through anything but heavy ops, and the Convs where the walk stops."""
    seen = {start}
    stack = [start]
    while stack:
        k = stack.pop()
        # a q8 file's DynamicQuantizeLinear: its scale and zero point go to the conv's dequantization (its tail),
        # past which the walk would run into the next layers
        outs = index.outs[k][:1] if index.ops[k] == "DynamicQuantizeLinear" else index.outs[k]
        for o in outs:
            for c in index.consumers.get(o, ()):
                if c in seen or c in index.nested:
                    continue
                if index.ops[c] in HEAVY and index.ops[c] not in BLOCK_GEMMS:
                    continue
                seen.add(c)
                if len(seen) > FORWARD_LIMIT:
                    return None
                if index.ops[c] not in BLOCK_GEMMS:
                    stack.append(c)
    return seen


def _reaching(index: GraphIndex, walk: set[int], conv: int) -> set[int]:
    """The nodes of `walk` from which `conv` is reached inside the walk (the Conv excluded)."""
    keep: set[int] = set()
    stack = [i for i in index.ins[conv] if i]
    while stack:
        k = index.producer.get(stack.pop())
        if k is None or k in keep or k not in walk or index.ops[k] in BLOCK_GEMMS:
            continue
        keep.add(k)
        stack.extend(i for i in index.ins[k] if i)
    return keep


def _feeders(index: GraphIndex, sampling: frozenset[int]) -> frozenset[int]:
    """What computes the sampling's inputs (module docstring): up to heavy ops, only value movers for the data."""
    out: set[int] = set()
    stack: list[tuple[str, bool]] = []
    for k in sampling:
        data_slot = 0 if index.ops[k] in SAMPLERS or index.ops[k] == DEFORM_CONV else -1
        stack.extend((i, slot == data_slot) for slot, i in enumerate(index.ins[k]) if i)
    while stack:
        name, data = stack.pop()
        p = index.producer.get(name)
        if p is None or p in out or p in sampling or p in index.nested or index.ops[p] in HEAVY:
            continue
        if data and index.ops[p] not in _DATA_PATH:
            continue
        out.add(p)
        if index.ops[p] not in _WALK_STOPS:
            stack.extend((i, data) for i in index.ins[p] if i)
    return frozenset(out)


_ORT_CAST_PREFIX = "InsertedPrecisionFreeCast_"  # ORT's casts around CPU fp16 islands, named after their tensor


def block_of(name: str, owner: dict[str, str], tensors: dict[str, str] | None = None) -> str | None:
    """The block of a node name as ORT reports it: ORT-made nodes keep their origin's name before a '/', and the
    casts ORT inserts around CPU fp16 islands are named after the tensor they convert."""
    if tensors is not None and name.startswith(_ORT_CAST_PREFIX):
        return tensors.get(name[len(_ORT_CAST_PREFIX):])
    while name:
        if name in owner:
            return owner[name]
        if "/" not in name:
            return None
        name = name.rsplit("/", 1)[0]
    return None


def tensor_blocks(model: onnx.ModelProto, owner: dict[str, str]) -> dict[str, str]:
    """Map tensor name -> block, for tensors produced or consumed inside a block (for Memcpy attribution)."""
    out: dict[str, str] = {}
    for n in model.graph.node:
        label = owner.get(n.name)
        if label is not None:
            for t in [*n.input, *n.output]:
                out.setdefault(t, label)
    return out


OUTSIDE = "outside deform blocks"


def count_per_block(model: onnx.ModelProto, cpu_nodes: Iterable[str],
                    memcpy_tensors: Iterable[str]) -> dict[str, tuple[int, int]]:
    """(CPU nodes, Memcpy nodes) per deform block of `model`, from the node and tensor names ORT's log gives, with
    every block listed (zeros included) and `OUTSIDE` for the rest: the table `placement --compare` prints."""
    owner = deform_blocks(model)
    tensors = tensor_blocks(model, owner)
    counts = {label: [0, 0] for label in [*owner.values(), OUTSIDE]}
    for name in cpu_nodes:
        counts[block_of(name, owner, tensors) or OUTSIDE][0] += 1
    for t in memcpy_tensors:
        counts[tensors.get(t, OUTSIDE)][1] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


# -- a block in a pass's graph --------------------------------------------------------------------------------------
GATHERS = {"Gather", "GatherND"}  # the samplers as the gathernd / gather_elements passes leave them
CARRIED = ELEMENTWISE_UNARY | ELEMENTWISE_NARY | SHAPE_OPS | {"Transpose"}  # what a chunk is carried through
MAX_BLOCK_NODES = 400
# why a DynamicQuantizeLinear (the 8-bit files') stops a split: chunks would each need the whole tensor's scale
_WHOLE_SCALE = (" (it quantizes the whole tensor with one scale made from its min and max; a min and max of the "
                "chunks equal ORT's only for inputs without NaN, where ORT's SIMD min/max depends on lanes and "
                "threads, so no exact split is proven)")


@dataclass
class GatherBlock:
    """The gathers of one deform block and what they feed, up to the Conv, in a pass's graph. `rows`, `layout` and
    `side` are where the Conv's output rows lie in each of its tensors, filled in by the split pass's row walk."""

    conv: gs.Node | None  # None: the gathers reach no one Conv (`gather_blocks` says why)
    seeds: list[gs.Node]
    nodes: list[gs.Node]  # topological order, seeds included, Conv excluded
    sink: gs.Tensor | None  # the Conv's input
    rows: int = 0  # h: the Conv's output rows
    layout: dict | None = None  # region tensor name -> split.Rows
    side: dict | None = None  # (node index, input slot) -> split.Rows of a side input (None: read whole)


def gather_blocks(graph: gs.Graph) -> list[tuple[GatherBlock, str | None]]:
    """Every gather group with the Conv it feeds; the reason no row chunk can be carried through it, or None."""
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    outputs = {id(t) for t in graph.outputs}
    by_conv: dict[int, GatherBlock] = {}
    found: list[tuple[GatherBlock, str | None]] = []
    for seed in [n for n in graph.nodes if n.op in GATHERS]:
        nodes, conv, why = _cone(seed, outputs)
        if conv is None:
            found.append((GatherBlock(None, [seed], nodes, None), why))
            continue
        block = by_conv.get(id(conv))
        if block is None:
            block = by_conv[id(conv)] = GatherBlock(conv, [], [], conv.inputs[0])
        block.seeds.append(seed)
        known = {id(n) for n in block.nodes}
        block.nodes.extend(n for n in nodes if id(n) not in known)
    for block in by_conv.values():
        block.nodes.sort(key=lambda n: order[id(n)])
        found.append((block, _escape(block)))
    return found


def _cone(seed: gs.Node, graph_outputs: set[int]) -> tuple[list[gs.Node], gs.Node | None, str | None]:
    """Nodes from `seed` forward through carried ops to the one Conv they feed, or the reason there is none."""
    nodes: list[gs.Node] = []
    seen: set[int] = set()
    convs: dict[int, gs.Node] = {}
    stack = [seed]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        if len(nodes) > MAX_BLOCK_NODES:
            return nodes, None, f"more than {MAX_BLOCK_NODES} nodes between the gather and a Conv"
        for out in n.outputs:
            if id(out) in graph_outputs:
                return nodes, None, f"'{out.name}' is a graph output"
            for c in out.outputs:
                if c.op == "Conv" and c.inputs[0] is out:
                    convs[id(c)] = c
                elif c.op in CARRIED:
                    stack.append(c)
                else:
                    return nodes, None, (f"'{out.name}' is read by {c.op} '{c.name}', which the split cannot "
                                         "carry a chunk through" + (_WHOLE_SCALE if c.op == "DynamicQuantizeLinear"
                                                                    else ""))
    if len(convs) != 1:
        return nodes, None, ("the gathered values reach no Conv" if not convs
                             else "the gathered values reach more than one Conv")
    return nodes, next(iter(convs.values())), None


def _escape(block: GatherBlock) -> str | None:
    """A block tensor used outside the block would still be needed whole: such a block is refused."""
    inside = {id(n) for n in block.nodes} | {id(block.conv)}
    for n in block.nodes:
        for out in n.outputs:
            for c in out.outputs:
                if id(c) not in inside:
                    return f"'{out.name}' is also read by {c.op} '{c.name}' outside the block"
    return None


def conv_tail(ctx: Context, conv: gs.Node, shapes: Shapes) -> list[gs.Node]:
    """The per-channel ops after a Conv (the exporter's bias Add, BatchNormalization, Relu) that a row chunk or band
    is carried through when the Conv itself is cut (the split and bands passes); `GraphIndex.tail` in a model.

    Why: ORT CPU folds a Conv's bias Add and BatchNormalization into the Conv (ConvAddFusion, ConvBNFusion at level
    `basic`), which changes how it rounds. A Concat between the chunk Convs and the Add would stop that fusion and
    change the bytes; carrying the chains per chunk lets each chunk fuse exactly as the whole did. Only ops whose
    other inputs are constants broadcast along the rows are carried.
    """
    outputs = {id(t) for t in ctx.graph.outputs}
    t, shape, tail = conv.outputs[0], shapes.shape(conv.outputs[0]), []
    while shape is not None and id(t) not in outputs and len(t.outputs) == 1:
        n = t.outputs[0]
        if len(n.outputs) != 1 or n.op not in TAIL_OPS or (n.op == "BatchNormalization" and n.inputs[0] is not t):
            break
        side = [i for i in n.inputs if i is not t and i.name]
        if any(ctx.prover.constant(i) is None for i in side):
            break
        if n.op != "BatchNormalization" and not all(along_rows(shape, ctx.prover.constant(i).shape) for i in side):
            break
        tail.append(n)
        t = n.outputs[0]
    return tail
