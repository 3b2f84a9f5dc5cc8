"""Device profiles: the WebGPU limits a patched model must fit, shared by `patch`, `budget` and `placement`.

Why: ONNX Runtime decides where nodes run at session creation, but whether each kernel fits the device is found
out only when it runs: a kernel that binds more storage buffers than `maxStorageBuffersPerShaderStage`, or a
tensor larger than `maxBufferSize`, fails the run ("Too many storage buffers in shader"). A page gets the WebGPU
spec's default limits unless it asks for more, and onnxruntime-web's JSEP asks for no more storage buffers, so
`spec-default` is the profile a model must fit to run for every user. A software adapter (SwiftShader) offers far
more (12 storage buffers, 1 GiB buffers), so a test on it alone does not show what a user's GPU does; see
docs/runtime-facts.md.

A profile is data: a name, the limits, and where they came from. `resolve_profile` takes a name (`spec-default`,
`adapter`: the limits of the adapter at hand, probed through the installed WebGPU runtime) or the path of a JSON
file written by `deform-surgeon placement --device-limits-out` on a real machine (or any object with a `limits`
member or plain WebGPU limit names). Limits a file does not name are the spec's defaults: a device always has them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..base import js_runtimes as runtimes
from ..base.errors import SurgeonError

# The WebGPU spec's default limits (https://www.w3.org/TR/webgpu/#limits): what `requestDevice()` gives a page
# that asks for nothing more. Every conformant adapter supports at least these.
SPEC_DEFAULT_LIMITS: dict[str, int] = {
    "maxBindGroups": 4,
    "maxBindingsPerBindGroup": 1000,
    "maxDynamicUniformBuffersPerPipelineLayout": 8,
    "maxDynamicStorageBuffersPerPipelineLayout": 4,
    "maxStorageBuffersPerShaderStage": 8,
    "maxUniformBuffersPerShaderStage": 12,
    "maxUniformBufferBindingSize": 65536,
    "maxStorageBufferBindingSize": 134217728,  # 128 MiB
    "minUniformBufferOffsetAlignment": 256,
    "minStorageBufferOffsetAlignment": 256,
    "maxBufferSize": 268435456,  # 256 MiB
    "maxComputeWorkgroupStorageSize": 16384,
    "maxComputeInvocationsPerWorkgroup": 256,
    "maxComputeWorkgroupSizeX": 256,
    "maxComputeWorkgroupSizeY": 256,
    "maxComputeWorkgroupSizeZ": 64,
    "maxComputeWorkgroupsPerDimension": 65535,
}
SPEC_DEFAULT = "spec-default"
ADAPTER = "adapter"
# spec-default's limits, for a file that must also run on onnxruntime-web's wasm (CPU) backend, whose heap cannot
# grow past 4 GiB: what ORT would store of its folding, large, is computed at run time (passes/unfold.py)
WASM = "wasm"
PROFILE_NAMES = (SPEC_DEFAULT, ADAPTER, WASM)


@dataclass(frozen=True)
class DeviceProfile:
    """A named set of WebGPU limits (every key of SPEC_DEFAULT_LIMITS is present)."""

    name: str
    limits: dict[str, int]
    source: str
    adapter: dict | None = field(default=None, compare=False)  # the adapter description, when probed or captured

    @property
    def storage_buffers(self) -> int:
        return self.limits["maxStorageBuffersPerShaderStage"]

    @property
    def max_buffer(self) -> int:
        return self.limits["maxBufferSize"]

    @property
    def max_binding(self) -> int:
        return self.limits["maxStorageBufferBindingSize"]

    def describe(self) -> str:
        return (f"device profile '{self.name}' ({self.source}): maxStorageBuffersPerShaderStage "
                f"{self.storage_buffers}, maxBufferSize {self.max_buffer}, maxStorageBufferBindingSize "
                f"{self.max_binding}")

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "limits": dict(self.limits)}


def spec_default() -> DeviceProfile:
    return DeviceProfile(SPEC_DEFAULT, dict(SPEC_DEFAULT_LIMITS), "the WebGPU spec's default limits")


def resolve_profile(spec: str | Path | DeviceProfile | None) -> DeviceProfile:
    """The profile named by `spec`: None or `spec-default`, `adapter`, `wasm`, or a JSON file of limits."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None:
        return spec_default()
    if not isinstance(spec, str | os.PathLike):
        raise SurgeonError(None, f"device_profile must be {' or '.join(PROFILE_NAMES)}, a JSON file's path or a "
                                 f"DeviceProfile (got {type(spec).__name__})",
                           "for a dict of limits use deform_surgeon.graph.device.profile_from_adapter")
    if str(spec) == SPEC_DEFAULT:
        return spec_default()
    if str(spec) == WASM:
        return DeviceProfile(WASM, dict(SPEC_DEFAULT_LIMITS), "the WebGPU spec's default limits, and the wasm "
                             "backend's heap of at most 4 GiB")
    if str(spec) == ADAPTER:
        return probe_adapter()
    from ..files import user_path

    path = user_path(spec, "the device profile")
    try:
        os.stat(path)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError | NotADirectoryError):
            raise SurgeonError(path, f"cannot read device profile ({exc.strerror})") from None
        raise SurgeonError(path, "no such device profile",
                           f"give {' or '.join(PROFILE_NAMES)}, or a JSON file written by "
                           "`deform-surgeon placement MODEL --device-limits-out FILE.json`") from None
    return profile_from_file(path)


def profile_from_file(path: str | Path) -> DeviceProfile:
    """A profile from a `placement --device-limits-out` file, an adapter object or a plain limits object."""
    from ..files.io_check import require_regular_input

    p = Path(path)
    require_regular_input(p, "give a JSON file")  # a FIFO would block forever
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise SurgeonError(p, f"cannot read device profile ({getattr(exc, 'strerror', None) or exc})") from None
    except ValueError as exc:
        raise SurgeonError(p, f"device profile is not JSON ({exc})") from None
    adapter = doc.get("adapter") if isinstance(doc, dict) and isinstance(doc.get("adapter"), dict) else None
    limits = _limits_of(doc)
    if not limits:
        raise SurgeonError(p, "no WebGPU limits (maxBufferSize, maxStorageBuffersPerShaderStage, ...) in the file",
                           "write it with `deform-surgeon placement MODEL --device-limits-out FILE.json`")
    return DeviceProfile(p.stem, {**SPEC_DEFAULT_LIMITS, **limits}, f"limits from {p}", adapter)


def profile_from_adapter(adapter: dict, name: str = ADAPTER, source: str | None = None) -> DeviceProfile:
    """A profile from an adapter description as the placement harnesses report it (`describeAdapter`)."""
    limits = _limits_of(adapter)
    return DeviceProfile(name, {**SPEC_DEFAULT_LIMITS, **limits}, source or str(adapter.get("source") or name),
                         adapter)


def probe_adapter() -> DeviceProfile:
    """The limits of the WebGPU adapter this machine's node runtime gets (needs the placement runtimes)."""
    adapter, error = runtimes.probe_adapter()
    if adapter is None:
        raise SurgeonError(None, f"cannot probe the WebGPU adapter: {error}",
                           "install the runtimes (`deform-surgeon setup` / `make webgpu-setup`) or give "
                           "--device-profile spec-default or a limits file")
    return profile_from_adapter(adapter, ADAPTER, f"the adapter at hand: {adapter.get('description') or '?'}")


def _limits_of(doc: object) -> dict[str, int]:
    """WebGPU limit values found in `doc` (itself, its `limits`, or its `adapter.limits`)."""
    out: dict[str, int] = {}
    if not isinstance(doc, dict):
        return out
    for c in (doc, doc.get("limits"), (doc.get("adapter") or {}).get("limits")
              if isinstance(doc.get("adapter"), dict) else None):
        if not isinstance(c, dict):
            continue
        for key, v in c.items():
            if key in SPEC_DEFAULT_LIMITS and key not in out and isinstance(v, int | float) \
                    and not isinstance(v, bool) and v > 0:
                out[key] = int(v)
    return out


# Inputs the WebGPU EPs read on the CPU (shapes, axes, sizes): they are not bound as storage buffers.
CPU_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Split": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Resize": frozenset({1, 2, 3}), "Pad": frozenset({1, 2, 3}),
    "Unsqueeze": frozenset({1}), "Squeeze": frozenset({1}), "ConstantOfShape": frozenset({0}),
    "Range": frozenset({0, 1, 2}), "TopK": frozenset({1}), "CumSum": frozenset({1}), "OneHot": frozenset({1}),
    "Clip": frozenset({1, 2}),
    **{op: frozenset({1}) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                     "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
}
# Ops whose number of inputs or outputs is not fixed: the ones a model can make exceed any limit.
VARIADIC = {"Concat", "Split", "Max", "Min", "Mean", "Sum"}


def storage_buffers(op: str, inputs: list[str], outputs: list[str]) -> int:
    """Storage buffers a WebGPU kernel for this node binds in one shader: one per tensor it reads on the GPU and
    one per output.

    Why this count: the native WebGPU EP adds one shader variable per input and output and refuses a shader with
    more than `maxStorageBuffersPerShaderStage` of them; JSEP binds the same. ORT's Concat and Split kernels do
    batch wide nodes, but count one buffer too many per batch (a Split into 32 outputs fails with "Current: 13,
    Max is 12" on a 12-buffer adapter), so a node fits every EP only when this count is within the limit.
    Uniform buffers are a separate limit and are not counted."""
    cpu = CPU_INPUTS.get(op, frozenset())
    return sum(1 for k, i in enumerate(inputs) if i and k not in cpu) + sum(1 for o in outputs if o)
