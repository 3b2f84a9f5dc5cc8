"""The search over prefixes of the unmodified graph (the package's docstring says why prefixes): it keeps a prefix
that agrees and one that goes wrong and halves the distance between them, each verdict from a run (`run(k)`) that
the caller gives; it writes no file and knows no runtime, so it is tested with any `run`. The command and the API
(`api.bisect_with`) build the prefixes and run them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...checks.verdict import DIFFERS
from ...graph.subgraphs import Graph, reads
from .replay import Replay
from .result import DIFFER, FAIL, Finding, Progress, RunOutcome


def _tensor_report(o: RunOutcome, name: str) -> dict[str, Any]:
    v = o.verdicts.get(name)
    if v is None:
        return {"kind": "missing", "text": "not among the run's outputs", "max_diff_at": None}
    return {"kind": v.kind, "text": v.text, "max_abs_diff": v.max_abs_diff, "tolerance": v.tolerance,
            "max_diff_at": o.entries.get(name, {}).get("max_diff_at") if v.kind == DIFFERS else None}


def search(g: Graph, run: Callable[[int], RunOutcome], progress: Progress = None,
           marked: Callable[[], RunOutcome] | None = None, replay: Replay | None = None
           ) -> tuple[RunOutcome, Finding | None, int, list[dict[str, Any]], list[str]]:
    """Bisects over prefix ends; `run(k)` runs the prefix ending at node k (k = last: the whole, unmodified
    model). `marked` runs the model with every tensor an output: the first node it shows differing is a
    candidate, checked on the prefixes ending just before it and with it, and the search goes on from what they
    showed (two runs when they confirm it). `replay` gives the verdicts of an earlier, interrupted search of the
    same model on the same runtime and records each new one: a prefix it knows is not run again, except the two
    the finding is read from (their tensors' verdicts are not recorded). Returns the whole model's outcome, the
    finding (None when the whole model agrees), the runs, the steps and notes."""
    s = _Search(g, run, progress, replay)
    whole = s.step(s.last, again=True)  # (always run: a recorded "agrees" would end the search unrun)
    if not whole.bad:
        return whole, None, len(s.steps), s.steps, s.final_notes()
    bracket = _Bracket(-1, None, s.last, whole)
    if marked is not None:
        s.try_marked(marked, bracket)
    while True:
        s.halve(bracket)
        s.measure_ends(bracket)
        if bracket.found:
            break
        # a verdict of the file was contradicted by this run's: the search goes on from what was measured now
        bracket = s.measured_bracket(whole)
    return (whole, _finding(g, bracket.hi, bracket.hi_out, bracket.lo_out), len(s.steps), s.steps,
            s.final_notes())


@dataclass
class _Bracket:
    """The two prefixes the search holds between them: `lo` agrees (-1: the empty prefix, where nothing is computed
    and nothing can differ), `hi` goes wrong (at first the whole model). The node sought is after `lo`, up to
    `hi`."""

    lo: int
    lo_out: RunOutcome | None
    hi: int
    hi_out: RunOutcome

    def take(self, k: int, o: RunOutcome) -> None:
        """Narrow by prefix k's verdict where it lies inside: a prefix that goes wrong and is shorter than `hi` is
        the new `hi`; one that agrees, between `lo` and `hi`, the new `lo` (outside, it tells nothing new)."""
        if o.bad and k < self.hi:
            self.hi, self.hi_out = k, o
        elif not o.bad and self.lo < k < self.hi:
            self.lo, self.lo_out = k, o

    @property
    def found(self) -> bool:
        """Both ends measured as they are held: `hi` goes wrong and `lo` agrees (or is the empty prefix). Only a
        replayed verdict, contradicted when its prefix is run again, can leave it otherwise."""
        return self.hi_out.bad and (self.lo_out is None or not self.lo_out.bad)


@dataclass
class _Search:
    """One search's runs: each prefix's outcome (run, or taken from the replay file), the steps and notes the
    result reports, and the verdicts of the file that a run of this search contradicted (after one, the file is
    no longer trusted)."""

    g: Graph
    run: Callable[[int], RunOutcome]
    progress: Progress
    replay: Replay | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    done: dict[int, RunOutcome] = field(default_factory=dict)
    contradicted: list[str] = field(default_factory=list)
    last: int = field(init=False)  # the whole model's last node: its prefix is the whole model
    recorded: dict[int, str] = field(init=False)  # what the replay file said, before this search

    def __post_init__(self) -> None:
        self.last = len(self.g.nodes) - 1
        self.recorded = dict(self.replay.known) if self.replay is not None else {}

    def step(self, k: int, again: bool = False) -> RunOutcome:
        """Prefix k's outcome: the one known, else the replay file's verdict (while no run contradicted the file),
        else a run, recorded. `again`: run it even where only a replayed verdict is known (its tensors' verdicts
        are needed)."""
        g, replay, progress = self.g, self.replay, self.progress
        if k in self.done and not (again and self.done[k].replayed):
            return self.done[k]
        if not again and not self.contradicted and replay is not None and k in replay.known:
            o = self.done[k] = RunOutcome(replay.known[k], replayed=True)
            if progress:
                progress(f"prefix 1..{k + 1} (ends at {g.describe(k)}): {o.status}, from {replay.path}")
            return o
        o = self.done[k] = self.run(k)
        if k in self.recorded and RunOutcome(self.recorded[k]).bad != o.bad:
            self.contradicted.append(f"{'the whole model' if k == self.last else g.describe(k)}: "
                                     f"{self.recorded[k]} in the file, {o.status} now")
        self.steps.append({"prefix_end": k, "node": g.nodes[k].name, "status": o.status})
        if replay is not None:
            replay.record(k, g.nodes[k].name, o.status)
        if progress:
            progress(f"run {len(self.steps)}: {'whole model' if k == self.last else f'prefix 1..{k + 1}'} "
                     f"(ends at {g.describe(k)}): {o.status}")
        return o

    def try_marked(self, marked: Callable[[], RunOutcome], bracket: _Bracket) -> None:
        """The marked-outputs run's first differing node as a candidate, checked on the prefixes ending just before
        it and with it; what they show narrows `bracket` (to the candidate itself when they confirm it). Marking
        every tensor changes what the runtime computes: the prefixes decide, and a disagreement is noted."""
        g, progress = self.g, self.progress
        m = marked()
        bad = sorted(g.producer[t] for t in m.differing() if t in g.producer)
        candidate = bad[0] if bad else None
        self.steps.append({"marked": True, "status": m.status, "candidate": None if candidate is None else
                           g.nodes[candidate].name})
        if progress:
            progress(f"run {len(self.steps)}: every tensor marked as an output: {m.status}"
                     + (f", first differing at {g.describe(candidate)}" if candidate is not None else ""))
        if candidate is None:
            self.notes.append(f"the marked-outputs run {m.status} and names no differing tensor: prefixes only")
            return
        for k in (candidate - 1, candidate):
            if k >= 0:
                bracket.take(k, self.step(k))
        if bracket.hi != candidate or bracket.lo != candidate - 1:
            self.notes.append(f"the marked-outputs run named {g.describe(candidate)} first; the unmodified "
                              "prefixes do not confirm it (marking every tensor an output changes what the runtime "
                              "computes), so the prefixes decided")

    def halve(self, bracket: _Bracket) -> None:
        """Bisect until `lo` and `hi` are adjacent prefixes: about log2(their distance) steps."""
        while bracket.hi - bracket.lo > 1:
            mid = (bracket.lo + bracket.hi) // 2
            bracket.take(mid, self.step(mid))

    def measure_ends(self, bracket: _Bracket) -> None:
        """Run again the ends only replayed: the finding reads their tensors' verdicts, which the file does not
        keep."""
        if bracket.hi_out.replayed:
            bracket.hi_out = self.step(bracket.hi, again=True)
        if bracket.lo_out is not None and bracket.lo_out.replayed:
            bracket.lo_out = self.step(bracket.lo, again=True)

    def measured_bracket(self, whole: RunOutcome) -> _Bracket:
        """The bracket from this search's own runs alone, the replayed verdicts dropped: the shortest prefix that
        went wrong, and the longest shorter one that agreed."""
        for k in [k for k, o in self.done.items() if o.replayed]:
            del self.done[k]
        bracket = _Bracket(-1, None, self.last, whole)
        for k, o in sorted(self.done.items()):
            if o.bad:
                bracket.take(k, o)
        for k, o in sorted(self.done.items()):
            if not o.bad:
                bracket.take(k, o)
        return bracket

    def final_notes(self) -> list[str]:
        return _replay_notes(self.notes, self.replay, self.contradicted)


def _replay_notes(notes: list[str], replay: Replay | None, contradicted: list[str]) -> list[str]:
    if replay is not None and replay.loaded:
        notes.append(f"{replay.loaded} verdict(s) from {replay.path}, an earlier search of this model on this "
                     "runtime" + (f"; this run contradicted them ({'; '.join(contradicted)}), so the search went on "
                                  "from what was measured now" if contradicted else ""))
    return notes


def _finding(g: Graph, k: int, at: RunOutcome, before: RunOutcome | None) -> Finding:
    node = g.nodes[k]
    outputs = {y: _tensor_report(at, y) for y in node.output if y and y in at.verdicts}
    elsewhere = {}
    for name in at.differing():
        if name not in node.output:
            elsewhere[name] = {**_tensor_report(at, name), "producer": g.describe(g.producer[name])}
    inputs: dict[str, str] = {}
    for x in reads(node):
        if x in g.constants:
            inputs[x] = "constant"
        elif x in g.graph_inputs:
            inputs[x] = "graph input (the same values on both)"
        elif before is not None and x in before.verdicts:
            inputs[x] = before.verdicts[x].text
        else:
            inputs[x] = "not exposed"
    return Finding(k, node.name, node.op_type, at.status if at.status == FAIL else DIFFER, outputs, inputs,
                   list(at.errors), elsewhere)
