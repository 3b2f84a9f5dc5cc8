"""`verify --segment-memory BYTES`: one model run on ORT CPU in segments of its nodes, the tensors between them kept
on disk, for a model whose whole run does not fit the machine (the real BiRefNet HR 2048 export: one ORT CPU
inference of it was killed at 24.3 GB, docs/verify.md).

A segment is a run of consecutive nodes (topological order) whose tensors, those it reads from earlier segments
and those it makes, add up to at most BYTES by the model's inferred types (patch's type table; a tensor it does not
size counts as its producer's largest input); a node whose tensors alone are more is a segment of its own. Each
segment is a model of its own (pieces.sub_model: its nodes unchanged, the Constant nodes and initializers it reads
copied in), run once per seeded input; what later segments or the graph's outputs read is saved as .npy and fed
back mapped from the file, and removed after its last reader.

Why the bytes are the whole model's: at ONNX Runtime's level `disable` no node is fused with another or changed
in layout, so each node runs its own kernel on its inputs, and a kernel does not know whether an input came from
the node before it or from a file (tests/checks/test_run_in_segments.py compares both runs byte for byte;
docs/verify.md on the real HR 2048). At the other levels ORT rewrites across a segment's edge differently than
across the whole graph, so segments run at `disable` only. A model with float16 tensors is refused: ORT CPU runs a
float16 node on a float32 kernel behind inserted Casts depending on its neighbours (cuts.made_by_ort), and a
segment's edge changes its neighbours, so where values are rounded to float16 would change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..base.errors import SurgeonError
from ..base.memory import release
from ..graph.subgraphs import Graph, save_model, sub_model, window_inputs

if TYPE_CHECKING:
    import numpy as np

SEGMENT_LEVEL = "disable"
_REDUCED_FLOATS = (10, 16)  # onnx.TensorProto.FLOAT16, BFLOAT16


@dataclass(frozen=True)
class Segment:
    first: int  # node indices of the Graph, first..last
    last: int
    inputs: tuple[str, ...]  # tensors it reads that earlier segments (or the feeds) made
    outputs: tuple[str, ...]  # tensors it makes that later segments or the graph's outputs read
    nbytes: int  # its inputs' and made tensors' bytes by the inferred types (`planned_bytes`)


def tensor_bytes(g: Graph, name: str) -> int:
    """The bytes of a tensor by its inferred type; 0 when its shape or type is not known."""
    import numpy as np
    import onnx

    t = g.types.get(name)
    if t is None or not t.tensor_type.elem_type or not t.tensor_type.HasField("shape"):
        return 0
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.tensor_type.shape.dim]
    if any(d < 0 for d in dims):
        return 0
    try:
        item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)).itemsize
    except Exception:  # a type numpy has no dtype for (a string)
        return 0
    return int(math.prod(dims)) * item


def planned_bytes(g: Graph) -> Callable[[str], int]:
    """A tensor's bytes for planning: by its inferred type, else (a shape inference did not know: the HR 2048
    original's Swin reshapes, 3,339 tensors) the largest of its producer's inputs, in turn. A memory estimate only:
    what a segment computes does not depend on it."""
    known: dict[str, int] = {}

    def size(name: str) -> int:
        if name not in known:
            known[name] = tensor_bytes(g, name)
            k = g.producer.get(name)
            if not known[name] and k is not None:
                known[name] = max((size(x) for x in g.nodes[k].input if x and x not in g.constants), default=0)
        return known[name]

    return size


def plan_segments(g: Graph, max_bytes: int) -> list[Segment]:
    """Consecutive nodes of `g` in segments of at most `max_bytes` of tensors each (see the module docstring)."""
    size = planned_bytes(g)
    spans: list[tuple[int, int, int]] = []
    first, total, seen = 0, 0, set()
    for k, node in enumerate(g.nodes):
        new = [x for x in (*node.input, *node.output) if x and x not in g.constants and x not in seen]
        add = sum(size(x) for x in dict.fromkeys(new))
        if k > first and total + add > max_bytes:
            spans.append((first, k - 1, total))
            first, total, seen = k, 0, set()
            new = [x for x in (*node.input, *node.output) if x and x not in g.constants]
            add = sum(size(x) for x in dict.fromkeys(new))
        seen.update(new)
        total += add
    if g.nodes:
        spans.append((first, len(g.nodes) - 1, total))
    segments = []
    ends = {o.name for o in g.model.graph.output}
    for first, last, total in spans:
        made = [y for k in range(first, last + 1) for y in g.nodes[k].output if y]
        outputs = tuple(y for y in made if g.last_read.get(y, -1) > last and (y not in g.constants or y in ends))
        if outputs:  # (a span of Constant nodes only: the segments that read them copy them in)
            segments.append(Segment(first, last, tuple(window_inputs(g, first, last)), outputs, total))
    return segments


def _stored(g: Graph, name: str) -> np.ndarray:
    """The value of an initializer (the model is loaded with its weights here)."""
    import onnx

    found = next((t for t in g.model.graph.initializer if t.name == name), None)
    if found is None:
        raise SurgeonError(None, f"graph output '{name}' is made by no node and is no stored tensor")
    return onnx.numpy_helper.to_array(found)


def segment_graph(path: str | Path, input_shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """The model at `path` (weights in memory: the segments copy what they read) with patch's type table, its
    input dims fixed where given; a model with float16 tensors or subgraphs is refused (module docstring)."""
    import onnx

    from ..files import load_model
    from ..files.load import checked_types
    from ..graph.input_shapes import fix_input_shapes

    skeleton, weights = load_model(path)
    if input_shapes:
        fix_input_shapes(skeleton, input_shapes, path)
    typed = onnx.GraphProto.FromString(checked_types(skeleton, path, weights))
    types = {vi.name: vi.type for vi in (*typed.input, *typed.value_info, *typed.output)
             if vi.type.HasField("tensor_type")}
    if any(t.tensor_type.elem_type in _REDUCED_FLOATS for t in types.values()):
        raise SurgeonError(path, "has float16 tensors, which a run in segments would round in other places than "
                                 "ORT CPU's run of the whole model", "verify it without --segment-memory")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in skeleton.graph.node
           for a in n.attribute):
        raise SurgeonError(path, "has nodes with subgraphs (If, Loop, Scan), which a run in segments does not cut",
                           "verify it without --segment-memory")
    del skeleton, weights
    model = onnx.load(str(path))
    if input_shapes:
        fix_input_shapes(model, input_shapes, path)
    return Graph.of(model, path, types)


class _OnDisk:
    """The tensors between segments, each a .npy file in `folder`, and the most bytes they held at once."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = folder, name
        self.files: dict[tuple[int, str], Path] = {}  # (feed, tensor) -> its file
        self.bytes = self.peak = 0
        self._count = itertools.count()

    def save(self, it: int, x: str, value: np.ndarray) -> None:
        import numpy as np

        file = self.files[it, x] = self.folder / f"{self.name}.{it}.{next(self._count)}.npy"
        np.save(file, np.asarray(value))
        self.bytes += file.stat().st_size
        self.peak = max(self.peak, self.bytes)

    def load(self, it: int, x: str) -> np.ndarray:
        import numpy as np

        return np.load(self.files[it, x], mmap_mode="r")

    def drop(self, it: int, x: str) -> None:
        file = self.files.pop((it, x))
        self.bytes -= file.stat().st_size
        file.unlink()


def run_in_segments(g: Graph, feeds: Sequence[Mapping[str, np.ndarray]], max_bytes: int, folder: str | Path,
                    session: Callable[[str | Path], object], name: str = "model",
                    progress: Callable[[str], None] | None = None) -> tuple[list[list[tuple[str, str]]], int, int]:
    """Run `g`'s model on each feed in segments of at most `max_bytes`; returns, per feed, its graph outputs as
    (name, .npy file in `folder`) in the graph's order, the number of segments and the most bytes the tensors
    between segments held on disk at once. `session(model_file)` makes the ORT CPU session of one segment (the
    caller's options: level disable, threads).

    One feed after the other, each through every segment: the disk then holds one run's tensors between segments
    (HR 2048's original: up to some 17 GB), not every feed's; a segment's session is made once per feed."""

    segments = plan_segments(g, max_bytes)
    folder = Path(folder)
    graph_outputs = {o.name for o in g.model.graph.output}
    disk = _OnDisk(folder, name)
    models: list[Path] = []
    for it, feed in enumerate(feeds):
        for x, value in feed.items():
            disk.save(it, x, value)
        for s, seg in enumerate(segments):
            if progress:
                progress(f"{name}: input {it + 1}, segment {s + 1} of {len(segments)} (nodes {seg.first}-{seg.last}, "
                         f"{seg.nbytes / 1e9:.2f} GB of tensors)")
            if it == 0:
                shapes = {x: disk.load(it, x) for x in seg.inputs}
                models.append(save_model(sub_model(g, range(seg.first, seg.last + 1), seg.outputs, shapes),
                                         folder / f"{name}.segment{s}.onnx"))
                del shapes
            sess = session(models[s])
            values = sess.run(list(seg.outputs), {x: disk.load(it, x) for x in seg.inputs})
            del sess
            for y, value in zip(seg.outputs, values, strict=True):
                disk.save(it, y, value)
            del values
            release()
            for x in [x for (i, x) in disk.files if i == it and g.last_read.get(x, -1) <= seg.last
                      and x not in graph_outputs]:
                disk.drop(it, x)  # what no later segment and no graph output reads
        for o in graph_outputs:
            if (it, o) not in disk.files:  # a graph output no node makes: a stored tensor, given as it is
                disk.save(it, o, _stored(g, o))
    for p in folder.glob(f"{name}.segment*.onnx*"):
        p.unlink()
    outputs = [o.name for o in g.model.graph.output]
    return [[(o, str(disk.files[it, o])) for o in outputs] for it in range(len(feeds))], len(segments), disk.peak
