"""The op vocabulary every part of deform_surgeon shares: which ops sample, which are heavy, which are per element.

Why one place: the block finder, the region, the budget and the split/bands passes all walk the exporter's deform
blocks; when each kept its own op sets they disagreed about where a block ends (a node counted in one table and not
in another), so their reports could not be joined.
"""

from __future__ import annotations

from collections import Counter

import onnx
import onnx_graphsurgeon as gs

SAMPLERS = {"GatherND", "GatherElements", "Gather"}  # a deform block samples with one of these (Gather once lowered)
EXPORTED_SAMPLERS = {"GatherND", "GatherElements"}  # as deform-conv2d-onnx-exporter writes them
SAMPLING_START = "Floor"  # the exporter's sampling starts at a Floor of the sampling coordinates
DEFORM_CONV = "DeformConv"  # torch's dynamo exporter writes a whole deformable conv as this one ONNX op
# the op that consumes a block's sampled values: the exporter's Conv (a ConvInteger in onnxruntime's 8-bit files),
# or the MatMul a lowered DeformConv ends in
BLOCK_GEMMS = ("Conv", "ConvInteger", "MatMul")

# Ops that do real work on every element of large tensors (or hold subgraphs): a walk through a model's
# structure stops at them, because past them lies another layer, not the deform block.
HEAVY = {"Conv", "ConvTranspose", "MatMul", "Gemm", "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN",
         "Resize", "If", "Loop", "Scan",
         # the same layers in onnxruntime's quantized files (8-bit dynamic, 4-bit MatMulNBits / MatMulBnb4)
         "ConvInteger", "MatMulInteger", "MatMulNBits", "MatMulBnb4"}
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}  # the standard ops with graph attributes

# Elementwise ops compute each output element from the elements at the same (broadcast) position only; shape ops
# move elements without changing them.
ELEMENTWISE_UNARY = {"Cast", "Identity", "Relu", "Neg", "Abs", "Floor", "Ceil", "Sigmoid", "Tanh", "Exp",
                     "Sqrt", "Reciprocal", "Erf", "Sign", "Round"}
ELEMENTWISE_NARY = {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Pow"}
SHAPE_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten"}
TAIL_OPS = ELEMENTWISE_UNARY | ELEMENTWISE_NARY | {"BatchNormalization"}  # per-channel ops after a Conv
TAIL_STEPS = 4  # how many of them a Conv's tail may hold (the exporter's bias Add, BatchNorm, activation)


def op_histogram(graph: gs.Graph | onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op type `graph` (a graph-surgeon graph or a model's main graph) holds, by op name."""
    ops = (n.op_type for n in graph.graph.node) if isinstance(graph, onnx.ModelProto) else (n.op for n in graph.nodes)
    return dict(sorted(Counter(ops).items()))
