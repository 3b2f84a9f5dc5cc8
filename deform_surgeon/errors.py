"""One error type for everything a user can get wrong.

Every failure a user can cause (a missing file, a model that is not ONNX, an output folder that does not exist,
a patched model that fails verification) ends as one line on stderr, `FILE: problem`, and exit code 2, with the
input untouched and no output written. Raising `SurgeonError` anywhere below the CLI gives exactly that.
"""

from __future__ import annotations

from pathlib import Path


class SurgeonError(Exception):
    """A failure caused by the input, reported as one line naming the file and the problem."""

    exit_code = 2

    def __init__(self, path: str | Path | None, problem: str, hint: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.problem = problem
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = self.problem if self.path is None else f"{self.path}: {self.problem}"
        if self.hint:
            text += f" ({self.hint})"
        return " ".join(text.split())


class VerificationError(SurgeonError):
    """The patched model's outputs differ from the original's; nothing was written."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every `finally` (temporary files, worker processes,
    browsers) runs on the way out; the CLI then exits 143."""

    exit_code = 143
