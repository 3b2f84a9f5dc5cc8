"""`deform-surgeon serve`: a local page that runs the original and the patched model side by side on the user's own
GPU (onnxruntime-web in the user's browser), with the ORT CPU reference computed by the server."""

from .command import ServeTool

__all__ = ["ServeTool"]
