"""deform_surgeon: rewrite ONNX deformable-convolution graphs so they run fully on WebGPU, bit-identically.

Public API (the CLI is a thin shell over it):
    patch(model, out, ...) -> PatchReport     prove, rewrite, verify, save atomically
    inspect(model, ...) -> PatchReport        the same as a dry run
    verify(original, patched, ...) -> VerifyResult
    resolve_profile(name_or_file) -> DeviceProfile   the WebGPU limits a model is fitted to and checked against
"""

from .device import DeviceProfile, resolve_profile
from .errors import SurgeonError, VerificationError
from .report import PatchReport
from .surgeon import inspect, patch
from .verify import VerifyResult, verify

__all__ = ["patch", "inspect", "verify", "PatchReport", "VerifyResult", "SurgeonError", "VerificationError",
           "DeviceProfile", "resolve_profile"]
__version__ = "0.1.0"
