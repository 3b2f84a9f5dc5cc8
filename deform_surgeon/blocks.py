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
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from .ops import (
    BLOCK_GEMMS,
    CONTROL_FLOW,
    DEFORM_CONV,
    EXPORTED_SAMPLERS,
    HEAVY,
    SAMPLERS,
    SAMPLING_START,
    TAIL_OPS,
    TAIL_STEPS,
)

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
                        _feeders(index, frozenset(sampling or {start})))
            for label, (start, conv, sampling) in found.items()]


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


def deform_blocks(model: onnx.ModelProto) -> dict[str, str]:
    """Map node name -> block label for every node of every deform block (the first block wins a shared node)."""
    index = GraphIndex(model)
    owner: dict[str, str] = {}
    for block in find_blocks(index):
        for k in sorted(block.nodes):
            owner.setdefault(index.name(k), block.label)
    return owner


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
