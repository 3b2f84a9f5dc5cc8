"""Where a `patch` spends its time and memory: each stage's wall time and the resident memory reached by its end,
for the report.

Why per stage: a user who finds a patch slow or large must see which stage it is (the lift, the proofs, the
whole-model check, the undo search) before choosing an option; one total says nothing of that. The memory is the
process's high-water mark (Linux's VmHWM) at the end of each stage: the stage where it rises is the one that needed
the memory. It is never reset (resetting it, through /proc/self/clear_refs, would also erase the peak the kernel
reports for the whole process, which `/usr/bin/time` and the cost script read). The forked children that check a
model on a second core are counted by the largest one so far (`children_peak_rss_bytes`). Where /proc cannot be
read (not Linux), the peak is the process's largest so far from getrusage.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StageClock:
    """A sequence of stages: `enter(name)` ends the running stage and begins `name`; `close()` ends the last.
    `progress(name)` is told of each stage entered (the API's `progress` callback)."""

    progress: Callable[[str], None] | None = None
    rows: list[dict] = field(default_factory=list)
    _running: tuple[str, float] | None = None

    def enter(self, name: str) -> None:
        self.close()
        self._running = (name, time.perf_counter())
        if self.progress is not None:
            self.progress(name)

    def close(self) -> None:
        if self._running is None:
            return
        name, start = self._running
        self._running = None
        self.rows.append({"stage": name, "seconds": round(time.perf_counter() - start, 3),
                          "peak_rss_bytes": _peak(), "children_peak_rss_bytes": _children_peak()})



def stage_lines(rows: list[dict]) -> list[str]:
    """One line for the terminal report: each stage's time and peak, in order ([] without stages)."""
    if not rows:
        return []
    from .sizes import human

    parts = [f"{r['stage']} {r['seconds']:.1f} s / {human(r['peak_rss_bytes'])}" for r in rows]
    child = max((r["children_peak_rss_bytes"] for r in rows), default=0)
    return ["stages (wall time / peak RSS reached by its end): " + ", ".join(parts)
            + (f"; checks in child processes: {human(child)} at most" if child else "")]


def _peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _maxrss(resource.RUSAGE_SELF)


def _children_peak() -> int:
    return _maxrss(resource.RUSAGE_CHILDREN)


def _maxrss(who: int) -> int:
    kib = resource.getrusage(who).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # (bytes on macOS, KiB elsewhere)
