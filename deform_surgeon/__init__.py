"""deform_surgeon: rewrite ONNX deformable-convolution graphs so they run fully on WebGPU, bit-identically.

Public API (the CLI is a thin shell over it):
    patch(model, out, ...) -> PatchReport     prove, rewrite, verify, save atomically
    inspect(model, ...) -> PatchReport        the same as a dry run
    verify(original, patched, ...) -> VerifyResult
    resolve_profile(name_or_file) -> DeviceProfile   the WebGPU limits a model is fitted to and checked against
    bisect(model, runtime=..., ...) -> BisectResult   the first node a WebGPU runtime gets wrong, and its repro

The names are imported when first used: `import deform_surgeon` costs nothing, so the command (`__main__.py`)
can handle Ctrl-C before onnx and onnx-graphsurgeon are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .device import DeviceProfile, resolve_profile
from .errors import SurgeonError, VerificationError
from .verify import VerifyResult, verify  # (light; and were it lazy, the submodule would shadow the function)

if TYPE_CHECKING:
    from .bisection import BisectResult, bisect
    from .report import PatchReport
    from .surgeon import inspect, patch

_LAZY = {"patch": "surgeon", "inspect": "surgeon", "PatchReport": "report", "bisect": "bisection",
         "BisectResult": "bisection"}

__all__ = ["patch", "inspect", "verify", "PatchReport", "VerifyResult", "SurgeonError", "VerificationError",
           "DeviceProfile", "resolve_profile", "bisect", "BisectResult"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
