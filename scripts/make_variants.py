#!/usr/bin/env python
"""Make the dtype variants a transformers.js model repository ships, from one fp32 ONNX export, the way
transformers.js's conversion script makes them (docs/variants.md):

    model.onnx            the export as it is
    (every other variant starts from onnxslim.slim of the export: the quantizers need the Conv weights as
    initializers, which the exporter writes as Constant nodes)
    model_fp16.onnx       float16 with keep_io_types (onnxconverter-common), then onnxslim.slim
    model_quantized.onnx  dynamic IntegerOps quantization, QUInt8 weights (ConvInteger, MatMulInteger,
                          DynamicQuantizeLinear)
    model_int8.onnx       the same, QInt8 weights
    model_uint8.onnx      the same, QUInt8 weights
    model_q4.onnx         MatMulNBitsQuantizer, block 32, symmetric (MatMulNBits)
    model_q4f16.onnx      q4, then the fp16 step
    model_bnb4.onnx       MatMulBnb4Quantizer, NF4, block 64 (MatMulBnb4)

    python scripts/make_variants.py EXPORT.onnx OUT_DIR [--only fp16,q4]

Needs onnxruntime, onnxslim, onnxconverter-common and onnx-ir (the `test` extras; onnxruntime's MatMulNBitsQuantizer
imports onnx_ir). Models over 2 GB are not handled.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

VARIANTS = ("fp32", "fp16", "quantized", "int8", "uint8", "q4", "q4f16", "bnb4")
FILE_NAMES = {"fp32": "model.onnx", **{v: f"model_{v}.onnx" for v in VARIANTS if v != "fp32"}}


def slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    return onnxslim.slim(model)


def fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxconverter_common import float16

    # the 4-bit quantizers leave the fp32 model's inferred value_info behind, which the converter takes for the
    # types of its Casts (measured: q4 -> float16 then fails to load, "Type (tensor(float)) of output arg ... does
    # not match"); inference from scratch gives the right ones
    del model.graph.value_info[:]
    return slim(float16.convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False))


def integer_ops(model: onnx.ModelProto, weight_type: str) -> onnx.ModelProto:
    """onnxruntime's dynamic quantization with every op of its IntegerOps registry, MatMul with constant B only."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    with tempfile.TemporaryDirectory(prefix="make_variants_") as d:
        src, out = Path(d) / "in.onnx", Path(d) / "out.onnx"
        onnx.save(model, src)
        quantize_dynamic(src, out, weight_type=getattr(QuantType, weight_type),
                         op_types_to_quantize=list(IntegerOpsRegistry), extra_options={"MatMulConstBOnly": True})
        return onnx.load(out)


def q4(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True)
    quant.process()
    return quant.model.model


def bnb4(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

    quant = MatMulBnb4Quantizer(model, MatMulBnb4Quantizer.NF4, 64)
    quant.process()
    return quant.model.model


MAKERS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "fp16": fp16,
    "quantized": lambda m: integer_ops(m, "QUInt8"),
    "int8": lambda m: integer_ops(m, "QInt8"),
    "uint8": lambda m: integer_ops(m, "QUInt8"),
    "q4": q4,
    "q4f16": lambda m: fp16(q4(m)),
    "bnb4": bnb4,
}


def make_variants(export: onnx.ModelProto, out_dir: Path, only: tuple[str, ...] = VARIANTS) -> dict[str, Path]:
    """Write the variants in `only` into `out_dir` (transformers.js's file names); return variant -> path."""
    base = slim(export) if set(only) - {"fp32"} else None
    written = {}
    for name in only:
        path = Path(out_dir) / FILE_NAMES[name]
        model = export if name == "fp32" else MAKERS[name](onnx.ModelProto.FromString(base.SerializeToString()))
        onnx.save(model, path)
        written[name] = path
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="the fp32 ONNX export")
    parser.add_argument("out_dir", help="folder for the variants (created)")
    parser.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    args = parser.parse_args(argv)
    only = tuple(v for v in args.only.split(",") if v)
    unknown = [v for v in only if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for name, path in make_variants(onnx.load(args.export), Path(args.out_dir), only).items():
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
