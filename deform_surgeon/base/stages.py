"""Where a `patch` spends its time and memory: each stage's wall time and the resident memory reached by its end,
for the report.

Why per stage: a user who finds a patch slow or large must see which stage it is (the lift, the proofs, the
whole-model check, the undo search) before choosing an option; one total says nothing of that. The memory is the
process's high-water mark (Linux's VmHWM) at the end of each stage: the stage where it rises is the one that needed
the memory. It is never reset (resetting it, through /proc/self/clear_refs, would also erase the peak the kernel
reports for the whole process, which `/usr/bin/time` and the cost script read). The forked children that check a
model on a second core are counted by the largest one so far (`children_peak_rss_bytes`). Where /proc cannot be
read (not Linux), the peak is the process's largest so far from getrusage.

Why steps (`step`): a stage may take minutes (HR's size: the proofs, 5 minutes), and a user at a terminal must
see that it moves and what it is on. Each stage entered and each step of one (a proof, a whole-model check, a run of
the undo search) is logged on the `deform_surgeon.progress` logger at level INFO, with the stage's time so far and
the process's resident memory; the library adds no handler (nothing is printed unless asked), `patch` on a terminal
shows them on stderr.
"""

from __future__ import annotations

import contextvars
import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

LOG = logging.getLogger("deform_surgeon.progress")


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
        _CURRENT.set(self)
        LOG.info("%s", name)
        if self.progress is not None:
            self.progress(name)

    def step(self, text: str) -> None:
        if self._running is not None and LOG.isEnabledFor(logging.INFO):
            name, start = self._running
            LOG.info("%s %.0f s, %s resident: %s", name, time.perf_counter() - start, _human(_resident()), text)

    def close(self) -> None:
        if self._running is None:
            return
        name, start = self._running
        self._running = None
        self.rows.append({"stage": name, "seconds": round(time.perf_counter() - start, 3),
                          "peak_rss_bytes": _peak(), "children_peak_rss_bytes": _children_peak()})


_CURRENT: contextvars.ContextVar[StageClock | None] = contextvars.ContextVar("stage_clock", default=None)


def step(text: str) -> None:
    """Log a step of the running stage of this context's patch (see the module docstring); nothing without one."""
    clock = _CURRENT.get()
    if clock is not None:
        clock.step(text)


def stage_lines(rows: list[dict]) -> list[str]:
    """One line for the terminal report: each stage's time and peak, in order ([] without stages)."""
    if not rows:
        return []
    parts = [f"{r['stage']} {r['seconds']:.1f} s / {_human(r['peak_rss_bytes'])}" for r in rows]
    child = max((r["children_peak_rss_bytes"] for r in rows), default=0)
    return ["stages (wall time / peak RSS reached by its end): " + ", ".join(parts)
            + (f"; checks in child processes: {_human(child)} at most" if child else "")]


def _human(n: int) -> str:
    from .sizes import human

    return human(n)


def _resident() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak()


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
