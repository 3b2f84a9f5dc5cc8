"""A batch's progress on stderr, from the stages its workers report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .entry import FAILED, Entry, entry_problem

STAGE_FRACTION = {"queued": 0.0, "start": 0.02, "prove": 0.05, "export": 0.55, "write": 0.7, "verify": 0.8}


class Progress:
    """Progress on stderr: on a terminal, a bar per running model and one overall, redrawn in place; otherwise
    one line per stage change (logs stay readable)."""

    WIDTH = 24

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.drawn = 0
        self.entries: list[Entry] = []
        self.t0 = time.perf_counter()
        self.last: dict[int, str] = {}

    def start(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.t0 = time.perf_counter()
        for e in entries:
            if e.status == FAILED:
                self._line(f"[{e.number}/{len(entries)}] {e.input}: failed: {entry_problem(e)}")

    def tick(self) -> None:
        if self.tty:
            self._redraw()

    def stage(self, e: Entry) -> None:
        """Off a terminal: one line per stage a worker reports, as it is reported (sampling would skip stages)."""
        if not self.tty and self.last.get(e.number) != e.stage:
            self.last[e.number] = e.stage
            self._line(f"[{e.number}/{len(self.entries)}] {e.input}: {e.stage}")

    def finished(self, e: Entry) -> None:
        self.last[e.number] = "done"
        self._line(f"[{e.number}/{len(self.entries)}] {e.input}: {e.status} ({e.seconds:.1f} s)"
                   + (f": {entry_problem(e)}" if e.error else ""))

    def close(self) -> None:
        if self.tty:
            self._clear()
            self.stream.flush()

    def _bar(self, fraction: float) -> str:
        n = int(round(fraction * self.WIDTH))
        return "[" + "#" * n + "-" * (self.WIDTH - n) + "]"

    def _line(self, text: str) -> None:
        if self.tty:
            self._clear()
        self.stream.write(text + "\n")
        if self.tty:
            self._redraw()
        self.stream.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
            self.drawn = 0

    def _redraw(self) -> None:
        self._clear()
        total = len(self.entries) or 1
        done = sum(e.stage == "done" or e.status == FAILED for e in self.entries)
        share = sum(STAGE_FRACTION.get(e.stage, 0.0) for e in self.entries if e.status == "running")
        lines = [f"  {self._bar(STAGE_FRACTION.get(e.stage, 0.0))} {e.stage:<7} {Path(e.input).name}"
                 for e in self.entries if e.status == "running"]
        elapsed = time.perf_counter() - self.t0
        lines.append(f"{self._bar((done + share) / total)} {done}/{total} models  {elapsed:.0f} s")
        self.stream.write("\n".join(lines) + "\n")
        self.drawn = len(lines)
        self.stream.flush()
