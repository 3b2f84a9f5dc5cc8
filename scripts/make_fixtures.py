#!/usr/bin/env python
"""Build the committed ONNX test fixtures for ``deform_surgeon``.

The fixtures are small BiRefNet-style decoders whose deformable convolutions are exported with the *real*
``deform-conv2d-onnx-exporter`` 1.2.0 (the exporter BiRefNet users run), so the surgery passes are tested
against exactly the subgraph shapes they meet in the wild, not against a hand-written imitation.

Usage::

    python scripts/make_fixtures.py [--out DIR] [--only NAME ...] [--no-verify]

Every fixture is built from fixed seeds and is byte-for-byte reproducible: running the script twice gives
identical files (see ``--only`` / sha256 in the printed report).  Needs the ``fixtures`` extra
(torch==2.14.1, torchvision==0.29.1, deform-conv2d-onnx-exporter==1.2.0, onnxconverter-common).

Quirks worked around here (see also docs/fixtures.md):

* torch >= 2.9 exports with dynamo by default, which never calls the exporter's TorchScript symbolic, so we
  pass ``dynamo=False``.
* torch 2.14 moved ``torch.onnx._type_utils`` to ``torch.onnx._internal.torchscript_exporter._type_utils``.
  The exporter does ``from torch.onnx._type_utils import JitScalarType`` and silently falls back to a legacy
  code path (``KeyError: <JitScalarType.FLOAT: 6>``) if that import fails, so we alias the moved module under
  the old name in ``sys.modules`` *before* importing the exporter.
* The exporter bakes spatial sizes into Reshape/Constant nodes, so every ``F.interpolate`` gets static
  Python-int sizes (computed at construction time), never traced ``x.shape`` values.
* Determinism: weights come from explicit seeded ``torch.Generator``s and the export runs with
  ``torch.use_deterministic_algorithms(True)`` on CPU; the TorchScript export itself is then byte-stable.
  Running the script twice, or with ``--only``, gives byte-identical files (verified with sha256).
* Size: names are shortened (see :func:`canonicalize`) and channels kept tiny (see TinyBiRefNetDecoder).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F  # noqa: N812 - conventional torch alias
import torch.onnx._internal.torchscript_exporter._type_utils as _moved_type_utils
import torchvision.ops
from onnxconverter_common import float16
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.exporter_replica import canonicalize as replica_canonicalize  # noqa: E402 (torch-free)

# Must happen before the exporter is imported: it imports JitScalarType from the pre-2.14 location.
sys.modules.setdefault("torch.onnx._type_utils", _moved_type_utils)
torch.onnx._type_utils = _moved_type_utils  # type: ignore[attr-defined]

import deform_conv2d_onnx_exporter  # noqa: E402 - must follow the sys.modules alias above

OPSET = 17
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"
INPUT_NAME = "image"
OUTPUT_NAME = "mask"
FP32_ATOL = 1e-4
# fp16 end-to-end (input, weights, sampling coordinates) vs the fp32 torch model; a sanity bound, not a spec.
FP16_ATOL = 2e-2


# ----------------------------------------------------------------------------------------------------------
# Model: a miniature of BiRefNet's decoder (BasicDecBlk + ASPPDeformable), with few channels.
# ----------------------------------------------------------------------------------------------------------


class DeformableConv2d(nn.Module):
    """BiRefNet's ``DeformableConv2d``, generalised to ``offset_groups`` offset groups.

    BiRefNet zero-initialises ``offset_conv``/``modulator_conv``; we initialise them randomly (see
    :func:`init_weights`) so that sampling points land on fractional and out-of-bounds positions and the
    bilinear/clipping paths of the exported graph are actually exercised.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        offset_groups: int = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if in_channels % offset_groups:
            raise ValueError(f"in_channels={in_channels} not divisible by offset_groups={offset_groups}")
        kk = kernel_size * kernel_size
        self.stride = (stride, stride)
        self.padding = padding
        self.offset_conv = nn.Conv2d(
            in_channels, 2 * offset_groups * kk, kernel_size, stride, padding, bias=True
        )
        self.modulator_conv = nn.Conv2d(
            in_channels, offset_groups * kk, kernel_size, stride, padding, bias=True
        )
        self.regular_conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = self.offset_conv(x)
        modulator = 2.0 * torch.sigmoid(self.modulator_conv(x))
        return torchvision.ops.deform_conv2d(
            input=x,
            offset=offset,
            weight=self.regular_conv.weight,
            bias=self.regular_conv.bias,
            padding=self.padding,
            mask=modulator,
            stride=self.stride,
        )


class ASPPModuleDeformable(nn.Module):
    """BiRefNet's ``_ASPPModuleDeformable``: DeformableConv2d -> BatchNorm -> ReLU."""

    def __init__(
        self, in_channels: int, planes: int, kernel_size: int, padding: int, offset_groups: int
    ) -> None:
        super().__init__()
        self.atrous_conv = DeformableConv2d(
            in_channels, planes, kernel_size, stride=1, padding=padding, offset_groups=offset_groups
        )
        self.bn = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.atrous_conv(x)))


class ASPPDeformable(nn.Module):
    """BiRefNet's ``ASPPDeformable``: 1x1 deform + deform[1, 3, 7] + global pool, concat, 1x1 conv.

    That is four deformable convs per block with kernels 1, 1, 3, 7.  ``size`` is the static (h, w) of the
    block's input; it replaces BiRefNet's ``x1.size()[2:]`` so the exported graph has no shape arithmetic.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        planes: int,
        size: tuple[int, int],
        offset_groups: int,
        parallel_block_sizes: Sequence[int] = (1, 3, 7),
    ) -> None:
        super().__init__()
        self.size = size
        self.aspp1 = ASPPModuleDeformable(in_channels, planes, 1, padding=0, offset_groups=offset_groups)
        self.aspp_deforms = nn.ModuleList(
            ASPPModuleDeformable(in_channels, planes, k, padding=k // 2, offset_groups=offset_groups)
            for k in parallel_block_sizes
        )
        self.global_avg_pool = nn.Sequential(
            nn.AdaptiveAvgPool2d((1, 1)),
            nn.Conv2d(in_channels, planes, 1, stride=1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
        )
        self.conv1 = nn.Conv2d(planes * (2 + len(self.aspp_deforms)), out_channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(0.5)  # identity in eval mode, kept for fidelity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.aspp1(x)
        x_aspp_deforms = [aspp_deform(x) for aspp_deform in self.aspp_deforms]
        x5 = self.global_avg_pool(x)
        x5 = F.interpolate(x5, size=self.size, mode="bilinear", align_corners=True)
        x = torch.cat((x1, *x_aspp_deforms, x5), dim=1)
        return self.dropout(self.relu(self.bn1(self.conv1(x))))


class BasicDecBlk(nn.Module):
    """BiRefNet's ``BasicDecBlk`` (``dec_att='ASPPDeformable'``): conv_in -> BN/ReLU -> ASPP -> conv_out."""

    def __init__(
        self, in_channels: int, out_channels: int, inter: int, planes: int, size: tuple[int, int], groups: int
    ) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, inter, 3, 1, padding=1)
        self.bn_in = nn.BatchNorm2d(inter)
        self.relu_in = nn.ReLU(inplace=True)
        self.dec_att = ASPPDeformable(inter, inter, planes, size, groups)
        self.conv_out = nn.Conv2d(inter, out_channels, 3, 1, padding=1)
        self.bn_out = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu_in(self.bn_in(self.conv_in(x)))
        x = self.dec_att(x)
        return self.bn_out(self.conv_out(x))


class TinyBiRefNetDecoder(nn.Module):
    """A multi-scale encoder stub + BiRefNet-style coarse-to-fine decoder ending in a 1-channel sigmoid mask.

    Encoder: ``stem_strides`` patchify convs (k == stride) down to ``image_size / prod(stem_strides)``, then
    ``num_scales - 1`` stride-2 convs.  Decoder: a ``BasicDecBlk`` per scale (coarsest first), each upsampled
    with bilinear ``align_corners=True`` to the next scale and added to a 1x1 lateral, as in BiRefNet's
    ``Decoder``; the finest prediction is upsampled to the image size.

    Channel counts are tiny on purpose: the file size is dominated by the 7x7 offset/modulator convs
    (``(2G+G)*49*inter*49`` floats per block) and by the exporter's baked ``p_0 + p_k`` coordinate constants
    (``K*2*h*w`` floats per deformable conv), and the fixtures are committed to git.
    """

    def __init__(
        self,
        image_size: int,
        stem_strides: Sequence[int],
        channels: int = 8,
        inter: int = 4,
        planes: int = 4,
        offset_groups: int = 1,
        num_scales: int = 2,
    ) -> None:
        super().__init__()
        stem: list[nn.Module] = []
        in_ch, size = 3, image_size
        for s in stem_strides:
            if size % s:
                raise ValueError(f"size {size} not divisible by stem stride {s}")
            stem += [nn.Conv2d(in_ch, channels, s, stride=s), nn.ReLU(inplace=True)]
            in_ch, size = channels, size // s
        self.stem = nn.Sequential(*stem)
        self.encoder = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, 2, 1), nn.ReLU(inplace=True))
            for _ in range(num_scales - 1)
        )
        self.image_size = (image_size, image_size)
        # Static Python-int sizes, fine -> coarse (the exporter cannot handle traced sizes).
        self.sizes = [(size >> i, size >> i) for i in range(num_scales)]
        self.decoder_blocks = nn.ModuleList(
            BasicDecBlk(channels, channels, inter, planes, sz, offset_groups) for sz in self.sizes
        )
        self.lateral_blocks = nn.ModuleList(nn.Conv2d(channels, channels, 1) for _ in range(num_scales - 1))
        self.head = nn.Conv2d(channels, 1, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        feats = [self.stem(image)]
        for enc in self.encoder:
            feats.append(enc(feats[-1]))
        p = self.decoder_blocks[-1](feats[-1])
        for i in range(len(feats) - 2, -1, -1):
            p = F.interpolate(p, size=self.sizes[i], mode="bilinear", align_corners=True)
            p = self.decoder_blocks[i](p + self.lateral_blocks[i](feats[i]))
        logits = F.interpolate(self.head(p), size=self.image_size, mode="bilinear", align_corners=True)
        return torch.sigmoid(logits)


def init_weights(model: nn.Module, seed: int, offset_std: float = 1.5) -> None:
    """Deterministically (re)initialise every parameter and BN buffer from ``seed``.

    Offsets get ``std ~ offset_std`` (weight std scaled by 1/sqrt(fan_in), bias std ``offset_std``) so most
    sampling points are fractional and some fall partially or fully outside the feature map, which is where
    the exporter's Clip/zero-padding logic matters.  BN running stats are randomised so that BN is not an
    identity in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Conv2d):
                fan_in = mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]
                is_offset = name.endswith("offset_conv")
                w_std = (offset_std if is_offset else math.sqrt(2.0)) / math.sqrt(fan_in)
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * w_std)
                if mod.bias is not None:
                    b_std = offset_std if is_offset else 0.1
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * b_std)
            elif isinstance(mod, nn.BatchNorm2d):
                n = mod.num_features
                mod.weight.copy_(0.5 + torch.rand(n, generator=gen))
                mod.bias.copy_(0.1 * torch.randn(n, generator=gen))
                mod.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                mod.running_var.copy_(0.5 + torch.rand(n, generator=gen))


# ----------------------------------------------------------------------------------------------------------
# Fixture specs
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixtureSpec:
    """One committed fixture; ``name`` (file stem) is a contract with the tests."""

    name: str
    image_size: int = 64
    stem_strides: tuple[int, ...] = (4,)
    batch: int = 1
    offset_groups: int = 1
    use_gathernd: bool = True
    fp16: bool = False
    seed: int = 1234

    @property
    def filename(self) -> str:
        return f"{self.name}.onnx"


FIXTURES: tuple[FixtureSpec, ...] = (
    FixtureSpec("decoder_gathernd"),
    FixtureSpec("decoder_gatherelements", use_gathernd=False),
    FixtureSpec("decoder_gathernd_b2g2", batch=2, offset_groups=2),
    # The demo model: the stem goes 1024 -> 16 (three 4x4/stride-4 patchify convs, a few hundred weights)
    # so the deformable part costs the same as in the 64px model and ORT CPU runs it in well under a second.
    FixtureSpec("decoder_gathernd_1024", image_size=1024, stem_strides=(4, 4, 4)),
    FixtureSpec("decoder_gathernd_fp16", fp16=True),
    FixtureSpec("decoder_gatherelements_fp16", use_gathernd=False, fp16=True),
)


def build_model(spec: FixtureSpec) -> TinyBiRefNetDecoder:
    """Construct and seed the torch model for ``spec`` (eval mode: BN uses running stats, dropout off)."""
    torch.manual_seed(spec.seed)
    model = TinyBiRefNetDecoder(spec.image_size, spec.stem_strides, offset_groups=spec.offset_groups)
    init_weights(model, spec.seed)
    return model.eval()


def make_input(spec: FixtureSpec) -> torch.Tensor:
    """A fixed pseudo-random image in [0, 1), shape [B, 3, S, S]."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    return torch.rand((spec.batch, 3, spec.image_size, spec.image_size), generator=gen)


# ----------------------------------------------------------------------------------------------------------
# Export + post-processing
# ----------------------------------------------------------------------------------------------------------


def export_fp32(model: nn.Module, image: torch.Tensor, use_gathernd: bool) -> onnx.ModelProto:
    """Export with the TorchScript exporter (``dynamo=False``) and the real deform_conv2d symbolic."""
    # Re-registering replaces the previous symbolic, so both forms can be exported in one process.
    deform_conv2d_onnx_exporter.register_deform_conv2d_onnx_op(use_gathernd=use_gathernd)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings / deprecation chatter from the legacy exporter
        torch.onnx.export(
            model,
            (image,),
            buf,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
            export_params=True,
        )
    return onnx.load_from_string(buf.getvalue())


def canonicalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shorten names and strip incidental metadata; the fixtures are committed, so bytes matter.

    The exporter's scoped names (``/decoder_blocks.0/dec_att/aspp_deforms.2/atrous_conv/Transpose_output_0``)
    appear ~3 times per node and made up ~30% of each file (fp32 64px GatherND: 677 KB with them, 480 KB
    without; fp16: 568 KB vs 307 KB), so every node becomes ``<OpType>_<index>`` and every intermediate
    value ``t_<n>`` in topological order.  Graph inputs/outputs (``image``/``mask``) and parameter
    initializers (``decoder_blocks.0.dec_att.aspp1.atrous_conv.offset_conv.weight``, few and informative)
    keep their names.  Doc strings are cleared as a guard against stack-trace ``doc_string`` fields (torch
    2.14 emits none).  The renaming is a pure function of the exported graph, which the TorchScript exporter
    produces byte-deterministically here, so determinism is preserved.  ``producer_version`` (``2.14.1``)
    stays: it is pinned by the ``fixtures`` extra and documents what made the file.
    """
    return replica_canonicalize(model)  # one implementation: the torch-free replica rebuilds fixtures with it


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Convert to fp16 with onnxconverter-common, IO types included (``keep_io_types=False``).

    The plain call works for this graph, so no custom op_block_list is passed: the library's
    DEFAULT_OP_BLOCK_LIST keeps each ``Resize`` in fp32 wrapped in a Cast pair (2 Casts per Resize, the only
    nodes added), and everything else - Conv, BatchNormalization, Floor, Add/Sub/Mul, GatherND /
    GatherElements, Sum, Sigmoid - becomes fp16 and loads and runs on ORT 1.32 CPU (checked: even
    ``op_block_list=[]`` runs there).  The integer index path (Cast->int64, Slice, Add, Clip(int64)) is left
    as is; the ``p_0 + p_k`` coordinate constants become fp16, which is exact for the small integer values.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the float32 number ... will be truncated" for tiny constants
        return float16.convert_float_to_float16(model, keep_io_types=False)


def build_fixture(spec: FixtureSpec) -> tuple[onnx.ModelProto, TinyBiRefNetDecoder, torch.Tensor]:
    """Build the final ONNX model for ``spec`` together with its torch reference model and input."""
    model = build_model(spec)
    image = make_input(spec)
    proto = export_fp32(model, image, spec.use_gathernd)
    if spec.fp16:
        proto = to_fp16(proto)
    return canonicalize(proto), model, image


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------


def sampling_stats(model: TinyBiRefNetDecoder, image: torch.Tensor) -> dict[str, float]:
    """Fraction of deformable sampling points that are fractional / partly / fully outside the map.

    Confirms the random offset init exercises the bilinear and out-of-bounds paths.
    """
    tot = frac = partial = full = 0
    handles = []

    def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal tot, frac, partial, full
        (x,) = args
        assert isinstance(mod, DeformableConv2d)
        off = mod.offset_conv(x)
        b, _, h, w = off.shape
        k = mod.regular_conv.kernel_size[0]
        off = off.view(b, -1, k * k, 2, h, w)
        ky, kx = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
        oy, ox = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        py = oy.view(1, 1, 1, h, w) - mod.padding + ky.reshape(1, 1, -1, 1, 1) + off[:, :, :, 0]
        px = ox.view(1, 1, 1, h, w) - mod.padding + kx.reshape(1, 1, -1, 1, 1) + off[:, :, :, 1]
        H, W = x.shape[-2:]  # noqa: N806
        tot += py.numel()
        frac += int(((py != py.floor()) | (px != px.floor())).sum())
        outside_full = (py <= -1) | (py >= H) | (px <= -1) | (px >= W)
        outside_any = (py < 0) | (py > H - 1) | (px < 0) | (px > W - 1)
        full += int(outside_full.sum())
        partial += int((outside_any & ~outside_full).sum())

    for mod in model.modules():
        if isinstance(mod, DeformableConv2d):
            handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(image)
    finally:
        for h in handles:
            h.remove()
    return {"points": tot, "fractional": frac / tot, "partly_oob": partial / tot, "fully_oob": full / tot}


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def _const_names(model: onnx.ModelProto) -> set[str]:
    names = {i.name for i in model.graph.initializer}
    names |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return names


def check_gathernd_pattern(model: onnx.ModelProto) -> list[str]:
    """Assert the exporter's GatherND form and return one human-readable description of the path.

    Expected per GatherND (from deform_conv2d_onnx_exporter 1.2.0)::

        data    = Transpose(Reshape(Pad(x)), perm=[0,1,3,4,2])           rank 5 [b, G, H+2p, W+2p, C/G]
        indices = Concat(Reshape(Clip(  Slice(Cast<int64>(Floor(p))) [+1]  )) x2, axis=3)  [b, G, K*h*w, 2]
        GatherND(data, indices, batch_dims=2)
    """
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    shapes: dict[str, list[int | str]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    prod = _producers(model)
    consts = _const_names(model)
    report: list[str] = []

    def src(name: str) -> onnx.NodeProto:
        return prod[name]

    def dyn_input(node: onnx.NodeProto) -> str:
        """The single non-constant input of Add/Clip/Slice/Reshape nodes on the index path."""
        cand = [i for i in node.input if i and i not in consts]
        assert len(cand) == 1, (node.name, list(node.input))
        return cand[0]

    seen_shapes: set[tuple[tuple[int | str, ...], tuple[int | str, ...]]] = set()
    gathers = [n for n in model.graph.node if n.op_type == "GatherND"]
    assert gathers, "no GatherND nodes"
    for gnd in gathers:
        batch_dims = next((a.i for a in gnd.attribute if a.name == "batch_dims"), 0)
        assert batch_dims == 2, (gnd.name, batch_dims)
        data, indices = gnd.input
        assert len(shapes[data]) == 5, (gnd.name, shapes.get(data))
        assert len(shapes[indices]) == 4 and shapes[indices][-1] == 2, (gnd.name, shapes.get(indices))
        concat = src(indices)
        assert concat.op_type == "Concat", concat.op_type
        for coord in concat.input:
            chain: list[str] = []
            node = src(coord)
            chain.append(node.op_type)
            assert node.op_type == "Reshape", chain
            node = src(dyn_input(node))
            chain.append(node.op_type)
            assert node.op_type == "Clip", chain
            clip_dtype = inferred_dtype(inferred, node.output[0])
            assert clip_dtype == onnx.TensorProto.INT64, (node.name, clip_dtype)
            node = src(node.input[0])
            chain.append(node.op_type)
            if node.op_type == "Add":  # the "+1" for bottom/right corners
                node = src(dyn_input(node))
                chain.append(node.op_type)
            assert node.op_type == "Slice", chain
            node = src(node.input[0])
            chain.append(node.op_type)
            assert node.op_type == "Cast", chain
            assert next(a.i for a in node.attribute if a.name == "to") == onnx.TensorProto.INT64
            node = src(node.input[0])
            chain.append(node.op_type)
            assert node.op_type == "Floor", chain
            path = " <- ".join(["GatherND", "Concat", *chain])
            if f"path: {path}" not in report:
                report.append(f"path: {path}")
        assert inferred_dtype(inferred, indices) == onnx.TensorProto.INT64, gnd.name
        key = (tuple(shapes[data]), tuple(shapes[indices]))
        if key not in seen_shapes:
            seen_shapes.add(key)
            report.append(f"{gnd.name}: data {data} {shapes[data]}, indices {indices} {shapes[indices]}")
    report.append(f"all {len(gathers)} GatherND: batch_dims=2, rank-5 data, [b, G, K*h*w, 2] int64 indices")
    return report


def inferred_dtype(inferred: onnx.ModelProto, name: str) -> int:
    """Element type of ``name`` after shape inference (0 if unknown)."""
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    return 0


def verify(
    spec: FixtureSpec, proto: onnx.ModelProto, path: Path, model: nn.Module, image: torch.Tensor
) -> None:
    """checker + ORT CPU run + comparison with torch + structural checks; prints a one-fixture report."""
    onnx.checker.check_model(proto, full_check=True)
    counts = Counter(n.op_type for n in proto.graph.node)
    n_deform = sum(isinstance(m, DeformableConv2d) for m in model.modules())
    sums = [n for n in proto.graph.node if n.op_type == "Sum"]
    assert len(sums) == n_deform and all(len(s.input) == 4 for s in sums), (len(sums), n_deform)
    gather_op = "GatherND" if spec.use_gathernd else "GatherElements"
    assert counts[gather_op] == 4 * n_deform, (counts[gather_op], n_deform)

    with torch.no_grad():
        ref = model(image).numpy()
    feed = image.numpy().astype(np.float16 if spec.fp16 else np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    (out,) = sess.run([OUTPUT_NAME], {INPUT_NAME: feed})
    assert out.shape == ref.shape, (out.shape, ref.shape)
    diff = float(np.abs(out.astype(np.float32) - ref).max())
    atol = FP16_ATOL if spec.fp16 else FP32_ATOL
    ok = diff <= atol

    data = path.read_bytes()
    print(f"== {path.name}")
    sha = hashlib.sha256(data).hexdigest()[:16]
    print(f"   size={len(data)} B  sha256={sha}  nodes={len(proto.graph.node)}")
    ops = " ".join(f"{k}={counts[k]}" for k in ("GatherND", "GatherElements", "Sum", "Clip"))
    print(f"   {ops}  deform_convs={n_deform}")
    print(f"   input {list(feed.shape)} {feed.dtype}  out range [{out.min():.4f}, {out.max():.4f}]")
    print(f"   max|onnx - torch| = {diff:.3e}  (atol {atol:g}) {'OK' if ok else 'FAIL'}")
    if spec.use_gathernd:
        for line in check_gathernd_pattern(proto):
            print(f"   {line}")
    if not spec.fp16:
        st = sampling_stats(model, image)
        print(
            "   sampling points={points}: fractional={fractional:.1%} partly_oob={partly_oob:.1%} "
            "fully_oob={fully_oob:.1%}".format(**st)
        )
    if not ok:
        raise AssertionError(f"{path.name}: max abs diff {diff} > {atol}")


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Build (and by default verify) the requested fixtures."""
    names = [s.name for s in FIXTURES]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"subset of: {', '.join(names)}")
    ap.add_argument("--no-verify", action="store_true", help="skip checker/ORT/torch comparison")
    args = ap.parse_args(argv)

    # Determinism: the exporter and the models only run CPU kernels, but pin everything anyway.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    args.out.mkdir(parents=True, exist_ok=True)
    for spec in FIXTURES:
        if args.only and spec.name not in args.only:
            continue
        proto, model, image = build_fixture(spec)
        path = args.out / spec.filename
        onnx.save_model(proto, str(path), save_as_external_data=False)
        if args.no_verify:
            print(f"wrote {path} ({path.stat().st_size} B)")
        else:
            verify(spec, proto, path, model, image)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
