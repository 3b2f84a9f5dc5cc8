"""deform_surgeon: rewrite ONNX deformable-convolution graphs so they run fully on WebGPU, bit-identically.

Public API (the CLI is a thin shell over it):
    patch(model, out, ...) -> PatchReport     prove, rewrite, verify, save atomically
    inspect(model, ...) -> PatchReport        the same as a dry run
    verify(original, patched, ...) -> VerifyResult
    resolve_profile(name_or_file) -> DeviceProfile   the WebGPU limits a model is fitted to and checked against
    bisect(model, runtime=..., ...) -> BisectResult   the first node a WebGPU runtime gets wrong, and its repro

Every name is imported when first used: `import deform_surgeon` imports nothing of its own, so that the command
(`__main__.py`, which Python runs after this file) installs its Ctrl-C and SIGTERM handlers before anything else
is imported (importing `device` here would bring in `runtimes` and `ctypes`: 0.18 s in which a Ctrl-C would be
a KeyboardInterrupt traceback).
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # (typing is not imported: it was most of the time before the command's signal handlers)
if TYPE_CHECKING:
    from typing import Any

    from .base.errors import SurgeonError, VerificationError
    from .checks.verify import VerifyResult, verify
    from .commands.patch import inspect, patch
    from .commands.report import PatchReport
    from .graph.device import DeviceProfile, resolve_profile
    from .webgpu.bisect import BisectResult, bisect

_LAZY = {"patch": "commands.patch", "inspect": "commands.patch", "PatchReport": "commands.report",
         "verify": "checks.verify", "VerifyResult": "checks.verify", "SurgeonError": "base.errors",
         "VerificationError": "base.errors", "DeviceProfile": "graph.device", "resolve_profile": "graph.device",
         "bisect": "webgpu.bisect", "BisectResult": "webgpu.bisect"}

__all__ = ["patch", "inspect", "verify", "PatchReport", "VerifyResult", "SurgeonError", "VerificationError",
           "DeviceProfile", "resolve_profile", "bisect", "BisectResult"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

