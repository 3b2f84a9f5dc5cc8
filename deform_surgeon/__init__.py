"""deform_surgeon: rewrite ONNX deformable-convolution graphs so they run fully on WebGPU, bit-identically.

Public API (the CLI is a thin shell over it):
    patch(model, out, ...) -> PatchReport     prove, rewrite, verify, save atomically
    inspect(model, ...) -> PatchReport        the same as a dry run
    verify(original, patched, ...) -> VerifyResult
    resolve_profile(name_or_file) -> DeviceProfile   the WebGPU limits a model is fitted to and checked against
    bisect(model, runtime=..., ...) -> BisectResult   the first node a WebGPU runtime gets wrong, and its repro

Every name is imported when first used: `import deform_surgeon` imports nothing of its own, so that the command
(`__main__.py`, which Python runs after this file) installs its Ctrl-C and SIGTERM handlers before anything else
is imported (this file used to import `device`, and through it `runtimes` and `ctypes`: 0.18 s in which a
Ctrl-C was a KeyboardInterrupt traceback).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

TYPE_CHECKING = False  # (typing is not imported: it was most of the time before the command's signal handlers)
if TYPE_CHECKING:
    from typing import Any

    from .bisection import BisectResult, bisect
    from .device import DeviceProfile, resolve_profile
    from .errors import SurgeonError, VerificationError
    from .report import PatchReport
    from .surgeon import inspect, patch
    from .verify import VerifyResult, verify

_LAZY = {"patch": "surgeon", "inspect": "surgeon", "PatchReport": "report", "verify": "verify",
         "VerifyResult": "verify", "SurgeonError": "errors", "VerificationError": "errors", "DeviceProfile": "device",
         "resolve_profile": "device", "bisect": "bisection", "BisectResult": "bisection"}

__all__ = ["patch", "inspect", "verify", "PatchReport", "VerifyResult", "SurgeonError", "VerificationError",
           "DeviceProfile", "resolve_profile", "bisect", "BisectResult"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(ModuleType):
    """This package, whose `verify` stays the API's function: importing a submodule sets it as its package's
    attribute, and the submodule `verify` would otherwise replace the function of that name once imported (before,
    an import of the function here came after the submodule's and won)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and _LAZY.get(name) == name:
            return  # the submodule is in sys.modules; the name is the function's
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
