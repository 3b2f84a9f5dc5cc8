"""Sum -> a left-to-right chain of binary Add.

Why: neither WebGPU EP has a `Sum` kernel, so every Sum runs on the CPU EP with Memcpy nodes around it.
ORT CPU's `Sum` is a strict left fold `((x0 + x1) + x2) + x3` with broadcasting, so the chain of `Add`s in the
same order is bit-identical.

fp16 (and bf16): ORT CPU has no fp16 Sum kernel and runs it as "cast to fp32, Sum, cast back" (one rounding).
An fp16 `Add` chain on a GPU with shader-f16 rounds to fp16 after every step, which differs; ORT CPU cannot see
the difference because it wraps fp16 Adds in the same casts. So for 16-bit floats the chain is built in fp32
explicitly and cast back once: exact by construction on both sides, not only on the CPU. (In the browser the
original Sum runs on the CPU EP and is fed fp16 tensors made on the GPU; this is exactly that computation. Note
that ORT CPU alone runs a whole fp16 Mul -> Sum island in fp32 without rounding the Mul results, so fp16 outputs
of ORT CPU and of a GPU differ for the original model too; tests/passes/test_sum_chain.py checks the replacement with
the real fp16 tensors of the converted fixture, op by op as a GPU rounds.)

`tree` mode (`(x0 + x1) + (x2 + x3)`) has a shorter dependency chain but is NOT bit-identical to the original
(float addition is not associative); `none` leaves Sums alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse

_WIDEN = {np.dtype(np.float16): np.float32}
_BFLOAT16 = "bfloat16"


class ChainSum(Pass):
    """Replace each Sum with Add nodes (chain: bit-identical; tree: not) or Identity for a single input."""

    name = "sum_chain"

    def matches(self, ctx: Context) -> list[gs.Node]:
        if ctx.options.sum_mode == "none":
            return []
        return [n for n in ctx.graph.nodes if n.op == "Sum"]

    def check(self, ctx: Context, node: gs.Node):
        """The plan: the Sum's element type (it decides whether the chain is widened to float32); or `Refuse`."""
        if not node.inputs:
            raise Refuse("Sum has no inputs")
        dtype = self._dtype(ctx, node)
        if dtype is None:
            raise Refuse("element type of the Sum is not known, so exactness in 16-bit floats cannot be guaranteed")
        return dtype

    def _dtype(self, ctx: Context, node: gs.Node):
        for t in [node.outputs[0], *node.inputs]:
            dtype = ctx.prover.dtype(t)
            if dtype is not None:
                return dtype
        info = ctx.types.get(node.outputs[0].name)
        if info is not None and info[0] == onnx.TensorProto.BFLOAT16:
            return _BFLOAT16
        return None

    def rewrite(self, ctx: Context, node: gs.Node, dtype) -> Action:
        out = node.outputs[0]
        inputs = list(node.inputs)
        base = node.name or out.name
        node.outputs.clear()
        if len(inputs) == 1:
            ctx.node("Identity", f"{base}/identity", inputs, [out])
            return Action(self.name, node.name, node.op, Outcome.REWRITTEN, "one-input Sum is an Identity",
                          details={"inputs": 1})

        wide = np.float32 if (dtype == _BFLOAT16 or dtype in _WIDEN) else None
        if wide is not None:
            inputs = [self._cast(ctx, t, f"{base}/to_fp32_{i}", wide, onnx.TensorProto.FLOAT)
                      for i, t in enumerate(inputs)]
        final = ctx.var(f"{base}/fp32", wide, None) if wide is not None else out
        self._adds(ctx, inputs, final, base, dtype=wide or dtype)
        if wide is not None:
            to = onnx.TensorProto.BFLOAT16 if dtype == _BFLOAT16 else onnx.helper.np_dtype_to_tensor_dtype(dtype)
            ctx.node("Cast", f"{base}/round_once", [final], [out], {"to": to})
        how = "left-to-right Add chain, ORT CPU's own order"
        if ctx.options.sum_mode == "tree":
            how = "balanced Add tree (NOT bit-identical: float addition is not associative)"
        if wide is not None:
            how += ", accumulated in fp32 and rounded once like ORT CPU's fp16 Sum"
        return Action(self.name, node.name, node.op, Outcome.REWRITTEN, f"{len(node.inputs)}-input Sum -> {how}",
                      details={"inputs": len(node.inputs), "mode": ctx.options.sum_mode,
                               "accumulate": "float32" if wide is not None else str(dtype)})

    def _adds(self, ctx: Context, inputs: list[gs.Tensor], out: gs.Tensor, base: str, dtype) -> None:
        if ctx.options.sum_mode == "tree":
            level = 0
            while len(inputs) > 2:
                nxt = []
                for i in range(0, len(inputs) - 1, 2):
                    nxt.append(ctx.layer("Add", f"{base}/add_tree{level}_{i // 2}", [inputs[i], inputs[i + 1]], dtype,
                                         None, output=f"{base}/tree{level}_{i // 2}"))
                if len(inputs) % 2:
                    nxt.append(inputs[-1])
                inputs, level = nxt, level + 1
            ctx.node("Add", f"{base}/add_tree{level}", inputs, [out])
            return
        acc = inputs[0]
        for i, t in enumerate(inputs[1:], start=1):
            target = out if i == len(inputs) - 1 else ctx.var(f"{base}/partial{i}", dtype, None)
            ctx.node("Add", f"{base}/add{i}", [acc, t], [target])
            acc = target

    @staticmethod
    def _cast(ctx: Context, t: gs.Tensor, base: str, dtype, to: int) -> gs.Tensor:
        return ctx.layer("Cast", base, [t], dtype, None, {"to": to})
