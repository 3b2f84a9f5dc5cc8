"""Loading and checking: one line naming the file for a model that is not valid ONNX, and the inferred types
the passes read (`TypeTable`), from one strict shape inference on a weight-less copy where the model allows it.

A model is parsed without its stored tensors' bytes (weights.py): the file's scan (wire.py) tells where each large
raw data field is, and protobuf is handed the file without them (a few MB of a 221 MB export), so loading costs
what the graph costs, not what the weights weigh."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

from ..base.errors import SurgeonError
from . import wire
from .contrib import with_contrib_types
from .weights import (
    Weights,
    external_ref,
    is_external,
    left_out,
    skeleton_bytes,
    split_weights,
    tensor_nbytes,
)


def load_model(path: str | Path) -> tuple[onnx.ModelProto, Weights]:
    """Load an ONNX model and its stored tensors (weights.py), whose data stays in the files; or raise a one-line
    `SurgeonError`.

    The stored tensors are checked here: external references inside the model's folder, present, long enough;
    embedded data as long as shape and type need. Their values are read only where needed (`Weights.read`).
    """
    path = user_path(path, "the model")
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise SurgeonError(path, "no such file") from None
    except OSError as exc:
        raise SurgeonError(path, f"cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise SurgeonError(path, "is a folder, not an ONNX model file")
    if not stat.S_ISREG(mode):  # a FIFO or a device: reading it would hang or never end
        raise SurgeonError(path, "is not a regular file (a FIFO, device or socket)", "give an .onnx file")
    scan = wire.scan_model(path)
    cut = [d for pieces in left_out(scan) for d in pieces.values()] if scan.complete else []
    try:
        if cut:
            with open(path, "rb") as fh:
                if wire.file_key(os.fstat(fh.fileno())) != scan.key:
                    raise SurgeonError(path, "changed while it was being read", "run again once nothing writes to it")
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    model = onnx.ModelProto.FromString(wire.without_data(buf, len(buf), cut))
        else:
            model = onnx.load(str(path), load_external_data=False)
    except SurgeonError:
        raise
    except Exception as exc:  # protobuf raises DecodeError, onnx raises others; all mean "not readable ONNX"
        raise SurgeonError(path, f"not a readable ONNX model ({_first_line(exc)})") from None
    if len(model.graph.node) == 0 and len(model.graph.output) == 0:
        # protobuf happily parses many non-ONNX byte strings into an empty ModelProto
        raise SurgeonError(path, "not an ONNX model (no graph: the file is empty, truncated or of another format)")
    weights = split_weights(model, path.parent, scan, path if cut else None)
    if scan.key:
        weights.inputs[path] = scan.key
    _check_stored_tensors(model, path, weights)
    return model, weights


NAME_MAX, PATH_MAX = 255, 4095  # bytes: the longest file name and path Linux's file systems take


def path_problem(path: str | Path) -> str | None:
    """Why `path` cannot name a file, known before any system call sees it (which would raise ValueError or
    "File name too long" deep inside a library): a NUL byte, a name over `NAME_MAX` bytes, a path over
    `PATH_MAX`. None if there is nothing wrong with it as a name."""
    text = os.fspath(path)
    if "\0" in text:
        return "contains a NUL byte"
    if len(os.fsencode(text)) > PATH_MAX:
        return f"is {len(os.fsencode(text))} bytes long; paths are limited to {PATH_MAX}"
    for part in Path(text).parts:
        n = len(os.fsencode(part))
        if n > NAME_MAX:
            return f"has a name of {n} bytes ('{part[:16]}...'); file names are limited to {NAME_MAX}"
    return None


def user_path(value: object, what: str) -> Path:
    """A path given by a user (CLI or Python API) as a `Path`, or a one-line `SurgeonError`: `what` is not a
    str or os.PathLike, or cannot name a file (`path_problem`)."""
    if not isinstance(value, str | os.PathLike) or not isinstance(os.fspath(value), str):
        raise SurgeonError(None, f"{what} must be a path (str or pathlib.Path), not {type(value).__name__} "
                                 f"{_short(repr(value))}")
    problem = path_problem(value)
    if problem:
        raise SurgeonError(value, f"{what} {problem}")
    return Path(value)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_model(model: onnx.ModelProto, path: str | Path, weights: Weights | None = None) -> None:
    """Run onnx.checker with full shape inference, or raise `SurgeonError`.

    The checker runs on the model's skeleton (`weights.skeleton_bytes`), so it costs the same for a 2 MB and a 20 GB
    model; the stored tensors themselves were checked when loading (reference, size). `weights` tells where the
    model's external data lives (default: the folder of `path`).
    """
    if weights is None:
        weights = split_weights(model, Path(path).parent if Path(path).is_file() else None)
    with _checker_errors(path):
        onnx.checker.check_model(skeleton_bytes(model, weights), full_check=True)


@contextmanager
def _checker_errors(path: str | Path) -> Iterator[None]:
    """Any failure of onnx.checker or strict shape inference as the one-line `SurgeonError` of `path`."""
    try:
        yield
    except Exception as exc:
        raise SurgeonError(path, f"fails onnx.checker: {_first_line(exc)}") from None


def infer_value_types(model: onnx.ModelProto, weights: Weights | None = None) -> TypeTable:
    """Element type and shape of every tensor that ONNX shape inference can tell (and the outputs of onnxruntime's
    contrib ops from their type rules, contrib.py), without touching `model`.

    The result feeds the range prover and the passes; it is deliberately not written into the exported model,
    so a patch does not add value_info to tensors it did not touch. Inference runs on the skeleton (stored tensors
    are typed graph inputs there), so it works past 2 GB and costs nothing per weight byte.
    """
    return TypeTable(_inferred(model, weights if weights is not None else split_weights(model, None)))


def _inferred(model: onnx.ModelProto, weights: Weights) -> onnx.GraphProto:
    data = skeleton_bytes(model, weights)
    try:
        return _resolve_pads(data, with_contrib_types(data, _lenient(data), _lenient), _lenient)
    except Exception:
        return onnx.ModelProto.FromString(data).graph


PAD_CHAIN_LIMIT = 96  # nodes computing a Pad's pads: a Swin block's make some 50


# a Pad's input shape is known once the Pads before it are: each round of inference reaches one Swin block
# further. Two reach the second stage's second block (the last one over 128 MiB at 2048: [1, 65536, 768]); each
# round costs one more inference of the skeleton (0.8 s on BiRefNet-lite, in the background process)
STATIC_PAD_ROUNDS = 2


def _resolve_pads(data: bytes, inferred: onnx.GraphProto, infer: Callable[[bytes], onnx.GraphProto]
                  ) -> onnx.GraphProto:
    """`inferred` (what `infer(data)` gave, with the contrib types), and where a Pad's output shape is left unknown
    only because its pads are computed from constants and static shapes, inferred again, round by round, on a copy
    whose Pads read those values as initializers (`<pads>/static`, see `_static_pads`).

    Why: torch.onnx writes a Swin block's pad to whole windows, `F.pad(x, (0, 0, 0, pad_r, 0, pad_b))`, as
    Shape -> Gather -> Sub -> Mod ... -> ConstantOfShape -> Concat -> Reshape -> Slice -> Transpose -> Cast, which
    ONNX's data propagation does not follow, and every shape after it (the shifted-window blocks' MLP of the full
    BiRefNet, 192 MiB a tensor at 1024) was unknown to the passes. The model written is untouched: only the type
    table learns the shapes."""
    for _ in range(STATIC_PAD_ROUNDS):
        fixed = _static_pads(data, inferred)
        if fixed is None:
            break
        data, inferred = fixed, with_contrib_types(fixed, infer(fixed), infer)
    return inferred


def _static_pads(data: bytes, inferred: onnx.GraphProto) -> bytes | None:
    """The skeleton with each Pad whose input shape is known and output shape is not, and whose pads are computed
    from constants and static shapes only, reading those pads as an initializer evaluated by onnx's reference
    evaluator (see `_resolve_pads`); None when there is none."""
    def static(vi: onnx.ValueInfoProto) -> bool:
        tt = vi.type.tensor_type
        return tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)

    known = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
             for vi in (*inferred.input, *inferred.value_info, *inferred.output) if static(vi)}
    model = onnx.ModelProto.FromString(data)
    graph = model.graph
    pads = [n for n in graph.node if n.op_type == "Pad" and len(n.input) > 1 and n.input[1]
            and n.input[0] in known and n.output[0] not in known]
    if not pads:
        return None
    made = {o: n for n in graph.node for o in n.output}
    values = {t.name: t for t in graph.initializer}
    from onnx.reference import ReferenceEvaluator

    changed = False
    for pad in pads:
        nodes, stack = {}, [pad.input[1]]
        while stack and len(nodes) <= PAD_CHAIN_LIMIT:
            name = stack.pop()
            if not name or name in values:
                continue
            node = made.get(name)
            if node is not None and node.op_type == "Shape" and node.input[0] in known:  # a static shape: a value
                attrs = {a.name: a.i for a in node.attribute}
                dims = known[node.input[0]][attrs.get("start", 0):attrs.get("end")]
                values[name] = onnx.numpy_helper.from_array(np.array(dims, np.int64), name)
                continue
            if node is None or node.op_type in ("Shape", "Size") or any(a.type == onnx.AttributeProto.GRAPH
                                                                        for a in node.attribute):
                nodes = None  # a graph input or a value the run decides: not a constant
                break
            if id(node) not in nodes:
                nodes[id(node)] = node
                stack.extend(node.input)
        if not nodes or len(nodes) > PAD_CHAIN_LIMIT:
            continue
        order = [n for n in graph.node if id(n) in nodes]
        used = {i for n in order for i in n.input} & set(values)
        try:
            sub = onnx.helper.make_model(
                onnx.helper.make_graph(order, "pads", [], [onnx.helper.make_tensor_value_info(pad.input[1], 0, None)],
                                       [values[v] for v in used]), opset_imports=model.opset_import)
            (value,) = ReferenceEvaluator(sub).run(None, {})
        except Exception:  # an op the reference evaluator does not run: the shapes stay unknown
            continue
        name = f"{pad.input[1]}/static"
        if name not in values:
            values[name] = onnx.numpy_helper.from_array(np.asarray(value), name)
            graph.initializer.append(values[name])
        pad.input[1] = name
        changed = True
    return model.SerializeToString() if changed else None


def _lenient(data: bytes) -> onnx.GraphProto:
    return onnx.shape_inference.infer_shapes(data, check_type=False, strict_mode=False, data_prop=True).graph


def _strict(data: bytes) -> onnx.GraphProto:
    return onnx.shape_inference.infer_shapes(data, check_type=True, strict_mode=True, data_prop=True).graph


def check_and_infer(model: onnx.ModelProto, path: str | Path, weights: Weights) -> TypeTable:
    """`check_model` and `infer_value_types` in one shape inference, on one serialized skeleton, where the model
    allows it; `checked_types` in the caller's process."""
    return TypeTable(onnx.GraphProto.FromString(checked_types(model, path, weights)))


def checked_types(model: onnx.ModelProto, path: str | Path, weights: Weights) -> bytes:
    """What `check_and_infer` answers, as bytes (a GraphProto whose inputs, outputs and value_info declare every
    tensor's type): small enough to send from a background process (background.py), which `patch` runs it in.

    onnx.checker's full check is the plain check plus strict, type-checking shape inference; run that inference
    with data propagation once and both answers come from it. Only when it fails are the two asked separately
    (a model can fail strict data propagation and still pass the checker), so the verdicts are the same.
    """
    skeleton = skeleton_bytes(model, weights)
    with _checker_errors(path):
        onnx.checker.check_model(skeleton)
    try:
        inferred = _strict(skeleton)
    except Exception:
        check_model(model, path, weights)
        inferred = _inferred(model, weights)
    else:
        inferred = _resolve_pads(skeleton, with_contrib_types(skeleton, inferred, _strict), _strict)
    types = onnx.GraphProto()
    types.input.extend(inferred.input)
    types.output.extend(inferred.output)
    types.value_info.extend(inferred.value_info)
    types.value_info.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                            for t in inferred.initializer)
    return types.SerializeToString()


def check_spliced(model: onnx.ModelProto, region: onnx.ModelProto, path: str | Path, weights: Weights) -> None:
    """onnx.checker's full check of a model whose only changed part is `region` (see region.py).

    A full check is the plain check plus strict shape inference. The plain check runs on the whole model's skeleton
    (graph structure, names, topological order, attributes); strict inference runs on the region alone, whose
    inputs and outputs are declared with the types and shapes inferred on the input model (stored tensors are
    typed inputs of the region): every node outside the region reads exactly what it read before, and the input
    model passed its own strict inference.
    """
    with _checker_errors(path):
        onnx.checker.check_model(skeleton_bytes(model, weights))
        onnx.shape_inference.infer_shapes(region.SerializeToString(), check_type=True, strict_mode=True)


class TypeTable(Mapping):
    """tensor name -> (element type, shape or None), decoded from the inferred graph only when asked (a 19,000-node
    model has some 80,000 entries, of which the passes read a few hundred: even looking at each one's element type
    costs more than the rest of building the table). An entry without an element type counts as absent."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._protos: dict[str, onnx.ValueInfoProto | onnx.TensorProto] = {}
        for vi in (*graph.input, *graph.value_info, *graph.output):
            name = vi.name
            if name in self._protos and not vi.type.tensor_type.elem_type:
                continue  # an untyped declaration after a typed one does not hide it
            self._protos[name] = vi
        for init in graph.initializer:
            self._protos[init.name] = init
        self._done: dict[str, tuple[int, tuple[int | str | None, ...] | None]] = {}

    def __getitem__(self, name: str) -> tuple[int, tuple[int | str | None, ...] | None]:
        got = self._done.get(name)
        if got is None:
            proto = self._protos[name]
            if isinstance(proto, onnx.TensorProto):
                got = (proto.data_type, tuple(proto.dims))
            else:
                tt = proto.type.tensor_type
                if not tt.elem_type:
                    raise KeyError(name)
                shape = None
                if tt.HasField("shape"):
                    shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                  for d in tt.shape.dim)
                got = (tt.elem_type, shape)
            self._done[name] = got
        return got

    def elem_type(self, name: str) -> int:
        """The element type alone (0 when unknown), without decoding the shape."""
        proto = self._protos.get(name)
        if proto is None:
            return 0
        return proto.data_type if isinstance(proto, onnx.TensorProto) else proto.type.tensor_type.elem_type

    def __contains__(self, name: object) -> bool:
        return self.elem_type(name) != 0 if isinstance(name, str) else False

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._protos if self.elem_type(name))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _check_stored_tensors(model: onnx.ModelProto, path: Path, weights: Weights) -> None:
    """External references inside the model's folder, present and long enough; embedded stored data complete (its
    length known without reading it: `Weights.data_length`)."""
    for name, t in weights.tensors.items():
        if not is_external(t) and (got := weights.data_length(name)) != tensor_nbytes(t):
            what = f"tensor '{name}'"
            if name in weights.constants:
                node = next(n for n in model.graph.node if n.op_type == "Constant" and n.output[:1] == [name])
                what = f"Constant '{node.name or name}'"
            raise SurgeonError(path, f"{what} has {got} bytes of data; its shape and type need {tensor_nbytes(t)}")
    sizes: dict[Path, int | None] = {}
    for t in model.graph.initializer:
        expected = tensor_nbytes(t)
        if not is_external(t):
            continue
        try:
            location, offset, length = external_ref(t)
        except ValueError:
            raise SurgeonError(path, f"external data of tensor '{t.name}' has an offset or length that is not a "
                                     "number") from None
        if not location:
            raise SurgeonError(path, f"tensor '{t.name}' is stored externally but names no file")
        if (problem := path_problem(location)) is not None:
            raise SurgeonError(path, f"external data location of tensor '{t.name}' {problem}")
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise SurgeonError(path, f"external data of tensor '{t.name}' is at '{location}', outside the model's "
                                     "folder", "ONNX requires a path relative to the model's folder")
        file = path.parent / location
        if file not in sizes:
            try:
                st = os.stat(file)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            except OSError as exc:
                raise SurgeonError(path, f"external data file '{location}' (tensor '{t.name}') cannot be read "
                                         f"({exc.strerror})") from None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise SurgeonError(path, f"external data file '{location}' (tensor '{t.name}') is not a regular file")
            sizes[file] = None if st is None else st.st_size
            if st is not None:
                weights.inputs[file] = wire.file_key(st)
            folder = path.parent.resolve()
            if sizes[file] is not None and not file.resolve().is_relative_to(folder):
                raise SurgeonError(path, f"external data file '{location}' (tensor '{t.name}') is a link to "
                                         f"{file.resolve()}, outside the model's folder",
                                   "ONNX Runtime refuses it too; copy the data beside the model")
        size = sizes[file]
        if size is None:
            raise SurgeonError(path, f"external data file '{location}' (tensor '{t.name}') does not exist",
                               f"it must be beside the model, in {path.parent}")
        if offset < 0 or (length is not None and length < 0):
            raise SurgeonError(path, f"external data of tensor '{t.name}' has a negative offset or length "
                                     f"({offset}, {length})")
        end = size if length is None else offset + length
        if offset > size or end > size:
            raise SurgeonError(path, f"external data file '{location}' is truncated: tensor '{t.name}' needs bytes "
                                     f"{offset}..{end}, the file has {size}")
        if expected is not None and end - offset != expected:
            raise SurgeonError(path, f"external data of tensor '{t.name}' has {end - offset} bytes; its shape and "
                                     f"type need {expected}")
    if _nested_external(model.graph):
        raise SurgeonError(path, "external data in a Constant node or a subgraph is not supported",
                           "store only initializers of the main graph externally")


# standard ops with a tensor or graph attribute (custom-domain ops are always looked at)
_TENSOR_OR_GRAPH_ATTRS = {"Constant", "ConstantOfShape", "If", "Loop", "Scan", "SequenceMap"}


def _nested_external(graph: onnx.GraphProto, top: bool = True) -> bool:
    if not top and any(is_external(t) for t in graph.initializer):
        return True
    kinds = (onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPH,
             onnx.AttributeProto.GRAPHS)
    for node in graph.node:
        if not (node.domain not in ("", "ai.onnx") or node.op_type in _TENSOR_OR_GRAPH_ATTRS):
            continue
        for a in node.attribute:
            if a.type not in kinds:
                continue
            if (a.HasField("t") and is_external(a.t)) or any(is_external(t) for t in a.tensors):
                return True
            if (a.HasField("g") and _nested_external(a.g, False)) or any(_nested_external(g, False) for g in a.graphs):
                return True
    return False
