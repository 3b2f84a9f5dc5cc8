"""How the fitting passes (split, bands) cut a tensor into parts and join parts again, so that ORT CPU rounds a
float16 model where it rounded it before the cut.

Why a module of its own: in a float32 model a cut is a Slice and a join a Concat, pure data movement, exact by
construction. In a float16 model (transformers.js's fp16 and q4f16 files) it is not so simple. ORT CPU has no
float16 kernel for most ops (Mul, Add, Sub, Conv, BatchNormalization, Relu, Pad); it runs them in float32 behind
Casts it inserts and drops the Cast pairs between two of them, and it also runs in float32 a node that has a
float16 kernel when every neighbour runs in float32 (its InsertCastTransformer). So most float16 tensors of such a
model are float32 values never rounded to float16. A Slice or a Concat has a float16 kernel: put between two
float32 nodes, it makes ORT round the value to float16 where the original did not (measured: 4.9e-4 on
tests/fixtures/decoder_gathernd_fp16.onnx, docs/variants.md).

So for float16 data:
* a cut is a **Pad with negative pads**: it removes the same rows as the Slice and has no float16 CPU kernel, so
  ORT runs it in float32 like the nodes around it (and where the value was float16 already, float16 -> float32 ->
  float16 is exact);
* a join is a Concat followed by a **Pad with zero pads** (a copy): then the Concat's readers and writers all run in
  float32 and ORT runs the Concat in float32 too, where a bare Concat would round the parts.

Both Pads have kernels on the native WebGPU EP and on JSEP and give the Slice's and Concat's bytes there (tests).
Where ORT rounds depends on the graph, not on the values, but a local proof of a region cannot show it (the
region's inputs would be float16 graph inputs, rounded already): a float16 rewrite is shown exact by the whole
patched model at levels `disable` and `all` (`FLOAT16_LEVELS`, read by `patch`'s whole-model check).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.pipeline import Context
from ..graph.shapes import Shapes

FLOAT16_LEVELS = ("disable", "all")  # where a float16 rewrite is shown exact: the whole model at both levels
FLOAT16_NOTE = ("; float16: its cuts are Pads and its joins are followed by a zero Pad, which have no float16 CPU "
                "kernel, so ORT CPU keeps in float32 what it kept in float32 before the cut (a Slice or a bare "
                "Concat would round it), and it is written only once the whole model is shown byte-identical on "
                "ORT CPU at levels disable and all")


def float16_details(float16: bool) -> dict:
    """What a float16 rewrite's action says of itself: `patch`'s whole-model check reads `verify_levels`."""
    return {"float16": True, "verify_levels": list(FLOAT16_LEVELS)} if float16 else {}


def is_float16(t: gs.Tensor) -> bool:
    return t.dtype is not None and np.dtype(t.dtype) == np.float16


def made_by_ort(model_path: str | Path) -> frozenset[str]:
    """The tensors of a model that ORT CPU makes with the model's own nodes, read from ORT's optimized graph at level
    `disable`. A float16 tensor not among them is one ORT holds in float32: its producer runs on a float32 kernel
    (no float16 kernel, or ORT's isolated-node rule), and the tensor is either gone from that graph or made by one
    of the Casts ORT inserts. The fitting passes cut such a tensor with a Pad, and one whose producer runs in
    float16 with a Slice, so that the cut's readers see what the tensor's readers saw (`Context.held_in_float32`).

    Why ask ORT: which ops have float16 CPU kernels, and which nodes its isolated-node rule moves to float32, is
    ORT's kernel registry and ORT's walk of the graph; a table here would drift from the installed ORT."""
    from ..proofs.precision import rounding

    return rounding(model_path, "disable").made_by_model()


def cut(ctx: Context, base: str, t: gs.Tensor, start: int, end: int, axis: int, out: gs.Tensor, size: int,
        float32: bool = True) -> gs.Tensor:
    """`out` = `t[start:end]` along `axis` (of `size`): a Slice with constant bounds (a float Slice has a kernel on
    both WebGPU EPs), or for float16 data that ORT CPU holds in float32 (`float32`) a Pad with negative pads (see
    the module docstring)."""
    if not is_float16(out) or not float32:
        ctx.node("Slice", base, [t, ctx.const(f"{base}/starts", np.array([start], np.int64)),
                                 ctx.const(f"{base}/ends", np.array([end], np.int64)),
                                 ctx.const(f"{base}/axes", np.array([axis], np.int64))], [out])
        return out
    rank = len(out.shape)
    pads = np.zeros(2 * rank, np.int64)
    pads[axis], pads[rank + axis] = -start, -(size - end)
    ctx.node("Pad", base, [t, ctx.const(f"{base}/pads", pads)], [out])
    return out


def join(ctx: Context, base: str, parts: list[gs.Tensor], out: gs.Tensor, axis: int, shapes: Shapes,
         float32: bool = True) -> gs.Tensor:
    """`out` = the Concat of `parts` along `axis`; for float16 data that ORT CPU held in float32 (`float32`: the
    whole's producer ran on a float32 kernel) followed by a Pad with zero pads (a copy), so that ORT CPU runs the
    Concat in float32 between float32 nodes (see the module docstring)."""
    dtype, shape = shapes.dtype(out), shapes.shape(out)
    if dtype is None or np.dtype(dtype) != np.float16 or shape is None or not float32:
        ctx.node("Concat", base, parts, [out], {"axis": axis})
        return out
    joined = ctx.var(f"{out.name}/joined", dtype, shape)
    ctx.node("Concat", base, parts, [joined], {"axis": axis})
    ctx.node("Pad", f"{base}/copy", [joined, ctx.const(f"{base}/no_pads", np.zeros(2 * len(shape), np.int64))], [out])
    return out
