"""Which nodes belong to which deformable-conv block, found from the graph's structure.

Why: placement numbers matter per deform block ("is anything of this block still on the CPU?"), and exported
models do not always carry scoped names (the committed fixtures use short ones), so blocks are found by their
shape instead: every deformable conv starts its sampling at a `Floor` of the sampling coordinates and ends in
the `Conv` that consumes the sampled values. A block is everything reachable forward from such a Floor before
that Conv, plus the value-moving ops that feed it (Pad/Reshape/Transpose of the data, the grid + offset Add).
The block is labelled by its Conv's name, which a patch never changes, so original and patched line up.
"""

from __future__ import annotations

import re
from collections import defaultdict

import onnx

_SAMPLERS = {"GatherND", "GatherElements", "Gather"}
_FEEDERS = {"Pad", "Reshape", "Transpose", "Flatten", "Cast", "Unsqueeze", "Squeeze", "Identity", "Constant"}


_SPLIT_CHUNK = re.compile(r"/chunk\d+$")


def block_conv_name(name: str) -> str:
    """The name a block is labelled by: the split pass names its row-chunk Convs `<conv>/chunk<k>`, and the
    block keeps its original Conv's name, so a split model lines up with the unsplit one."""
    return _SPLIT_CHUNK.sub("", name)


def deform_blocks(model: onnx.ModelProto) -> dict[str, str]:
    """Map node name -> block label (`Conv 'name'`) for every node of every deformable-conv block."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in nodes:
        for i in n.input:
            consumers[i].append(n)
    order = {id(n): k for k, n in enumerate(nodes)}
    owner: dict[str, str] = {}
    for floor in (n for n in nodes if n.op_type == "Floor"):
        region: dict[int, onnx.NodeProto] = {}
        convs: list[onnx.NodeProto] = []
        stack = [floor]
        while stack:
            n = stack.pop()
            if id(n) in region:
                continue
            region[id(n)] = n
            for o in n.output:
                for c in consumers[o]:
                    (convs if c.op_type == "Conv" else stack).append(c)
        if not any(n.op_type in _SAMPLERS for n in region.values()):
            continue  # a Floor that samples nothing (e.g. a size computation)
        feeders = [producer[i] for n in region.values() for i in n.input if i in producer]
        while feeders:
            f = feeders.pop()
            grid_add = f.op_type == "Add" and any(o in floor.input for o in f.output)
            if id(f) in region or not (f.op_type in _FEEDERS or grid_add):
                continue
            region[id(f)] = f
            feeders.extend(producer[i] for i in f.input if i in producer)
        first = min(convs, key=lambda c: order[id(c)]) if convs else None
        label = f"Conv '{block_conv_name(first.name)}'" if first is not None else f"Floor '{floor.name}'"
        for n in region.values():
            owner.setdefault(n.name, label)
    return owner


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
