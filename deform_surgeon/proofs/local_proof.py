"""Show a rewrite that is not exact by construction exact where it stands: the rewritten part beside what it
replaced, each in the context ORT CPU fuses it in, on the real shapes.

Why not the whole model: a row band of a Conv, a chunk of a split Conv or a channel group of a Resize computes
every output element from the same inputs as the whole node, but in which order a kernel sums them is the
kernel's choice, and ORT CPU chooses by shape and by what it fuses (MLAS's SGEMM picks its K blocking from the
number of output pixels it is given; at level `all` the NCHWc transformer runs a Conv, and a Resize whose input is
NCHWc, with kernels of their own and fuses a Conv with the Add, BatchNormalization or activation after it). Those
choices depend on the shapes and on the neighbouring nodes, never on the values, so running the two forms on the
real shapes, with their neighbours, on seeded random data, at the levels `none` and `all`, decides them. Comparing
whole models did the same at the cost of two runs of the whole model (on the real BiRefNet-lite 1024: 46 s, 10 GB);
this is the same question asked of the few nodes that changed.

A proof is the whole side (the nodes the rewrite replaced, as they were, with the tensors they read) and the
tensors where the rewritten side ends. At proof time the rewritten side is read from the final graph, walking back
from those tensors to the whole side's inputs, so later passes (a fit of the join Concat) are included; the
readers of the end tensors are added to both sides (the context ORT fuses the last node in) and their outputs are
compared byte for byte. `parts_inputs` maps a tensor the rewritten side starts from to the rows of a whole-side
input it holds (a split block's chunks start from the rows of the Conv input).

At level `disable` ORT applies no graph transformation to a float32 graph (no fusion, no layout change, no
constant folding; the Casts it inserts for float16 kernels are the one exception, hence float32 only), and each
proof checks it: the graph ORT would save for each side with its neighbours at that level has the same nodes. Each
node then runs its own kernel on its inputs, whatever its neighbours. There the two sides are compared at their
ends, without the readers and the layout producers (their outputs are the same kernels' work on the same bytes
either way): the same question, without running the neighbours (on the real BiRefNet-lite 1024 a 29-GFLOP Conv
that only sets the layout of a Concat's other input).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..base.memory import release
from ..base.threads import MLAS_MAXIMUM_THREAD_COUNT, Kernel, thread_counts
from ..graph.pipeline import Context, Refuse

LEVELS = ("disable", "all")
MAX_PROOF_NODES = 2000  # a rewritten side larger than this is not a local rewrite: left to the whole-model check

TypeOf = tuple[np.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class NodeSpec:
    """A node by names, as it was when recorded (a rewrite changes the wiring of the nodes it replaces)."""

    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict

    @classmethod
    def of(cls, node: onnx.NodeProto) -> NodeSpec:
        """A node of an ONNX model (its tensor attributes as arrays)."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        return cls(node.op_type, node.name, tuple(node.input), tuple(node.output),
                   {k: (onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v)
                    for k, v in attrs.items()})


@dataclass
class Facts:
    """Types and constant values of the tensors a proof's nodes read or make, by name."""

    types: dict[str, TypeOf | None] = field(default_factory=dict)
    constants: dict[str, np.ndarray | None] = field(default_factory=dict)

    def learn(self, ctx: Context, shapes, node: gs.Node) -> NodeSpec:
        for t in [*node.inputs, *node.outputs]:
            if t.name and t.name not in self.types:
                dtype, shape = shapes.dtype(t), shapes.shape(t)
                self.types[t.name] = None if dtype is None or shape is None else (np.dtype(dtype), tuple(shape))
                self.constants[t.name] = None if any(t is o for o in node.outputs) else ctx.prover.constant(t)
        if node.op == "Resize" and len(node.inputs) > 3 and node.inputs[3].name and \
                self.constants.get(node.inputs[3].name) is None and self.types.get(node.outputs[0].name):
            # sizes computed from Shape nodes: ORT folds them to the static output shape (a constant, which its
            # NCHWc Resize needs), so the proof gives the Resize that constant
            self.constants[node.inputs[3].name] = np.array(self.types[node.outputs[0].name][1], np.int64)
        attrs = {k: (v.values if isinstance(v, gs.Constant) else v) for k, v in node.attrs.items()}
        return NodeSpec(node.op, node.name, tuple(t.name for t in node.inputs), tuple(t.name for t in node.outputs),
                        attrs)


@dataclass
class LocalProof:
    whole: list[NodeSpec]
    ends: list[gs.Tensor]  # the tensors both sides make (the rewritten side's joins keep the whole side's names)
    facts: Facts
    # a tensor the rewritten side starts from -> (whole-side input, axis, start, end): the rows of it that it holds
    parts_inputs: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)
    parts: list[NodeSpec] | str = ""  # the rewritten side (or why it cannot be read), taken just after the rewrite
    readers: list[NodeSpec] = field(default_factory=list)  # the nodes reading `ends` then
    folded: list[NodeSpec] = field(default_factory=list)  # constant-only computations feeding either (see taken)
    layout: list[NodeSpec] = field(default_factory=list)  # the producers of the whole side's inputs (see taken)
    float16: bool = False  # a float16 rewrite's proof (float16_proof.py): read out and shared as in the model
    opset: int | None = None  # the model's (None: the region graph's)
    threads: tuple[int, ...] = ()  # the intra-op thread counts its sides were compared at (`compare_sides`)

    def taken(self, ctx: Context, shapes) -> LocalProof:
        """Take the rewritten side and the readers of its ends, just after the rewrite: each proof then shows the
        graph before one rewrite and after it alike, and the chain of them the original and the patched model
        (the passes that run later are exact by construction, or have proofs of their own)."""
        made = {o for s in self.whole for o in s.outputs}
        free = {i for s in self.whole for i in s.inputs if i and i not in made}
        self.parts = _walk_back(ctx, self.ends, free | set(self.parts_inputs), self.facts, shapes)
        inside = {s.name for s in self.parts} if isinstance(self.parts, list) else set()
        readers = [r for t in self.ends for r in t.outputs if r.name not in inside]
        self.readers = [self.facts.learn(ctx, shapes, r) for r in readers]
        # what ORT folds to constants before it fuses (a BatchNormalization's parameters through Cast or Identity
        # nodes the prover does not read): the readers' and the whole side's inputs made of constants only
        made |= {o.name for r in readers for o in r.outputs} | {t.name for t in self.ends}
        seen = {s.name for s in [*self.whole, *self.readers]}
        table = ctx.graph.tensors()
        whole_inputs = [table[i] for s in self.whole for i in s.inputs if i in table]
        for t in [i for n in readers for i in n.inputs] + whole_inputs:
            if t.name and t.name not in made and self.facts.constants.get(t.name) is None:
                for n in _folded(ctx, t) or []:
                    if n.name not in seen:
                        seen.add(n.name)
                        self.folded.append(self.facts.learn(ctx, shapes, n))
        # where the whole side's inputs, and the readers' other inputs, come from, as far as ORT's NCHWc layout
        # reaches: a Resize (or a Conv) reading a Conv's output in its NCHWc layout runs another kernel than one
        # reading plain NCHW data, and an Add of a Conv's output and another NCHWc tensor is fused into the Conv
        order = {id(n): k for k, n in enumerate(ctx.graph.nodes)}
        before: dict[int, gs.Node] = {}
        for t in whole_inputs + [i for r in readers for i in r.inputs if i.name not in made]:
            if t.name in made or self.facts.constants.get(t.name) is not None:
                continue
            for n in _layout_producers(t):
                if n.name not in seen:
                    before[id(n)] = n
        for n in sorted(before.values(), key=lambda n: order.get(id(n), -1)):
            seen.add(n.name)
            self.layout.append(self.facts.learn(ctx, shapes, n))
        return self


def record(ctx: Context, shapes, nodes: list[gs.Node], ends: list[gs.Tensor]) -> LocalProof:
    """What a rewrite replaces, taken before it changes the graph (`LocalProof.taken` completes it after)."""
    facts = Facts()
    return LocalProof([facts.learn(ctx, shapes, n) for n in nodes], list(ends), facts)


Outside = Callable[[str], list[tuple[NodeSpec, Facts]]]


def refusal(ctx: Context, proof: LocalProof, outside: Outside | None = None,
            constant: Callable[[str], np.ndarray | None] | None = None) -> Refuse | None:
    """Why the rewritten side is not shown to give the whole side's bytes (None: it is), see the module docstring;
    a difference it measured is in the refusal's details (`level`, `max_diff`).
    `outside(name)`: the readers of a tensor outside `ctx.graph` (the rest of the model), with their facts.
    (A float16 rewrite is shown exact by float16_proof.py.)"""
    facts, parts = proof.facts, proof.parts
    if isinstance(parts, str):
        return Refuse(parts or "the rewritten side was not taken")
    readers = list(proof.readers)
    for t in proof.ends:
        if not t.outputs and outside is not None:  # read outside the region only (or a graph output)
            for spec, more in outside(t.name):
                readers.append(spec)
                for k, v in more.types.items():
                    facts.types.setdefault(k, v)
                    facts.constants.setdefault(k, more.constants.get(k))
    compared = list(dict.fromkeys(o for r in readers for o in r.outputs if o)) or [t.name for t in proof.ends]
    if constant is not None:  # tensors the rest of the model computes from constants only: ORT folds them first
        every = [*proof.folded, *proof.layout, *proof.whole, *parts, *readers]
        made = {o for n in every for o in n.outputs}
        for name in {i for n in every for i in n.inputs if i and i not in made}:
            if facts.constants.get(name) is None:
                facts.constants[name] = constant(name)
    # level -> (nodes around each side, the tensors compared): see the module docstring for `disable`
    context = {level: (proof.folded + proof.layout, readers, compared) for level in LEVELS}
    runs = []
    for level in LEVELS:
        models = side_models(ctx, proof, parts, *context[level])
        alone = False
        if level == "disable" and not isinstance(models, Refuse) and \
                _float32_only(facts, [*proof.folded, *proof.whole, *parts]) and \
                all(_untransformed(m) for m, _ in models):  # each kernel reads only its inputs: no neighbours
            models = side_models(ctx, proof, parts, proof.folded, [], [t.name for t in proof.ends])
            alone = True
        if isinstance(models, Refuse):
            return models
        runs.append((level, models, alone))
    return compare_sides(proof, runs, ctx.ort_cpu)


Runner = Callable[..., list[np.ndarray]]  # (model, feeds, level, threads=...) -> outputs: ORT CPU or a test's own


def compare_sides(proof: LocalProof, runs: list, run: Runner) -> Refuse | None:
    """Run each level's two sides (`runs`: (level, ((whole, inputs), (rewritten, inputs)), alone)) on seeded
    inputs and compare their outputs byte for byte: None when they agree at every level, else the `Refuse` with
    the level and the largest difference."""
    facts = proof.facts
    sources = {}  # every input a side reads -> its whole-side tensor (a chunk: the tensor it holds rows of)
    for _, models, _ in runs:
        for _, inputs in models:
            for name in inputs:
                source = proof.parts_inputs.get(name, (name,))[0]
                typ = facts.types.get(source)
                if typ is None or typ[0].kind != "f":
                    return Refuse(f"'{source}' is not a float tensor of known shape, so the rewrite cannot be run on "
                                  "its own", tensor=source)
                sources[name] = source

    def feed(inputs: list[str]) -> dict[str, np.ndarray]:
        """Seeded values, the same for a tensor on both sides (a chunk: its rows of them); made again for each
        run rather than kept, and a chunk made from its rows only, so that the largest inputs (the whole input
        of a split Conv) are held once."""
        out = {}
        for name in inputs:
            src = sources[name]
            out[name] = _seeded(src, *facts.types[src], rows=proof.parts_inputs.get(name, (None,))[1:] or None)
        return out

    for level, ((whole, whole_inputs), (split, split_inputs)), alone in runs:
        counts = proof_threads(facts, whole, split)
        proof.threads = tuple(sorted({*proof.threads, *counts}))
        for threads in counts:
            diff = _difference(run, whole, partial(feed, whole_inputs), split, partial(feed, split_inputs),
                               level, threads)
            if diff is not None:
                company = "without its neighbours" if alone else "with its neighbours"
                return Refuse(f"run on its own {company} on ORT CPU (level '{level}', {threads} intra-op "
                              f"thread(s)), it does not give the whole node's bytes (max diff {diff:.2g}): the "
                              "kernel's summation order depends on the shapes and the thread count it is given",
                              level=level, threads=threads, max_diff=diff, neighbours=not alone)
    return None


def proof_threads(facts: Facts | None, *models: onnx.ModelProto) -> tuple[int, ...]:
    """The intra-op thread counts a proof of `models` runs at: one of each class of counts that split their Convs
    and GEMMs alike (base/threads.py), so that what it shows holds at every count. Shapes from `facts`, else
    from onnx's shape inference of each model."""
    import os

    return thread_counts([k for m in models for k in kernels_of(m, facts)], os.cpu_count() or 1)


def unshown_threads(proofs: list[LocalProof | None]) -> tuple[int, ...]:
    """The thread counts a whole-model comparison runs at to decide rewrites not shown exact on their own: the
    classes of their proofs' kernels (`proof_threads`), or every count to `MLAS_MAXIMUM_THREAD_COUNT` where one
    has no proof to read them from."""
    import os

    if any(p is None or isinstance(p.parts, str) for p in proofs):
        return tuple(range(1, MLAS_MAXIMUM_THREAD_COUNT + 1))
    kernels = []
    for proof in proofs:
        types = {name: tuple(typ[1]) for name, typ in proof.facts.types.items() if typ is not None}
        stored = {name for name, value in proof.facts.constants.items() if value is not None}
        kernels += [_kernel(s.op, s.attrs, s.inputs, s.outputs, types, stored) for s in [*proof.whole, *proof.parts]]
    return thread_counts(kernels, os.cpu_count() or 1)


def kernels_of(model: onnx.ModelProto, facts: Facts | None = None) -> list[Kernel]:
    """`model`'s nodes as MLAS sees them (base/threads.py): op, attributes, input shapes, and whether the second
    input is stored (a GEMM's prepacked B)."""
    stored = {t.name for t in model.graph.initializer}
    stored |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    if facts is not None:
        types = {name: tuple(typ[1]) for name, typ in facts.types.items() if typ is not None}
    else:
        inferred = onnx.shape_inference.infer_shapes(model).graph
        types = {v.name: tuple(d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim)
                 for v in [*inferred.input, *inferred.value_info, *inferred.output]
                 if v.type.tensor_type.HasField("shape")}
        types |= {t.name: tuple(t.dims) for t in model.graph.initializer}
    types = {k: v for k, v in types.items() if all(d >= 0 for d in v)}
    return [_kernel(n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}, n.input, n.output,
                    types, stored) for n in model.graph.node]


def _kernel(op: str, attrs: dict, inputs, outputs, types: dict[str, tuple[int, ...]], stored: set[str]) -> Kernel:
    """One node as MLAS sees it: its input shapes and output shape from `types`, its second input stored or not."""
    return Kernel(op, attrs, tuple(types.get(i) for i in inputs), len(inputs) > 1 and inputs[1] in stored,
                  types.get(outputs[0]) if outputs else None)


def _difference(run: Runner, whole: onnx.ModelProto, whole_feed: Callable[[], dict], split: onnx.ModelProto,
                split_feed: Callable[[], dict], level: str, threads: int) -> float | None:
    """None when the two sides give the same bytes at `level` and `threads`, else the largest difference (nan:
    the whole side did not give the same bytes twice, not a kernel to trust). The feeds are made for each run,
    not held (the largest inputs are held once)."""
    expected = _digests(whole, run(whole, whole_feed(), level, threads=threads))
    release()  # (the whole side's outputs are not held while the other side runs: their digests are)
    got = run(split, split_feed(), level, threads=threads)
    diff = None
    if _digests(split, got, set(expected)) != expected:  # measure the difference: the whole side once more
        diff = _max_diff(*_in_common(whole, run(whole, whole_feed(), level, threads=threads), split, got))
        diff = float("nan") if diff is None else diff
    del got
    release()
    return diff


def _digests(model: onnx.ModelProto, outputs: list[np.ndarray], names: set[str] | None = None) -> dict[str, tuple]:
    """Each output's type, shape and SHA-256 of its bytes, by name (those in `names`; a float16 side's extra
    readers of shared stored tensors, `_shared`, are not compared): held instead of the outputs themselves, so
    that one side's outputs are not in memory while the other side runs (on the real BiRefNet 1024 a Resize's
    output is 1 GB, and held it was the patch's peak). Equal digests are equal bytes (a collision of SHA-256 is
    not a thing to plan for); unequal ones are measured again, element by element."""
    import hashlib

    found = {}
    for o, a in zip(model.graph.output, outputs, strict=True):
        if not o.name.endswith("/shared") and (names is None or o.name in names):
            found[o.name] = (a.dtype.str, a.shape, hashlib.sha256(memoryview(_bytes(a))).digest())
    return found


def _in_common(whole: onnx.ModelProto, expected: list[np.ndarray], split: onnx.ModelProto, got: list[np.ndarray]
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The outputs both sides make, by name, in the whole side's order (a float16 side may also make the outputs
    of the readers that share a stored tensor as in the model, `_shared`: not compared)."""
    theirs = dict(zip((o.name for o in split.graph.output), got, strict=True))
    pairs = [(a, theirs[o.name]) for o, a in zip(whole.graph.output, expected, strict=True)
             if not o.name.endswith("/shared")]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _max_diff(expected: list[np.ndarray], got: list[np.ndarray]) -> float | None:
    """None when every output has the same shape, type and bytes; else the largest difference (nan: shapes)."""
    for a, b in zip(expected, got, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or not _same_bytes(a, b):
            return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.shape == b.shape \
                else float("nan")
    return None


def side_models(ctx: Context | None, proof: LocalProof, parts: list[NodeSpec], before: list[NodeSpec],
                after: list[NodeSpec], outputs: list[str], shared: Callable[[str], int] | None = None,
                cast: set[str] | None = None) -> list[tuple[onnx.ModelProto, list[str]]] | Refuse:
    """The whole side's and the rewritten side's models, each between `before` and `after`, making `outputs`
    (those in `cast` through a Cast to float32, which reads the float32 values ORT holds as they are; a float16
    proof's stored tensors shared as in the model: `_shared`)."""
    opset = proof.opset or getattr(ctx.graph, "opset", None) or 17
    if not proof.float16:
        models = [_model(opset, before + side + after, outputs, proof.facts) for side in (proof.whole, parts)]
    else:
        casts = [NodeSpec("Cast", f"{o}/as_float32", (o,), (f"{o}/as_float32",), {"to": onnx.TensorProto.FLOAT})
                 for o in outputs if o in (cast or ())]
        for c in casts:
            typ = proof.facts.types.get(c.inputs[0])
            proof.facts.types[c.outputs[0]] = None if typ is None else (np.dtype(np.float32), typ[1])
        after = after + casts
        outputs = [f"{o}/as_float32" if o in (cast or ()) else o for o in outputs]
        models = []
        for side in (proof.whole, parts):
            nodes = before + side + after
            also = _shared(nodes, proof.facts, shared)
            models.append(_model(opset, nodes + also, outputs + [a.outputs[0] for a in also], proof.facts))
    why = next((m for m in models if isinstance(m, str)), None)
    return Refuse(why) if why is not None else models


def _shared(nodes: list[NodeSpec], facts: Facts, readers: Callable[[str], int] | None) -> list[NodeSpec]:
    """One more reader of each stored float tensor the nodes read that more nodes read in the model
    (`readers(name)`): ORT CPU makes a float32 copy of a float16 initializer, and then runs a Conv on its NCHWc
    kernel, only where one node reads it (measured: BiRefNet's float16 files share one zero bias between 25 Convs,
    which run as FusedConv), so a proof reads such a tensor twice as well. The reader is an Add of the tensor and a
    one-element input, which ORT CPU cannot fold to a constant and runs, as the model's other readers, on the
    float32 copy."""
    if readers is None:
        return []
    count: Counter = Counter(i for n in nodes for i in n.inputs
                             if i and facts.constants.get(i) is not None
                             and np.asarray(facts.constants[i]).dtype.kind == "f")
    added = []
    for name, k in count.items():
        if readers(name) > k:
            value = np.asarray(facts.constants[name])
            facts.types[f"{name}/shared_by"] = (value.dtype, (1,))
            facts.types[f"{name}/shared"] = (value.dtype, tuple(value.shape) or (1,))
            added.append(NodeSpec("Add", f"{name}/shared", (name, f"{name}/shared_by"), (f"{name}/shared",), {}))
    return added


def _float32_only(facts: Facts, nodes: list[NodeSpec]) -> bool:
    """Whether every floating tensor the nodes read or make is float32 (see the module docstring)."""
    names = {t for n in nodes for t in [*n.inputs, *n.outputs] if t}
    types = [facts.types.get(t) for t in names]
    return all(t is not None and (t[0].kind != "f" or t[0] == np.float32) for t in types)


def _untransformed(model: onnx.ModelProto) -> bool:
    """Whether ORT CPU at level `disable` runs `model`'s nodes as they are (the optimised graph it would save has
    the same nodes, inputs and outputs): a session is made, nothing is run."""
    import onnxruntime as ort

    from ..base.scratch import scratch

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    with scratch("deform_surgeon_proof_", "ORT CPU's graph of a local proof") as folder:
        options.optimized_model_filepath = f"{folder}/disable.onnx"
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        ran = onnx.load(options.optimized_model_filepath, load_external_data=False)

    def nodes(m: onnx.ModelProto) -> list:  # in any order: ORT may save them in another topological order
        return sorted((n.op_type, n.domain or "", tuple(n.input), tuple(n.output)) for n in m.graph.node)

    return nodes(ran) == nodes(model)


def _same_bytes(a: np.ndarray, b: np.ndarray, step: int = 1 << 24) -> bool:
    """Byte equality of two arrays, a block at a time (no temporary as large as the outputs)."""
    x, y = _bytes(a), _bytes(b)
    if x.size != y.size:
        return False
    return all(np.array_equal(x[k:k + step], y[k:k + step]) for k in range(0, x.size, step))


SEED_PERIOD = 1_000_003  # a prime: the repeated block never lines up with a row, a channel or a kernel window


def _seeded(name: str, dtype: np.dtype, shape: tuple[int, ...], rows: tuple[int, int, int] | None = None
            ) -> np.ndarray:
    """Values in [-1, 1) for tensor `name`, the same on every run: a seeded block of `SEED_PERIOD` values repeated
    over the shape (drawing 200 million values took 2 s a tensor; a copy of the block takes a tenth of that).
    `rows` (axis, start, end): only that slice of it (the same bytes), made without the rest."""
    n = int(np.prod(shape))
    block = (np.random.default_rng(sum(name.encode())).random(min(SEED_PERIOD, max(n, 1)), dtype=np.float32) * 2
             - 1).astype(dtype, copy=False)
    if rows is None:
        return _periodic(block, 0, n).reshape(shape)
    axis, start, end = rows
    inner = int(np.prod(shape[axis + 1:]))
    outer = int(np.prod(shape[:axis]))
    run = (end - start) * inner
    out = np.empty(outer * run, dtype)
    for k in range(outer):  # the slice is one contiguous run of the whole per index of the axes before `axis`
        _periodic(block, k * shape[axis] * inner + start * inner, run, out[k * run:(k + 1) * run])
    return out.reshape((*shape[:axis], end - start, *shape[axis + 1:]))


def _periodic(block: np.ndarray, offset: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Elements offset .. offset + n - 1 of `block` repeated without end."""
    out = np.empty(n, block.dtype) if out is None else out
    period, k = len(block), 0
    while k < n:
        phase = (offset + k) % period
        take = min(period - phase, n - k)
        out[k:k + take] = block[phase:phase + take]
        k += take
    return out


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


LAYOUT_CARRIERS = {"Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu", "HardSigmoid", "Add", "Mul", "Sum",
                   "BatchNormalization", "Concat", "Resize", "Upsample", "MaxPool", "AveragePool", "GlobalMaxPool",
                   "GlobalAveragePool"}  # the ops ORT's NCHWc transformer may run in that layout


def _layout_producers(t: gs.Tensor, limit: int = 12) -> list[gs.Node]:
    """The nodes making `t` back to (and including) the Convs whose NCHWc layout may reach it through the ops
    that carry it; [] when none of them is a Conv (then `t` is plain NCHW data anyway)."""
    nodes, stack, conv = {}, [t], False
    while stack:
        x = stack.pop()
        if isinstance(x, gs.Constant) or not x.inputs:
            continue
        n = x.inputs[0]
        if id(n) in nodes or (n.op != "Conv" and n.op not in LAYOUT_CARRIERS) or \
                (n.op == "Concat" and int(n.attrs.get("axis", 0)) != 1):  # NCHWc joins channels only
            continue
        nodes[id(n)] = n
        if len(nodes) > limit:
            return []
        if n.op == "Conv":
            conv = True
            continue
        stack.extend(i for i in n.inputs if not isinstance(i, gs.Constant))
    return list(nodes.values()) if conv else []


def _folded(ctx: Context, t: gs.Tensor, limit: int = 32) -> list[gs.Node] | None:
    """The nodes computing `t` from constants only (what ORT's constant folding makes a constant), or None."""
    nodes: dict[int, gs.Node] = {}
    stack = [t]
    while stack:
        x = stack.pop()
        if isinstance(x, gs.Constant) or not x.name or ctx.prover.constant(x) is not None and not x.inputs:
            continue
        if not x.inputs:
            return None  # a graph input: a value, not a constant
        n = x.inputs[0]
        if id(n) not in nodes:
            nodes[id(n)] = n
            if len(nodes) > limit:
                return None
            stack.extend(n.inputs)
    order = {id(n): k for k, n in enumerate(ctx.graph.nodes)}
    return sorted(nodes.values(), key=lambda n: order.get(id(n), -1))


def _walk_back(ctx: Context, ends: list[gs.Tensor], stops: set[str], facts: Facts, shapes
               ) -> list[NodeSpec] | str:
    """The nodes of the final graph that make `ends` from `stops` and constants, in topological order."""
    order = {id(n): k for k, n in enumerate(ctx.graph.nodes)}
    seen: dict[int, gs.Node] = {}
    stack = list(ends)
    while stack:
        t = stack.pop()
        if not t.name or t.name in stops or isinstance(t, gs.Constant):
            continue
        if not t.inputs:
            if ctx.prover.constant(t) is not None:
                continue
            return f"the rewritten nodes read '{t.name}', which the nodes they replaced do not"
        n = t.inputs[0]
        if id(n) in seen:
            continue
        seen[id(n)] = n
        if len(seen) > MAX_PROOF_NODES:
            return f"more than {MAX_PROOF_NODES} rewritten nodes"
        stack.extend(n.inputs)
    return [facts.learn(ctx, shapes, n) for n in sorted(seen.values(), key=lambda n: order.get(id(n), -1))]


def _model(opset: int, nodes: list[NodeSpec], outputs: list[str], facts: Facts
           ) -> tuple[onnx.ModelProto, list[str]] | str:
    """A model of `nodes`: every tensor they read and do not make is a constant (an initializer) or an input."""
    helper = onnx.helper
    made = {o for s in nodes for o in s.outputs}
    inits, inputs, seen, protos = [], [], set(), []
    for s in nodes:
        for name in s.inputs:
            if not name or name in made or name in seen:
                continue
            seen.add(name)
            value = facts.constants.get(name)
            if value is not None:
                inits.append(onnx.numpy_helper.from_array(np.asarray(value), name))
            else:
                inputs.append(name)
        if any(isinstance(v, gs.Graph | onnx.GraphProto) for v in s.attrs.values()):
            return f"{s.op} '{s.name}' has a subgraph"
        protos.append(helper.make_node(s.op, list(s.inputs), list(s.outputs), name=s.name,
                                       **{k: (onnx.numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v)
                                          for k, v in s.attrs.items()}))

    def info(name: str):
        typ = facts.types.get(name)
        if typ is None:
            return None
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(typ[0]), typ[1])

    ins, outs = [info(n) for n in inputs], [info(n) for n in outputs]
    if any(i is None for i in ins + outs):
        return "a tensor at the rewrite's edge has no known type"
    model = helper.make_model(helper.make_graph(protos, "local_proof", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", int(opset))])
    return model, inputs
