"""What bisect measures and reports: one run's outcome against ORT CPU (`RunOutcome`, from a placement measurement:
`outcome_of`), the node found (`Finding`), the repro (`Repro`) and the whole result (`BisectResult`), with the text a
person reads."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...base.errors import SurgeonError
from ...checks.verdict import AGREES, BYTE_IDENTICAL, Verdict, judge_outputs, split_errors, summarize_errors

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np

AGREE, DIFFER, FAIL = "agrees", "differs", "fails"
ERROR_WIDTH = 1000  # the node's error is shown once, its whole first line: ORT puts the cause at its end
Progress = Callable[[str], None] | None


@dataclass
class RunOutcome:
    """One run of one model on the runtime, against ORT CPU on the same model and inputs.

    `status` is `agrees`, `differs` (an exposed tensor beyond the tolerance, or an uncaught WebGPU error during a run
    that returned) or `fails` (no outputs: the session or the run failed, or timed out)."""

    status: str
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # per exposed tensor
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # runner.compare_outputs's, per tensor
    errors: list[str] = field(default_factory=list)  # the runtime's errors, each as the runtime gave it
    replayed: bool = False  # from `Replay`: the status of an earlier run, without its tensors' verdicts

    @property
    def bad(self) -> bool:
        return self.status != AGREE

    def differing(self) -> list[str]:
        return [name for name, v in self.verdicts.items() if not v.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "errors": summarize_errors(self.errors),
                "tensors": {n: {**v.to_dict(), "max_diff_at": self.entries.get(n, {}).get("max_diff_at")}
                            for n, v in self.verdicts.items()}}


RunFn = Callable[[Path, "dict[str, np.ndarray]"], RunOutcome]


def outcome_of(placement: Any) -> RunOutcome:
    """A `placement.runner` measurement as a RunOutcome. ORT CPU failing on a prefix of a model it runs whole is not
    the runtime's doing: it is raised."""
    run = placement.run or {}
    if run.get("reference_error"):
        raise SurgeonError(placement.model, f"ORT CPU fails on this model ({run['reference_error']})")
    outputs = run.get("outputs") or {}
    if not placement.session_ok or not outputs:
        # a session that failed: its own error (the run's only says it was not run)
        text = ((placement.error if not placement.session_ok else None) or run.get("error") or placement.error
                or "the runtime reported no outputs")
        return RunOutcome(FAIL, errors=split_errors(text))
    verdicts = judge_outputs(outputs, same_runtime=False)
    gpu_errors = list(run.get("gpu_errors") or [])
    status = DIFFER if gpu_errors or not all(v.passed for v in verdicts.values()) else AGREE
    return RunOutcome(status, verdicts, dict(outputs), [e for g in gpu_errors for e in split_errors(g)])


@dataclass
class Finding:
    """The node where the runtime first goes wrong, and what each side of it showed."""

    index: int  # in topological order
    node: str
    op: str
    status: str  # differs | fails
    outputs: dict[str, dict[str, Any]]  # node k's own outputs: verdict and where (from prefix k's run)
    inputs: dict[str, str]  # node k's inputs: how each agreed (from prefix k-1's run), or that it is a constant
    errors: list[str]  # the runtime's errors in prefix k's run
    elsewhere: dict[str, dict[str, Any]] = field(default_factory=dict)  # other cut tensors that differed at k

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"errors": summarize_errors(self.errors)}


@dataclass
class Repro:
    """The minimal model holding the found node, its inputs, and whether it still goes wrong on its own."""

    directory: str
    model: str
    inputs: str
    window: tuple[int, int]  # first and last node index of the window
    reproduces: bool
    status: str
    detail: str
    runs: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BisectResult:
    model: str
    where: str  # node | browser/jsep | ...
    nodes: int
    whole: RunOutcome | None = None
    finding: Finding | None = None
    repro: Repro | None = None
    search_runs: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)  # one per search run: prefix end, status
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> int:
        return self.search_runs + (self.repro.runs if self.repro else 0)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "runtime": self.where, "nodes": self.nodes,
                "whole": self.whole.to_dict() if self.whole else None,
                "finding": self.finding.to_dict() if self.finding else None,
                "repro": self.repro.to_dict() if self.repro else None,
                "search_runs": self.search_runs, "runs": self.runs, "steps": self.steps, "notes": self.notes}

    def format(self) -> str:
        """What a person reads: the verdict on the whole model, the node, its output and inputs, the runtime's
        error once, the runs it took, the repro."""
        lines = [f"bisect: {self.model} on {self.where} ({self.nodes} nodes)"]
        w = self.whole
        if w is None:
            return "\n".join(lines)
        lines.append(f"whole model: {_status_text(w)}")
        if self.finding is None:
            lines.append("nothing differs: every output agrees with ORT CPU; no node to name")
            lines.append(f"runs: {self.search_runs}")
            lines += [f"note: {n}" for n in self.notes]
            return "\n".join(lines)
        f = self.finding
        verb = "fails" if f.status == FAIL else "differs"
        lines.append(f"first node that {verb}: {f.node} ({f.op}), node {f.index + 1} of {self.nodes} in "
                     "topological order")
        for name, o in f.outputs.items():
            at = f" at {o['max_diff_at']}" if o.get("max_diff_at") is not None else ""
            lines.append(f"  output {name}: {o['text']}{at}")
        for name, o in f.elsewhere.items():
            at = f" at {o['max_diff_at']}" if o.get("max_diff_at") is not None else ""
            lines.append(f"  also {name} (made by {o['producer']}, agreed without this node): {o['text']}{at}")
        if f.inputs:
            lines.append("  inputs" + (" (prefix ending before it: agrees)" if f.index else "") + ":")
            lines += [f"    {name}: {how}" for name, how in f.inputs.items()]
        if f.errors:
            lines.append("  runtime error: " + error_text(f.errors))
        marked = sum(1 for s in self.steps if s.get("marked"))
        whole = 0 if w.replayed else 1
        prefixes = self.search_runs - whole - marked
        lines.append(f"runs: {self.search_runs} on {self.where} ({whole} whole model + "
                     + ("1 with every tensor marked + " if marked else "")
                     + f"{prefixes} prefix{'es' if prefixes != 1 else ''}; "
                     f"log2({self.nodes}) = {math.log2(max(self.nodes, 1)):.1f})"
                     + (f" + {self.repro.runs} repro" if self.repro else ""))
        r = self.repro
        if r is not None:
            lines.append(f"repro: {r.directory}/ ({Path(r.model).name}, {Path(r.inputs).name}, test_data_set_0/): "
                         f"{r.detail}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def error_text(errors: Sequence[str]) -> str:
    """The runtime's first error, its whole first line (ORT puts the cause at its end), and how many followed: a
    shader that fails to compile is followed by the pipeline, bind group and command buffer it invalidates, each
    reported again by the page's console."""
    distinct = summarize_errors(errors, width=ERROR_WIDTH)
    more = f" (then {len(distinct) - 1} other error(s) after it: --json FILE)" if len(distinct) > 1 else ""
    return distinct[0] + more


def _status_text(o: RunOutcome) -> str:
    if o.replayed:  # only its verdict was kept
        return f"{o.status} (the verdict of an earlier run, from the replay file)"
    if o.status == FAIL:  # the error itself is shown once, beside the node found
        return f"fails ({len(o.errors)} runtime error(s))"
    worst = [v for v in o.verdicts.values() if not v.passed]
    text = (worst[0].text if worst else
            next((v.text for v in o.verdicts.values() if v.kind == AGREES), Verdict(BYTE_IDENTICAL, 0.0, 0.0).text))
    if o.errors:
        text += f", with {len(o.errors)} uncaught WebGPU error(s)"
    return text
