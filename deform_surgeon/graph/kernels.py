"""Which nodes of a model the WebGPU execution providers of onnxruntime-web 1.30 / 1.31 have no kernel for, and
so run on the CPU EP (with Memcpy around them): the report's "no WebGPU kernel" lines.

Why a table: placement is decided when a session is created, from the EPs' kernel registries (op type, opset,
element type); the real answer is `deform-surgeon placement`, but a patch report should say, without a browser,
which nodes a user will still find on the CPU and why (a q8 file's ConvInteger, say), so that they can choose
which dtype to ship. The table holds what the two EPs (the native WebGPU EP and JSEP) lack among the ops the
BiRefNet exports and their dtype variants contain; docs/webgpu-kernels.md gives each entry its source, and
tests/commands/test_variants.py holds the table's predictions to what the real runtimes place on the CPU (every
dtype replica on onnxruntime-node; the JSEP-only entries in the browser's JSEP bundle).

Nodes that only compute constants (all inputs stored or computed from stored tensors, or a `Shape` of a
statically shaped tensor) are not counted: ORT folds them when the session is created, so they never run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from .blocks import GraphIndex, find_blocks

NO_KERNEL: dict[str, str] = {  # op type -> why it runs on the CPU EP in both WebGPU EPs, whatever its types
    "Sum": "no WebGPU kernel for Sum (the deform passes chain it into Adds inside the deform blocks)",
    "ConvInteger": "8-bit integer convolution (onnxruntime's dynamic quantization): no WebGPU kernel",
    "MatMulInteger": "8-bit integer matrix product (onnxruntime's dynamic quantization): no WebGPU kernel",
    "DynamicQuantizeLinear": "dynamic 8-bit quantization of activations: no WebGPU kernel",
    "DeformConv": "the ONNX DeformConv op: no WebGPU kernel in onnxruntime-web 1.30 / 1.31",
    "QLinearConv": "8-bit quantized convolution: no WebGPU kernel",
    "QLinearMatMul": "8-bit quantized matrix product: no WebGPU kernel",
    "MatMulIntegerToFloat": "8-bit integer matrix product: no WebGPU kernel",
    "DynamicQuantizeMatMul": "8-bit integer matrix product: no WebGPU kernel",
}

# onnxruntime's dynamic 8-bit quantization (transformers.js's q8 / int8 / uint8 files): no WebGPU kernel, and no
# exact lowering to float ops the WebGPU EPs run (measured by scripts/measure_integer_lowering.py, docs/variants.md)
INTEGER_8BIT = ("ConvInteger", "MatMulInteger", "DynamicQuantizeLinear")
NO_EXACT_LOWERING = ("no WebGPU kernel and no exact lowering to float ops (ORT's DynamicQuantizeLinear takes min/max "
                     "with a SIMD kernel whose result with a NaN depends on lanes and threads; WGSL's f32 division is "
                     "2.5 ULP, so Round(x / scale) can land on another integer: docs/variants.md)")
SHIP_FOR_GPU = "ship fp16 or q4f16 for the GPU (fp32 or q4 where the GPU has no shader-f16)"

_WIDE = {TensorProto.INT64, TensorProto.UINT64, TensorProto.DOUBLE}
# the WebGPU kernels take f32/f16/i32/u32 (and bool) data: a node whose data (input 0) is 64-bit runs on the CPU EP
# (the native EP computes int64 only behind its `enableInt64` option, off by default, and then the low 32 bits);
# these read only their input's shape, or take 64-bit inputs as CPU-side shape arguments
SHAPE_READERS = {"Shape", "Size", "ConstantOfShape", "NonZero", "Where"}
WIDE_DATA = "64-bit data (int64/double): the WebGPU kernels take f32/f16/i32/u32 data"
NON_FLOAT_SLICE = "a Slice of non-float data: the native EP's Slice takes f32/f16 data only"
SLICE_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16}  # the native EP's Slice data types


# what only JSEP (the bundle `import 'onnxruntime-web'` gives) lacks; the native WebGPU EP runs these (measured
# on the real BiRefNet-lite 512 bnb4 and q4f16 files in onnxruntime-web 1.30.0)
JSEP_NO_KERNEL: dict[str, str] = {
    "MatMulBnb4": "4-bit NF4 matrix product (MatMulBnb4Quantizer): no JSEP kernel (the native WebGPU EP has one)",
}
JSEP_NO_F16 = {"Split": "a float16 Split: no JSEP kernel (the native WebGPU EP has one; float16 Splits of known "
                        "type are rewritten into Slices)"}


def why_no_jsep_kernel(op: str, dtype: int) -> str | None:
    """Why a node that the native WebGPU EP runs has no kernel in JSEP, or None."""
    if op in JSEP_NO_KERNEL:
        return JSEP_NO_KERNEL[op]
    if op in JSEP_NO_F16 and dtype == TensorProto.FLOAT16:
        return JSEP_NO_F16[op]
    return None


def why_no_kernel(op: str, domain: str, dtype: int) -> str | None:
    """Why a node (`op`, its first input's element type `dtype`, 0 if unknown) has no WebGPU kernel, or None if the
    table knows of none (which is not a proof that it has one: `deform-surgeon placement` measures)."""
    if domain not in ("", "ai.onnx", "com.microsoft"):
        return f"custom domain '{domain}': no WebGPU kernel"
    if op in NO_KERNEL:
        return NO_KERNEL[op]
    if dtype in _WIDE and op not in SHAPE_READERS:
        return WIDE_DATA
    if op == "Slice" and dtype and dtype not in SLICE_TYPES:
        return NON_FLOAT_SLICE
    return None


@dataclass
class KernelReport:
    """The nodes a model would run on the CPU EP of the WebGPU EPs, inside and outside its deform blocks."""

    blocks: int = 0
    blocks_resident: int = 0  # deform blocks none of whose nodes is in the table
    inside: dict[str, int] = field(default_factory=dict)  # op -> nodes, inside deform blocks
    outside: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # op -> why
    jsep_only: dict[str, int] = field(default_factory=dict)  # op -> nodes that only JSEP leaves on the CPU

    @property
    def cpu_nodes(self) -> int:
        return sum(self.inside.values()) + sum(self.outside.values())

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "blocks_resident": self.blocks_resident, "inside_blocks": self.inside,
                "outside_blocks": self.outside, "reasons": self.reasons, "jsep_only": self.jsep_only}

    @classmethod
    def from_dict(cls, d: Mapping) -> KernelReport:
        return cls(d["blocks"], d["blocks_resident"], dict(d["inside_blocks"]), dict(d["outside_blocks"]),
                   dict(d["reasons"]), dict(d.get("jsep_only", {})))

    def integer_8bit(self) -> tuple[dict[str, int], int]:
        """The nodes of onnxruntime's dynamic 8-bit quantization (op -> count) and how many are inside the blocks."""
        total = {op: n for op in INTEGER_8BIT if (n := self.inside.get(op, 0) + self.outside.get(op, 0))}
        return total, sum(self.inside.get(op, 0) for op in total)

    @staticmethod
    def ops_text(counts: Mapping[str, int]) -> str:
        return ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def lines(self) -> list[str]:
        """The report's lines: one per place (inside / outside the deform blocks) with CPU nodes, and the reasons."""
        out = []
        if self.blocks:
            where = (f"{self.blocks_resident} of {self.blocks} deform block(s) have a WebGPU kernel for every node"
                     if self.blocks_resident < self.blocks else
                     f"all {self.blocks} deform block(s) have a WebGPU kernel for every node")
            out.append(f"WebGPU: {where}")
        if self.inside:
            n = sum(self.inside.values())
            out.append(f"WebGPU: inside the deform blocks, {n} node(s) have no WebGPU kernel and will run on the CPU "
                       f"EP: {self.ops_text(self.inside)}")
        if self.outside:
            n = sum(self.outside.values())
            out.append(f"WebGPU: outside the deform blocks, {n} node(s) have no WebGPU kernel and will run on the "
                       f"CPU EP: {self.ops_text(self.outside)}")
        if self.jsep_only:
            out.append(f"WebGPU: on the JSEP bundle only, {sum(self.jsep_only.values())} more node(s) run on the CPU "
                       f"EP: {self.ops_text(self.jsep_only)}")
        out += [f"WebGPU:   {op}: {why}" for op, why in sorted(self.reasons.items())]
        integer, inside = self.integer_8bit()
        if integer:  # what a user of a transformers.js q8 / int8 / uint8 file needs to know: which dtype to ship
            out.append(f"WebGPU: 8-bit file: {sum(integer.values())} {'/'.join(integer)} node(s) "
                       f"({self.ops_text(integer)}; {inside} inside the deform blocks) stay on the CPU EP: "
                       f"{NO_EXACT_LOWERING}; {SHIP_FOR_GPU}")
        if not self.inside and not self.outside and not self.jsep_only:
            out.append("WebGPU: no node without a WebGPU kernel (by docs/webgpu-kernels.md; `deform-surgeon "
                       "placement` measures)")
        return out


def kernel_report(model: onnx.ModelProto, types: Mapping, *more_types: Mapping) -> KernelReport:
    """The nodes of `model` that the table says have no WebGPU kernel and that ORT does not fold away, counted
    inside and outside the deform blocks. `types`: tensor name -> (element type, shape), e.g. a `TypeTable`;
    `more_types` are looked at for the names `types` lacks (a patched region's new tensors)."""
    index = GraphIndex(model)
    blocks = find_blocks(index)
    owner: dict[int, int] = {}
    for b, block in enumerate(blocks):
        for k in block.nodes:
            owner.setdefault(k, b)
    static = _folded(model, types)
    report = KernelReport(blocks=len(blocks))
    inside, outside = Counter(), Counter()
    hit: set[int] = set()
    for k, node in enumerate(index.nodes):
        if k in static:
            continue
        first = next((i for i in index.ins[k] if i), "")
        dtype = next((t for t in (_elem_type(table, first) for table in (types, *more_types)) if t), 0)
        why = why_no_kernel(node.op_type, node.domain, dtype)
        if why is None:
            jsep = why_no_jsep_kernel(node.op_type, dtype) if node.domain in ("", "ai.onnx", "com.microsoft") else None
            if jsep is not None:
                report.reasons[node.op_type] = jsep
                report.jsep_only[node.op_type] = report.jsep_only.get(node.op_type, 0) + 1
            continue
        report.reasons[node.op_type] = why
        if k in owner:
            inside[node.op_type] += 1
            hit.add(owner[k])
        else:
            outside[node.op_type] += 1
    report.inside, report.outside = dict(inside), dict(outside)
    report.blocks_resident = len(blocks) - len(hit)
    return report


# inputs that decide an op's output shape by their values (the others only by their shapes); an op listed with
# None has a data-dependent output shape whatever its inputs
SHAPE_ARGS: dict[str, tuple[int, ...] | None] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,), "TopK": (1,), "OneHot": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "CenterCropPad": (1,), "NonZero": None, "Unique": None, "Compress": None,
    "NonMaxSuppression": None, "If": None, "Loop": None, "Scan": None, "SequenceMap": None,
}


def _folded(model: onnx.ModelProto, types: Mapping) -> set[int]:
    """The nodes ORT folds into constants when a session is created: every input a constant, or a `Shape`/`Size`
    of a tensor whose shape is fixed. A shape is fixed when shape inference says so, or when it follows from the
    graph inputs' static dims through ops whose output shape depends on their inputs' shapes and on constant shape
    arguments only (ORT folds and re-infers in turn, which onnx's single inference pass does not: in a Swin
    backbone the window padding's sizes are computed, so inference alone leaves later shapes unknown)."""
    from .fold import NEVER_STATIC, SHAPE_OF

    graph = model.graph
    given = {i.name for i in graph.input}
    constant = {t.name for t in graph.initializer if t.name not in given}
    fixed = set(constant) | {i.name for i in graph.input
                             if all(d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)}
    folded: set[int] = set()
    for k, node in enumerate(graph.node):
        ins = [i for i in node.input if i]
        op = node.op_type
        custom = node.domain not in ("", "ai.onnx")
        if not custom and op not in NEVER_STATIC and (
                (op in SHAPE_OF and ins and (ins[0] in fixed or _static_dims(types, ins[0])))
                or (op not in SHAPE_OF and all(i in constant for i in ins))):
            folded.add(k)
            constant.update(node.output)
            fixed.update(node.output)
            continue
        args = SHAPE_ARGS.get(op, ())
        if (custom and node.domain != "com.microsoft") or args is None:  # onnxruntime's contrib ops (MatMulNBits,
            continue  # MatMulBnb4, ...) shape their outputs by their inputs' shapes and attributes
        if all(i in fixed or _static_dims(types, i) for i in ins) and \
                all(node.input[j] in constant for j in args if j < len(node.input) and node.input[j]):
            fixed.update(node.output)
    return folded


def _static_dims(types: Mapping, name: str) -> bool:
    try:
        shape = types[name][1]
    except KeyError:
        return False
    return shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)


def _elem_type(types: Mapping, name: str) -> int:
    if not name:
        return 0
    getter = getattr(types, "elem_type", None)
    if getter is not None:
        return getter(name)
    got = types.get(name)
    return got[0] if got else 0
