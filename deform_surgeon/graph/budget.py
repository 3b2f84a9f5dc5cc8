"""GPU buffer budget: which tensors of a model are larger than a WebGPU device lets a buffer (or a binding) be.

Why: a WebGPU buffer larger than the device's `maxBufferSize` is an error (ORT cannot create it), and one larger
than `maxStorageBufferBindingSize` can only be bound in segments, which only newer ORT builds do. The spec's
defaults, which a device is guaranteed to offer, are 256 MiB and 128 MiB; real adapters often allow more (the
limits come from a device profile, see device.py). With a profile's `maxStorageBuffersPerShaderStage`, the nodes
whose kernels bind more storage buffers than that are listed too: those fail at run time on such a device.

Sizes come from the type table `patch` reads (files's `check_and_infer`: one strict shape inference with data
propagation that is also the checker's, the Swin blocks' pads to whole windows evaluated; static shapes only), so
`budget` sees every size `patch` sees; a tensor whose shape is not known is counted as unknown, never guessed.
Each large tensor is named with the node that produces it and the deformable-conv block it belongs to (the Conv
that consumes the block's sampling, as exported by deform-conv2d-onnx-exporter), because that is where the split
pass (`patch --max-buffer`) can act.

The peak is an estimate of the activations alive at once when the nodes run in a depth-first order (a post-order
walk back from the graph outputs, a node's inputs lowest index first: a split block then runs chunk after chunk;
the order `patch` writes a chunked model's nodes in) and every tensor lives from its producer to its last consumer:
no buffer reuse or aliasing is assumed (ORT may alias a Reshape's output with its input), so it is an upper bound
for that order, not a measurement. ONNX Runtime's own default order is the same walk taking a node's inputs
highest index first (and the last output first), its mirror image; the report gives the peak in that order and in
the file's own order too.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..base.sizes import human, parse_size  # noqa: F401 (the sizes every report and option use; imported from here too)
from ..files import TypeTable, Weights, check_and_infer, infer_value_types, load_model
from .blocks import model_blocks
from .device import SPEC_DEFAULT_LIMITS
from .device import storage_buffers as bindings

SPEC_MAX_BUFFER = SPEC_DEFAULT_LIMITS["maxBufferSize"]
SPEC_MAX_BINDING = SPEC_DEFAULT_LIMITS["maxStorageBufferBindingSize"]

class _Record:
    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TensorSize(_Record):
    name: str
    nbytes: int
    dtype: str
    shape: list[int]
    producer: str  # "<Op> '<name>'", "graph input" or "initializer"
    block: str | None  # the deformable-conv block (its Conv) the tensor belongs to, if any
    kind: str  # activation | input | initializer


@dataclass
class NodeBuffers(_Record):
    """A node whose kernel binds more storage buffers than the device allows in one shader stage."""

    node: str
    op: str
    buffers: int
    limit: int
    block: str | None


@dataclass
class BudgetReport:
    model: str
    max_buffer: int
    max_binding: int
    limits_source: str
    over_buffer: list[TensorSize] = field(default_factory=list)
    over_binding: list[TensorSize] = field(default_factory=list)  # over the binding size, within the buffer size
    largest: list[TensorSize] = field(default_factory=list)
    tensors_known: int = 0
    tensors_unknown: int = 0
    unknown_examples: list[str] = field(default_factory=list)
    peak_bytes: int = 0
    peak_node: str | None = None
    peak_live: list[TensorSize] = field(default_factory=list)
    peak_blocks: dict[str, int] = field(default_factory=dict)  # deform block -> bytes of its tensors live at the peak
    block_convs: dict[str, str] = field(default_factory=dict)  # deform block -> the Conv it ends in (by name)
    # the same measure with the nodes run in the file's own order (a runtime that follows it: not ORT's default)
    peak_file_bytes: int = 0
    peak_ort_bytes: int = 0  # ... and in ORT's own default order (`execution_order(highest_first=True)`)
    blocks: int = 0
    storage_buffers: int | None = None  # maxStorageBuffersPerShaderStage checked (None: not checked)
    over_storage: list[NodeBuffers] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.over_buffer and not self.over_storage

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "limits": {"max_buffer": self.max_buffer, "max_binding": self.max_binding,
                       "storage_buffers": self.storage_buffers, "source": self.limits_source},
            "ok": self.ok,
            "over_buffer": [t.to_dict() for t in self.over_buffer],
            "over_binding": [t.to_dict() for t in self.over_binding],
            "largest": [t.to_dict() for t in self.largest],
            "tensors_known": self.tensors_known,
            "tensors_unknown": self.tensors_unknown,
            "unknown_examples": self.unknown_examples,
            "peak": {"bytes": self.peak_bytes, "node": self.peak_node,
                     "live": [t.to_dict() for t in self.peak_live], "blocks": self.peak_blocks,
                     "file_order_bytes": self.peak_file_bytes, "ort_order_bytes": self.peak_ort_bytes},
            "deform_blocks": self.blocks,
            "over_storage_buffers": [n.to_dict() for n in self.over_storage],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def format(self, limit_rows: int = 40) -> str:
        lines = [f"model: {self.model}",
                 f"limits: maxBufferSize {human(self.max_buffer)}, maxStorageBufferBindingSize "
                 f"{human(self.max_binding)} ({self.limits_source})",
                 f"tensors: {self.tensors_known} of known size, {self.tensors_unknown} unknown"
                 + (f" (e.g. {', '.join(self.unknown_examples[:3])})" if self.tensors_unknown else "")
                 + f"; {self.blocks} deformable-conv block(s)"]

        def table(items: list[TensorSize]) -> list[str]:
            rows = [("size", "dtype", "shape", "tensor", "produced by", "deform block")]
            rows += [(human(t.nbytes), t.dtype, "[" + ",".join(str(d) for d in t.shape) + "]", t.name, t.producer,
                      t.block or "-") for t in items[:limit_rows]]
            w = [max(len(r[i]) for r in rows) for i in range(6)]
            out = ["  " + "  ".join(f"{r[i]:<{w[i]}}" for i in range(6)).rstrip() for r in rows]
            if len(items) > limit_rows:
                out.append(f"  ... {len(items) - limit_rows} more (--json FILE lists all)")
            return out

        lines.append("")
        if self.over_buffer:
            lines.append(f"OVER maxBufferSize ({human(self.max_buffer)}): {len(self.over_buffer)} tensor(s), "
                         "biggest first")
            lines += table(self.over_buffer)
        else:
            lines.append(f"nothing over maxBufferSize ({human(self.max_buffer)})")
        if self.over_binding:
            lines.append(f"over maxStorageBufferBindingSize only ({human(self.max_binding)}; bound in segments by "
                         f"newer ORT builds only): {len(self.over_binding)} tensor(s)")
            lines += table(self.over_binding)
        else:
            lines.append(f"nothing else over maxStorageBufferBindingSize ({human(self.max_binding)})")
        if self.largest and not self.over_buffer and not self.over_binding:
            lines.append("largest tensors:")
            lines += table(self.largest)
        if self.storage_buffers is not None:
            lines += self.format_storage(limit_rows)
        lines.append("")
        live = ", ".join(f"{t.name} {human(t.nbytes)}" for t in self.peak_live)
        lines.append(f"peak of live activations (depth-first order, inputs lowest index first; no buffer reuse): "
                     f"{human(self.peak_bytes)} at {self.peak_node or '-'}; largest live then: {live or '-'}")
        lines.append(f"peak of live activations in the file's own node order: {human(self.peak_file_bytes)}")
        lines.append(f"peak of live activations in ORT's default order (the same walk, inputs highest index first): "
                     f"{human(self.peak_ort_bytes)}")
        if self.over_buffer:
            lines.append(f"FAIL: {len(self.over_buffer)} tensor(s) exceed maxBufferSize {human(self.max_buffer)}")
        else:
            lines.append(f"OK: every tensor of known size fits maxBufferSize {human(self.max_buffer)}")
        if self.over_storage:
            lines.append(f"FAIL: {len(self.over_storage)} node(s) bind more than {self.storage_buffers} storage "
                         "buffers (`deform-surgeon patch` fits them to the device profile)")
        elif self.storage_buffers is not None:
            lines.append(f"OK: every node binds at most {self.storage_buffers} storage buffers")
        return "\n".join(lines)

    def format_storage(self, limit_rows: int = 40) -> list[str]:
        """The nodes over maxStorageBuffersPerShaderStage, widest first."""
        if not self.over_storage:
            return [f"no node binds more than maxStorageBuffersPerShaderStage ({self.storage_buffers}) storage "
                    "buffers"]
        ops = defaultdict(int)
        for n in self.over_storage:
            ops[n.op] += 1
        lines = [f"OVER maxStorageBuffersPerShaderStage ({self.storage_buffers}): {len(self.over_storage)} node(s) ("
                 + ", ".join(f"{op} {k}" for op, k in sorted(ops.items(), key=lambda kv: -kv[1])) + "), widest first"]
        w = max(len(n.node) for n in self.over_storage[:limit_rows])
        lines += [f"  {n.buffers:>5} buffers  {n.op:<8} {n.node:<{w}}  {n.block or ''}".rstrip()
                  for n in self.over_storage[:limit_rows]]
        if len(self.over_storage) > limit_rows:
            lines.append(f"  ... {len(self.over_storage) - limit_rows} more (--json FILE lists all)")
        return lines


def analyze(model_or_path: onnx.ModelProto | str | Path, max_buffer: int = SPEC_MAX_BUFFER,
            max_binding: int = SPEC_MAX_BINDING, limits_source: str = "WebGPU spec defaults",
            top: int = 10, storage_buffers: int | None = None, weights: Weights | None = None,
            types: TypeTable | None = None) -> BudgetReport:
    """The budget report of a model (a path, or a ModelProto and, if it was loaded by `load_model`, its stored
    tensors); with `storage_buffers`, also every node whose kernel binds more storage buffers than that
    (`device.storage_buffers`). A path is checked and typed as `patch` does it (`check_and_infer`: one inference for
    both); an in-memory model is typed by `types` when given (a table of that very model), else inferred."""
    if isinstance(model_or_path, onnx.ModelProto):
        model, name = model_or_path, "(in memory)"
        types = infer_value_types(model, weights) if types is None else types
    else:
        model, weights = load_model(model_or_path)
        types = check_and_infer(model, model_or_path, weights) if types is None else types
        name = str(model_or_path)
    graph = model.graph
    nodes = list(graph.node)
    found = model_blocks(model)
    blocks = found.owner
    order = execution_order(model)

    report = BudgetReport(name, max_buffer, max_binding, limits_source)
    report.block_convs = found.convs
    report.blocks = len(set(blocks.values()))
    sizes, unknown = sized_tensors(model, types, blocks)
    report.tensors_unknown, report.unknown_examples = len(unknown), unknown[:5]
    report.tensors_known = len(sizes)
    live_ones = [t for t in sizes if t.kind in ("activation", "input")]  # what the peak counts
    intervals = _in_order(nodes, graph, live_ones, order)
    if storage_buffers is not None:
        report.storage_buffers = storage_buffers
        wide = [NodeBuffers(n.name or n.output[0], n.op_type, count, storage_buffers,
                            blocks.get(n.name or n.output[0]))
                for n in nodes if (count := bindings(n.op_type, list(n.input), list(n.output))) > storage_buffers]
        report.over_storage = sorted(wide, key=lambda n: (-n.buffers, n.node))
    sizes.sort(key=lambda s: (-s.nbytes, s.name))
    report.over_buffer = [s for s in sizes if s.nbytes > max_buffer]
    report.over_binding = [s for s in sizes if max_binding < s.nbytes <= max_buffer]
    report.largest = sizes[:top]
    report.peak_bytes, peak_at, live = _peak(intervals)
    report.peak_file_bytes = _peak(_in_order(nodes, graph, live_ones, range(len(nodes))))[0]
    report.peak_ort_bytes = _peak(_in_order(nodes, graph, live_ones, execution_order(model, highest_first=True)))[0]
    if peak_at is not None:
        report.peak_node = ("(graph inputs)" if peak_at < 0 else
                            f"{nodes[order[peak_at]].op_type} '{nodes[order[peak_at]].name}' (step {peak_at} of "
                            f"{len(order)})")
        report.peak_live = sorted(live, key=lambda s: -s.nbytes)[:5]
        for t in live:
            if t.block is not None:
                report.peak_blocks[t.block] = report.peak_blocks.get(t.block, 0) + t.nbytes
    return report


def execution_order(model: onnx.ModelProto, highest_first: bool = False) -> list[int]:
    """Node indices in a post-order depth-first walk back from the leaf nodes, a node's inputs (and the leaves)
    lowest index first; with `highest_first`, highest index first: ONNX Runtime's default order (GraphViewer's
    `ReverseDFSFrom` pushes the leaves and the sorted inputs on a stack, so it takes the last first; checked against
    ORT's profiler in tests/graph/test_budget.py)."""
    nodes = list(model.graph.node)
    ins = [list(n.input) for n in nodes]  # read each repeated field once: protobuf access is the cost here
    outs = [list(n.output) for n in nodes]
    producer = {o: k for k, names in enumerate(outs) for o in names if o}
    used = {i for names in ins for i in names if i}
    leaves = [k for k, names in enumerate(outs) if not any(o in used for o in names)]
    if highest_first:
        leaves.reverse()
    order: list[int] = []
    done: set[int] = set()
    for leaf in leaves:
        stack: list[tuple[int, bool]] = [(leaf, False)]
        while stack:
            k, expanded = stack.pop()
            if k in done:
                continue
            if expanded:
                done.add(k)
                order.append(k)
                continue
            stack.append((k, True))
            preds = sorted({producer[i] for i in ins[k] if i in producer} - done, reverse=not highest_first)
            stack.extend((p, False) for p in preds)
    order.extend(k for k in range(len(nodes)) if k not in done)  # unreachable leftovers, if any
    return order


def write_in_execution_order(model: onnx.ModelProto) -> bool:
    """Put `model`'s nodes in `execution_order` (in place: the node protos are moved, never copied); False, and the
    order left alone, when it is that order already or a node has a subgraph (its body may read tensors of this
    graph, which `execution_order` does not count as inputs).

    Why: `patch` splits a block into chunks, and onnx-graphsurgeon's toposort lists a graph by depth, so the file
    lists every chunk's first step, then every chunk's second step: a runtime that follows the file's order holds
    all chunks' temporaries at once (the real BiRefNet-lite 1024, fitted: 1.11 GB in budget's order, 3.69 GB
    in the file's). Written in the order the peak was measured in, the file gives such a runtime the same peak."""
    nodes = model.graph.node
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        return False
    order = execution_order(model)
    if all(k == step for step, k in enumerate(order)):
        return False
    step = [0] * len(order)
    for s, k in enumerate(order):
        step[k] = s
    held = list(nodes)  # keeps each node's Python object (and so its id) alive while the field is sorted
    index = {id(n): k for k, n in enumerate(held)}
    nodes.sort(key=lambda n: step[index[id(n)]])
    return True


def _size(info) -> tuple[int, str, list[int]] | None:
    if info is None or info[1] is None:
        return None
    elem, shape = info
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except Exception:
        return None
    return int(math.prod(shape)) * dtype.itemsize, str(dtype), [int(d) for d in shape]


def sized_tensors(model: onnx.ModelProto, types: TypeTable, blocks: dict[str, str] | None = None
                  ) -> tuple[list[TensorSize], list[str]]:
    """The tensors of `model` (graph inputs, node outputs, initializers) whose size `types` tells, each named by
    its producer and deform block (`blocks`: node -> block), and the names of those whose size it does not tell
    (Constant outputs aside), in the graph's order. Why one function: `budget`'s count of tensors of unknown size
    is this over the table it reads, and tests/graph/test_budget.py checks it over `patch`'s type table the same way."""
    graph = model.graph
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    inits = {i.name for i in graph.initializer}
    consts = {o for n in nodes if n.op_type == "Constant" for o in n.output}
    sizes: list[TensorSize] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for t in [i.name for i in graph.input] + [o for n in nodes for o in n.output if o] + list(inits):
        if t in seen:
            continue
        seen.add(t)
        size = _size(types.get(t))
        if size is None:
            if t not in consts:
                unknown.append(t)
            continue
        if t in inits:
            where, kind, block = "initializer", "initializer", None
        elif t in producer:
            node = producer[t]
            where = f"{node.op_type} '{node.name}'"
            kind = "constant" if t in consts else "activation"
            block = (blocks or {}).get(node.name or node.output[0])
        else:
            where, kind, block = "graph input", "input", None
        sizes.append(TensorSize(t, *size, where, block, kind))
    return sizes, unknown


def _in_order(nodes: list, graph: onnx.GraphProto, tensors: list[TensorSize], order
              ) -> list[tuple[int, int, TensorSize]]:
    """The one tensor-lifetime walk: each of `tensors` with the steps of a node order (node indices in the order
    they run), from its producer's step (-1: a graph input) to its last reader's (past the last node: a graph
    output). The peak in budget's order, the file's and ORT's are this walk over three orders."""
    step = [0] * len(nodes)
    for s, k in enumerate(order):
        step[k] = s
    made = {o: step[k] for k, n in enumerate(nodes) for o in n.output if o}
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            if i:
                last[i] = max(last.get(i, -1), step[k])
    for o in graph.output:
        last[o.name] = len(nodes)
    return [(made.get(t.name, -1), last.get(t.name, made.get(t.name, -1)), t) for t in tensors]


def _peak(intervals: list[tuple[int, int, TensorSize]]) -> tuple[int, int | None, list[TensorSize]]:
    """Largest sum of sizes of tensors alive at one step (alive from producer step to last-use step)."""
    if not intervals:
        return 0, None, []
    delta: dict[int, int] = defaultdict(int)
    for start, end, t in intervals:
        delta[start] += t.nbytes
        delta[max(start, end) + 1] -= t.nbytes
    best, best_at, cur = -1, None, 0
    for step in sorted(delta):
        cur += delta[step]
        if cur > best:
            best, best_at = cur, step
    live = [t for s, e, t in intervals if s <= best_at <= max(s, e)]
    return best, best_at, live
