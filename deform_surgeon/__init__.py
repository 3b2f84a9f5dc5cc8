"""deform_surgeon: rewrite ONNX deformable-convolution graphs so they run fully on WebGPU, bit-identically.

Public API (the CLI is a thin shell over it):
    patch(model, out, ...) -> PatchReport     prove, rewrite, verify, save atomically
    inspect(model, ...) -> PatchReport        the same as a dry run
    verify(original, patched, ...) -> VerifyResult
"""

from .errors import SurgeonError, VerificationError
from .report import PatchReport
from .surgeon import inspect, patch
from .verify import VerifyResult, verify

__all__ = ["patch", "inspect", "verify", "PatchReport", "VerifyResult", "SurgeonError", "VerificationError"]
__version__ = "0.1.0"
