"""`deform-surgeon setup`: the pinned WebGPU runtimes installed (`npm`) and the command (`command`)."""

from .command import SetupTool, run_setup
from .npm import DOWNLOAD_BYTES, INSTALLED_BYTES, download_note, install, versions

__all__ = ["DOWNLOAD_BYTES", "INSTALLED_BYTES", "SetupTool", "download_note", "install", "run_setup", "versions"]
