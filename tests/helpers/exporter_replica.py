#!/usr/bin/env python
"""A torch-free replica of the ONNX graph `scripts/make_fixtures.py` exports, at any size and channel count.

Why: a BiRefNet-sized fixture (1024x1024 input, 64 channels in the deformable blocks, so that the largest gather
output is BiRefNet's `[1, 1, 3211264, 64]`, 822 MB) is ~70 MB as a file, mostly the exporter's baked sampling
grid (`K * 2 * h * w` floats per deformable conv). Instead of committing it, the tests build it here, at test
time, deterministically, without torch (CI installs no torch).

It is the exporter's own graph, not an imitation: `build(SPECS[name], CopiedWeights(fixture))` reproduces each
committed exporter fixture (`tests/fixtures/decoder_*.onnx`, exported by torch 2.14.1 through
deform-conv2d-onnx-exporter 1.2.0) protobuf-for-protobuf, node for node, attribute for attribute, constant for
constant (`tests/passes/test_split.py` checks this). Only the weights of new sizes are new: seeded numpy draws with the
distributions of `make_fixtures.init_weights` (offsets ~1.5 px, so sampling points are fractional and some fall
outside the map).

The model is `make_fixtures.TinyBiRefNetDecoder`: a patchify stem, stride-2 encoder convs, and per scale a
BiRefNet `BasicDecBlk` (conv_in, `ASPPDeformable` with four deformable convs of kernels 1, 1, 3, 7 and a global
pool branch, conv_out), coarse to fine, with bilinear `align_corners` upsampling, 1x1 laterals and a sigmoid
head. Conv+BatchNorm pairs that torch's export fuses (conv_in, the pool branch, conv1, conv_out) appear fused,
as `t_<n>` initializers, exactly as in the export.

    python tests/helpers/exporter_replica.py birefnet64_1024 --out /tmp/birefnet64_1024.onnx
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
BN_EPS = float(np.float32(1e-5))
BN_MOMENTUM = float(np.float32(0.9))
KERNELS = (1, 1, 3, 7)  # aspp1, then aspp_deforms with BiRefNet's parallel_block_sizes (1, 3, 7)


@dataclass(frozen=True)
class Spec:
    """Mirrors make_fixtures.FixtureSpec + TinyBiRefNetDecoder's arguments."""

    image_size: int = 64
    stem_strides: tuple[int, ...] = (4,)
    channels: int = 8
    inter: int = 4  # channels gathered by every deformable conv (BiRefNet: 64)
    planes: int = 4  # output channels of every deformable conv (BiRefNet: 256)
    offset_groups: int = 1
    num_scales: int = 2
    batch: int = 1
    use_gathernd: bool = True
    seed: int = 1234
    # BatchNorm parameters of the deformable branches at torch's initial values (weight 1, bias 0, running mean 0,
    # running var 1), as in a BiRefNet built from its own code with random weights: torch's exporter then keeps
    # one tensor per distinct value and every other use reads it through an Identity node (in the real
    # BiRefNet-lite export, 19 of the 20 deformable blocks' BatchNorms read their parameters that way). ORT folds
    # the Identity away and fuses the BatchNorm into the Conv; a pass that takes such a parameter for a runtime
    # input does not (what once hid a split Conv's mismatch on the real 1024 graph).
    shared_bn: bool = False

    @property
    def feature_size(self) -> int:
        return self.image_size // math.prod(self.stem_strides)

    @property
    def sizes(self) -> list[int]:
        return [self.feature_size >> i for i in range(self.num_scales)]


SPECS: dict[str, Spec] = {
    # the committed exporter fixtures (for the replication check)
    "decoder_gathernd": Spec(),
    "decoder_gatherelements": Spec(use_gathernd=False),
    "decoder_gathernd_b2g2": Spec(batch=2, offset_groups=2),
    "decoder_gathernd_1024": Spec(image_size=1024, stem_strides=(4, 4, 4)),
    # BiRefNet's tensor sizes at 1024: four scales (256, 128, 64, 32) and 64 gathered channels, as in BiRefNet's
    # decoder (its deformable convs gather the 64 `inter` channels; planes 64 instead of BiRefNet's 256 only
    # changes the Conv output, 16.8 MB instead of 67 MB at 256x256)
    "birefnet64_1024": Spec(image_size=1024, stem_strides=(4,), channels=16, inter=64, planes=64, num_scales=4,
                            shared_bn=True),
    # the same graph with 4 channels: every block tensor is 16x smaller
    "birefnet4_1024": Spec(image_size=1024, stem_strides=(4,), channels=4, inter=4, planes=4, num_scales=4,
                           shared_bn=True),
    # for CI on the software adapter: 1024 input, 4 channels, two scales (64, 32): the 7x7 block at 64x64 is
    # 256x smaller than birefnet64_1024's at 256x256 (16x fewer channels, 16x fewer points), so a 256x smaller
    # limit (1 MiB) gives it the same 4 chunks
    "birefnet4_1024_small": Spec(image_size=1024, stem_strides=(4, 4), channels=4, inter=4, planes=4, num_scales=2,
                                 shared_bn=True),
}


# ------------------------------------------------------------------------------------------------ weights
class RandomWeights:
    """Seeded numpy draws in build order, with make_fixtures.init_weights' distributions."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def _f32(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def conv(self, name: str | None, shape: tuple[int, ...], offset: bool = False) -> tuple[np.ndarray, np.ndarray]:
        fan_in = math.prod(shape[1:])
        std = (1.5 if offset else math.sqrt(2.0)) / math.sqrt(fan_in)
        w = self._f32(self.rng.standard_normal(shape) * std)
        b = self._f32(self.rng.standard_normal(shape[0]) * (1.5 if offset else 0.1))
        return w, b

    def weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._f32(self.rng.standard_normal(shape) * math.sqrt(2.0) / math.sqrt(math.prod(shape[1:])))

    def bn(self, prefix: str, n: int) -> list[np.ndarray]:
        return [self._f32(0.5 + self.rng.random(n)), self._f32(0.1 * self.rng.standard_normal(n)),
                self._f32(0.1 * self.rng.standard_normal(n)), self._f32(0.5 + self.rng.random(n))]


class CopiedWeights:
    """The weights of an exported fixture: named parameters by name, torch's fused ones (`t_<n>`) in order."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.named = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
                      if not i.name.startswith("t_")}
        self._fused = [numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("t_")]
        self._next = 0

    def _take(self) -> np.ndarray:
        a = self._fused[self._next]
        self._next += 1
        return a

    def conv(self, name: str | None, shape: tuple[int, ...], offset: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if name is None:
            return self._take(), self._take()
        return self.named[f"{name}.weight"], self.named[f"{name}.bias"]

    def weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self.named[f"{name}.weight"]

    def bn(self, prefix: str, n: int) -> list[np.ndarray]:
        return [self.named[f"{prefix}.{k}"] for k in ("weight", "bias", "running_mean", "running_var")]


# ------------------------------------------------------------------------------------------------ builder
class _Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.named: dict[str, TensorProto] = {}
        self.fused: list[TensorProto] = []
        self._n = 0

    def _tmp(self) -> str:
        self._n += 1
        return f"v{self._n}"

    def op(self, op: str, inputs: Sequence[str], **attrs) -> str:
        out = self._tmp()
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    def const(self, value, dtype) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.array(value, dtype=dtype)))

    def param(self, name: str, value: np.ndarray) -> str:
        self.named[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def shared_param(self, name: str, value: np.ndarray) -> str:
        """A parameter as torch's exporter writes one whose value an earlier parameter already has: an Identity
        of that earlier one, named like the parameter (see Spec.shared_bn)."""
        for kept, tensor in self.named.items():
            if tensor.dims == list(value.shape) and numpy_helper.to_array(tensor).tobytes() == value.tobytes():
                self.nodes.append(helper.make_node("Identity", [kept], [name]))
                return name
        return self.param(name, value)

    def fused_param(self, value: np.ndarray) -> str:
        name = f"onnx::Conv_{len(self.fused)}"
        self.fused.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def conv(self, x: str, w: str, b: str | None, k: int, stride: int = 1, pad: int = 0) -> str:
        return self.op("Conv", [x, w] + ([b] if b else []), dilations=[1, 1], group=1, kernel_shape=[k, k],
                       pads=[pad] * 4, strides=[stride, stride])

    def resize(self, x: str, size: tuple[int, int]) -> str:
        shape = self.op("Shape", [x])
        axes = self.const([0], np.int64)
        starts = self.const([0], np.int64)
        ends = self.const([2], np.int64)
        nc = self.op("Slice", [shape, starts, ends, axes])
        sizes = self.op("Concat", [nc, self.const(list(size), np.int64)], axis=0)
        return self.op("Resize", [x, "", "", sizes], coordinate_transformation_mode="align_corners",
                       cubic_coeff_a=-0.75, mode="linear", nearest_mode="floor")


def _fused_conv(g: _Graph, wts, x: str, cin: int, cout: int, k: int, pad: int) -> str:
    w, b = wts.conv(None, (cout, cin, k, k))
    return g.conv(x, g.fused_param(w), g.fused_param(b), k, 1, pad)


def sampling_grid(k: int, h: int, w: int, additional_pad: int) -> np.ndarray:
    """The exporter's `p_0 + p_k` (stride 1, dilation 1): float32 [1, 1, k*k, 2, h, w]."""
    kk = k * k
    p0y, p0x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    p0 = np.concatenate([np.broadcast_to(p0y.reshape(1, 1, 1, 1, h, w), (1, 1, kk, 1, h, w)) + additional_pad,
                         np.broadcast_to(p0x.reshape(1, 1, 1, 1, h, w), (1, 1, kk, 1, h, w)) + additional_pad], axis=3)
    pky, pkx = np.meshgrid(np.arange(k), np.arange(k), indexing="ij")
    pk = np.concatenate([pky.reshape(1, 1, kk, 1, 1, 1), pkx.reshape(1, 1, kk, 1, 1, 1)], axis=3)
    return (p0 + pk).astype(np.float32)


def deform_conv2d(g: _Graph, spec: Spec, x: str, offset: str, mask: str, weight: str, k: int, pad: int,
                  hw: int) -> str:
    """deform_conv2d_onnx_exporter 1.2.0's `deform_conv2d` symbolic, as torch 2.14 emits it (opset 17)."""
    b, grp, kk = spec.batch, spec.offset_groups, k * k
    ch, ch_g = spec.inter, spec.inter // spec.offset_groups
    h = w = hw
    add_pad = 1 if pad == 0 else 0
    in_h = in_w = hw + 2 * (pad + add_pad)
    i64, f32 = np.int64, np.float32
    # calculate_p
    off = g.op("Reshape", [offset, g.const([b, grp, kk, 2, h, w], i64)])
    p = g.op("Add", [g.const(sampling_grid(k, h, w, add_pad), f32), off])
    # calculate_p_floor, calculate_p_tlbr
    p_floor = g.op("Floor", [p])
    p_int = g.op("Cast", [p_floor], to=TensorProto.INT64)

    def slice3(t: str, start: int) -> str:
        axes = g.const([3], i64)
        starts = g.const([start], i64)
        ends = g.const([start + 1], i64)
        return g.op("Slice", [t, starts, ends, axes])

    p_t, p_l = slice3(p_int, 0), slice3(p_int, 1)
    p_b = g.op("Add", [p_t, g.const(1, i64)])
    p_r = g.op("Add", [p_l, g.const(1, i64)])

    def clip(t: str, hi: int) -> str:
        lo_c = g.const(0, i64)
        hi_c = g.const(hi - 1, i64)
        return g.op("Clip", [t, lo_c, hi_c])

    coords = {"t": clip(p_t, in_h), "l": clip(p_l, in_w), "b": clip(p_b, in_h), "r": clip(p_r, in_w)}
    # calculate_weight
    diff = g.op("Sub", [p, p_floor])
    dy, dx = slice3(diff, 0), slice3(diff, 1)
    dy_inv = g.op("Sub", [g.const(1.0, f32), dy])
    dx_inv = g.op("Sub", [g.const(1.0, f32), dx])
    weights = {"tl": g.op("Mul", [dx_inv, dy_inv]), "br": g.op("Mul", [dx, dy]),
               "bl": g.op("Mul", [dx_inv, dy]), "tr": g.op("Mul", [dx, dy_inv])}
    weights = {key: g.op("Reshape", [v, g.const([b, grp, 1, kk, h, w], i64)]) for key, v in weights.items()}
    # reshape_input_for_gather_elements
    pp = pad + add_pad
    padded = g.op("Pad", [x, g.const([0, 0, pp, pp, 0, 0, pp, pp], i64)], mode="constant")
    data = g.op("Reshape", [padded, g.const([b, grp, ch_g, in_h, in_w], i64)])
    # gather_elements_tlbr
    values = {}
    n = kk * h * w
    for key in ("tl", "br", "bl", "tr"):
        py, px = coords[key[0]], coords[key[1]]
        if spec.use_gathernd:
            py = g.op("Reshape", [py, g.const([b, grp, n, 1], i64)])
            px = g.op("Reshape", [px, g.const([b, grp, n, 1], i64)])
            index = g.op("Concat", [py, px], axis=3)
            d = g.op("Transpose", [data], perm=[0, 1, 3, 4, 2])
            v = g.op("GatherND", [d, index], batch_dims=2)
            v = g.op("Transpose", [v], perm=[0, 1, 3, 2])
        else:
            py = g.op("Reshape", [py, g.const([b, grp, 1, n], i64)])
            px = g.op("Reshape", [px, g.const([b, grp, 1, n], i64)])
            py = g.op("Mul", [py, g.const(in_w, i64)])
            index = g.op("Add", [py, px])
            index = g.op("Expand", [index, g.const([b, grp, ch_g, n], i64)])
            d = g.op("Reshape", [data, g.const([b, grp, ch_g, in_h * in_w], i64)])
            v = g.op("GatherElements", [d, index], axis=3)
        values[key] = g.op("Reshape", [v, g.const([b, grp, ch_g, kk, h, w], i64)])
    # calculate_weighted_sum, apply_mask, reshape_v_for_conv, apply_conv, apply_bias
    v = g.op("Sum", [g.op("Mul", [weights[key], values[key]]) for key in values])
    m = g.op("Reshape", [mask, g.const([b, grp, 1, kk, h, w], i64)])
    v = g.op("Mul", [v, m])
    v = g.op("Reshape", [v, g.const([b, ch, k, k, h, w], i64)])
    v = g.op("Transpose", [v], perm=[0, 1, 4, 2, 5, 3])
    v = g.op("Reshape", [v, g.const([b, ch, h * k, w * k], i64)])
    v = g.op("Conv", [v, weight], group=1, kernel_shape=[k, k], strides=[k, k])
    return g.op("Add", [v, g.const(np.zeros((1, spec.planes, 1, 1)), f32)])


def _aspp_branch(g: _Graph, spec: Spec, wts, x: str, prefix: str, k: int, hw: int) -> str:
    """make_fixtures.ASPPModuleDeformable: DeformableConv2d -> BatchNorm -> ReLU."""
    pad = k // 2
    kk, grp, cin = k * k, spec.offset_groups, spec.inter
    ow, ob = wts.conv(f"{prefix}.atrous_conv.offset_conv", (2 * grp * kk, cin, k, k), offset=True)
    offset = g.conv(x, g.param(f"{prefix}.atrous_conv.offset_conv.weight", ow),
                    g.param(f"{prefix}.atrous_conv.offset_conv.bias", ob), k, 1, pad)
    mw, mb = wts.conv(f"{prefix}.atrous_conv.modulator_conv", (grp * kk, cin, k, k))
    mod = g.conv(x, g.param(f"{prefix}.atrous_conv.modulator_conv.weight", mw),
                 g.param(f"{prefix}.atrous_conv.modulator_conv.bias", mb), k, 1, pad)
    mod = g.op("Mul", [g.op("Sigmoid", [mod]), g.const(2.0, np.float32)])
    rw = g.param(f"{prefix}.atrous_conv.regular_conv.weight",
                 wts.weight(f"{prefix}.atrous_conv.regular_conv", (spec.planes, cin, k, k)))
    v = deform_conv2d(g, spec, x, offset, mod, rw, k, pad, hw)
    keys = ("weight", "bias", "running_mean", "running_var")
    if spec.shared_bn:
        bn = [g.shared_param(f"{prefix}.bn.{n}", np.full(spec.planes, v, np.float32))
              for n, v in zip(keys, (1.0, 0.0, 0.0, 1.0), strict=True)]
    else:
        bn = [g.param(f"{prefix}.bn.{n}", a) for n, a in zip(keys, wts.bn(f"{prefix}.bn", spec.planes), strict=True)]
    v = g.op("BatchNormalization", [v, *bn], epsilon=BN_EPS, momentum=BN_MOMENTUM, training_mode=0)
    return g.op("Relu", [v])


def _dec_block(g: _Graph, spec: Spec, wts, x: str, i: int) -> str:
    """make_fixtures.BasicDecBlk with its ASPPDeformable (BatchNorms after plain convs fused, as torch exports)."""
    hw = spec.sizes[i]
    prefix = f"decoder_blocks.{i}.dec_att"
    x = g.op("Relu", [_fused_conv(g, wts, x, spec.channels, spec.inter, 3, 1)])
    names = ["aspp1"] + [f"aspp_deforms.{j}" for j in range(len(KERNELS) - 1)]
    branches = [_aspp_branch(g, spec, wts, x, f"{prefix}.{name}", k, hw) for name, k in zip(names, KERNELS,
                                                                                              strict=True)]
    pooled = g.op("GlobalAveragePool", [x])
    pooled = g.op("Relu", [_fused_conv(g, wts, pooled, spec.inter, spec.planes, 1, 0)])
    branches.append(g.resize(pooled, (hw, hw)))
    x = g.op("Concat", branches, axis=1)
    x = g.op("Relu", [_fused_conv(g, wts, x, spec.planes * len(branches), spec.inter, 1, 0)])
    return _fused_conv(g, wts, x, spec.inter, spec.channels, 3, 1)


def state_dict_order(spec: Spec) -> list[str]:
    """Named parameters in torch's state_dict order (the export's initializer order)."""
    names = []
    for j in range(len(spec.stem_strides)):
        names += [f"stem.{2 * j}.weight", f"stem.{2 * j}.bias"]
    for j in range(spec.num_scales - 1):
        names += [f"encoder.{j}.0.weight", f"encoder.{j}.0.bias"]
    for i in range(spec.num_scales):
        for name in ["aspp1"] + [f"aspp_deforms.{j}" for j in range(len(KERNELS) - 1)]:
            p = f"decoder_blocks.{i}.dec_att.{name}"
            names += [f"{p}.atrous_conv.offset_conv.weight", f"{p}.atrous_conv.offset_conv.bias",
                      f"{p}.atrous_conv.modulator_conv.weight", f"{p}.atrous_conv.modulator_conv.bias",
                      f"{p}.atrous_conv.regular_conv.weight", f"{p}.bn.weight", f"{p}.bn.bias",
                      f"{p}.bn.running_mean", f"{p}.bn.running_var"]
    for j in range(spec.num_scales - 1):
        names += [f"lateral_blocks.{j}.weight", f"lateral_blocks.{j}.bias"]
    return names + ["head.weight", "head.bias"]


def build(spec: Spec, weights=None) -> onnx.ModelProto:
    """The exported ONNX model of `spec` (weights: RandomWeights(spec.seed) unless given)."""
    if spec.inter % spec.offset_groups:
        raise ValueError(f"inter={spec.inter} not divisible by offset_groups={spec.offset_groups}")
    wts = weights if weights is not None else RandomWeights(spec.seed)
    g = _Graph()
    x, cin = "image", 3
    for j, s in enumerate(spec.stem_strides):
        w, b = wts.conv(f"stem.{2 * j}", (spec.channels, cin, s, s))
        x = g.op("Relu", [g.conv(x, g.param(f"stem.{2 * j}.weight", w), g.param(f"stem.{2 * j}.bias", b), s, s)])
        cin = spec.channels
    feats = [x]
    for j in range(spec.num_scales - 1):
        w, b = wts.conv(f"encoder.{j}.0", (spec.channels, spec.channels, 3, 3))
        feats.append(g.op("Relu", [g.conv(feats[-1], g.param(f"encoder.{j}.0.weight", w),
                                          g.param(f"encoder.{j}.0.bias", b), 3, 2, 1)]))
    p = _dec_block(g, spec, wts, feats[-1], spec.num_scales - 1)
    for i in range(spec.num_scales - 2, -1, -1):
        up = g.resize(p, (spec.sizes[i], spec.sizes[i]))
        w, b = wts.conv(f"lateral_blocks.{i}", (spec.channels, spec.channels, 1, 1))
        lat = g.conv(feats[i], g.param(f"lateral_blocks.{i}.weight", w), g.param(f"lateral_blocks.{i}.bias", b), 1)
        p = _dec_block(g, spec, wts, g.op("Add", [up, lat]), i)
    w, b = wts.conv("head", (1, spec.channels, 1, 1))
    logits = g.conv(p, g.param("head.weight", w), g.param("head.bias", b), 1)
    up = g.resize(logits, (spec.image_size, spec.image_size))
    g.nodes.append(helper.make_node("Sigmoid", [up], ["mask"]))

    order = [n for n in state_dict_order(spec) if n in g.named or not spec.shared_bn]
    assert sorted(order) == sorted(g.named), set(order) ^ set(g.named)
    size = spec.image_size
    graph = helper.make_graph(
        g.nodes, "main_graph",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [spec.batch, 3, size, size])],
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [spec.batch, 1, size, size])],
        [g.named[n] for n in order] + g.fused)
    model = helper.make_model(graph, opset_imports=[onnx.OperatorSetIdProto(version=OPSET)], ir_version=8,
                              producer_name="pytorch", producer_version="2.14.1")
    return canonicalize(model)


def deform_conv_model(batch: int = 1, channels: int = 4, planes: int = 3, k: int = 3, size: int = 8,
                      groups: int = 1, use_gathernd: bool = True, seed: int = 0) -> onnx.ModelProto:
    """One deformable conv alone, exactly as the exporter emits it: inputs `x` [B, C, S, S], `offset`
    [B, 2*G*k*k, S, S] and `mask` [B, G*k*k, S, S] (padding k//2, stride 1), output `y` [B, planes, S, S]."""
    spec = Spec(batch=batch, inter=channels, planes=planes, offset_groups=groups, use_gathernd=use_gathernd)
    g = _Graph()
    rng = np.random.default_rng(seed)
    weight = g.param("weight", (rng.standard_normal((planes, channels, k, k)) / math.sqrt(channels * k * k))
                     .astype(np.float32))
    y = deform_conv2d(g, spec, "x", "offset", "mask", weight, k, k // 2, size)
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    kk = groups * k * k
    graph = helper.make_graph(
        g.nodes, "deform_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, size, size]),
         helper.make_tensor_value_info("offset", TensorProto.FLOAT, [batch, 2 * kk, size, size]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [batch, kk, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, planes, size, size])],
        list(g.named.values()))
    return canonicalize(helper.make_model(graph, opset_imports=[onnx.OperatorSetIdProto(version=OPSET)],
                                          ir_version=8))


def canonicalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Nodes `<Op>_<i>`, unnamed values `t_<n>` in order of first appearance (scripts/make_fixtures.py's
    `canonicalize` calls this one; its docstring says why)."""
    g = model.graph
    keep = {i.name for i in g.input} | {o.name for o in g.output}
    keep |= {t.name for t in g.initializer if not t.name.startswith("onnx::")}
    rename: dict[str, str] = {}

    def short(old: str) -> str:
        if old == "" or old in keep:
            return old
        if old not in rename:
            rename[old] = f"t_{len(rename)}"
        return rename[old]

    for tensor in g.initializer:
        tensor.name = short(tensor.name)
        tensor.doc_string = ""
    for i, node in enumerate(g.node):
        node.name = f"{node.op_type}_{i}"
        node.doc_string = ""
        for j, name in enumerate(node.input):
            node.input[j] = short(name)
        for j, name in enumerate(node.output):
            node.output[j] = short(name)
    for vi in g.value_info:
        vi.name = short(vi.name)
    model.doc_string = ""
    g.doc_string = ""
    return model


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", choices=sorted(SPECS), help="which model")
    ap.add_argument("--out", type=Path, required=True, help="output .onnx")
    ap.add_argument("--weights-from", type=Path, help="copy the weights of this exported fixture (same spec)")
    args = ap.parse_args(argv)
    weights = CopiedWeights(onnx.load(str(args.weights_from))) if args.weights_from else None
    model = build(SPECS[args.spec], weights)
    onnx.save_model(model, str(args.out))
    print(f"wrote {args.out} ({args.out.stat().st_size:,} B, {len(model.graph.node)} nodes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
