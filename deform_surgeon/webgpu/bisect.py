"""`deform-surgeon bisect MODEL`: the first node whose output a WebGPU runtime gets wrong (or on which it fails),
found on prefixes of the unmodified graph, and a repro of it small enough to attach to an onnxruntime issue.

Why prefixes and not every tensor marked as an output (Polygraphy's `--onnx-outputs mark all`): a tensor made a
graph output can no longer be fused away or have its buffer reused, so the runtime computes another program, which
can hide the bug (or create one). A prefix keeps the original nodes, in the original order, and exposes only its
cut: the tensors its nodes made that later nodes read (or that are graph outputs), and the last node's own outputs.
Every verdict of the search is from a real run of such a prefix on the runtime, held against ORT CPU on the same
prefix and the same inputs (`placement.runner`: the one runner and the one reference), in the one vocabulary
(verdict.py: differs is beyond the GPU tolerance of the tensor's dtype; an uncaught WebGPU error during a run is a
failure even when `session.run()` resolved).

The search keeps two prefixes, `good` (every exposed tensor agrees) and `bad` (something differs, or the session or
the run fails), starting from the empty prefix (nothing computed, nothing can differ) and the whole model, and
halves the distance between them: about log2(nodes) runs. It ends at adjacent prefixes k-1 and k, and that is what
is reported, each half from its own run: node k's inputs agreed (in the prefix that ends before it) and its own
output differed (in the prefix that ends with it). The search assumes that a difference, once made, stays visible
in every longer prefix's cut; a difference that a later node masks (a Shape of it, a comparison that comes out the
same) before it reaches the cut may be passed over, and then the node found is still one whose inputs agreed and
whose output did not, but not the first such node in topological order (docs/bisect.md).

The repro is node k alone: its non-constant inputs as graph inputs, fed with ORT CPU's values of them; its
constants kept. It is run on the runtime again. When it does not differ on its own (the cause needs the nodes
before it: a fusion, a reused buffer), the window of nodes before k is doubled until it does, and then narrowed by
halving to the smallest window that still does.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.errors import SurgeonError, api_call
from ..base.streams import wrote
from ..base.tool import Tool
from ..checks.verdict import AGREES, BYTE_IDENTICAL, DIFFERS, Verdict, judge_outputs, split_errors, summarize_errors
from ..graph.subgraphs import Graph, reads, save_model, sub_model, window_inputs
from .placement.runner import (
    BUNDLES,
    DEFAULT_TIMEOUT,
    RUNTIMES,
    SetupMissing,
    make_inputs,
    measure_placement,
    missing_setup,
    reference_outputs,
)

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np
    import onnx

AGREE, DIFFER, FAIL = "agrees", "differs", "fails"
# placement's bundles that load one model file (a transformers.js pipeline loads a folder: bisect runs its file on
# the webgpu bundle, which the pipeline runs)
MODEL_BUNDLES = tuple(b for b in BUNDLES if b != "transformers")
ERROR_WIDTH = 1000  # the node's error is shown once, its whole first line: ORT puts the cause at its end
Progress = Callable[[str], None] | None


# ------------------------------------------------------------------------------------------------ one run


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


def webgpu_run(runtime: str, bundle: str, profile: Any, timeout: float) -> RunFn:
    """Runs a model on the real WebGPU runtime through placement's runner.

    JSEP runs with `ort.env.debug` off, as users' pages do: a shader that fails to compile then does not reject
    `session.run()`, the outputs come back wrong and can be compared, and the uncaught WebGPU errors the page
    collects make the run count as differing anyway (with debug on, the same run would fail with no outputs to
    compare)."""
    def run(model: Path, feeds: dict[str, np.ndarray]) -> RunOutcome:
        return outcome_of(measure_placement(model, runtime=runtime, bundle=bundle, run=True, feeds=feeds,
                                            timeout=timeout, profile=profile, jsep_debug=False))

    return run




# ------------------------------------------------------------------------------------------------ the graph


def _type_outputs(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> bool:
    """Gives the model's untyped graph outputs the dtypes and shapes of `values` (ORT CPU's arrays of them), in
    place; whether any was untyped."""
    from onnx import helper

    untyped = [vi for vi in model.graph.output if not vi.type.HasField("tensor_type")]
    for vi in untyped:
        a = values[vi.name]
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape))
    return bool(untyped)


def _typed(path: Path, feeds: Mapping[str, np.ndarray]) -> Path:
    """A written model whose untyped graph outputs are typed as ORT CPU computes them (one ORT CPU run, only when
    some output is untyped)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if any(not vi.type.HasField("tensor_type") for vi in model.graph.output):
        _type_outputs(model, reference_outputs(path, dict(feeds)))
        onnx.save_model(model, str(path))
    return path


# ------------------------------------------------------------------------------------------------ the result


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
            lines.append("  runtime error: " + _error_text(f.errors))
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


def _error_text(errors: Sequence[str]) -> str:
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


# ------------------------------------------------------------------------------------------------ the replay


@dataclass
class Replay:
    """The verdicts of a search, kept in a JSON file as they come, so that an interrupted search (a browser run of
    BiRefNet on a software adapter takes up to 25 minutes, a search about 15 of them) goes on where it stopped:
    Polygraphy's `debug reduce --save-debug-replay / --load-debug-replay`, for prefixes.

    The file names what was searched (the model's file size and node count, its first and last node, the runtime,
    the device profile and the inputs); a file that names another search is refused, not mixed in."""

    path: Path
    key: dict[str, Any]
    known: dict[int, str] = field(default_factory=dict)  # prefix end -> agrees | differs | fails
    loaded: int = 0  # how many of them the file held when the search began

    @classmethod
    def open(cls, path: str | Path, key: dict[str, Any]) -> Replay:
        import json

        path = Path(path)
        replay = cls(path, key)
        if path.exists():
            try:
                data = json.loads(path.read_text())
                recorded = data["search"]
            except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise _not_a_replay_file(path, e) from None
            if recorded != key:
                what = ", ".join([*(f"{k} {recorded.get(k)!r} (now {v!r})" for k, v in key.items()
                                    if recorded.get(k) != v),
                                  *(f"{k} {v!r} (not part of this search)" for k, v in recorded.items()
                                    if k not in key)]) if isinstance(recorded, dict) else f"{recorded!r:.200}"
                raise SurgeonError(path, f"records another search: {what}",
                                   "give --replay a new file name for this search")
            try:
                known = {_step(s["prefix_end"], key.get("nodes")): str(s["status"]) for s in data["steps"]}
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise _not_a_replay_file(path, e) from None
            if any(v not in (AGREE, DIFFER, FAIL) for v in known.values()):
                raise SurgeonError(path, "is not a bisect replay file (a step's status is not agrees, differs or "
                                         "fails)")
            replay.known, replay.loaded = known, len(known)
        return replay

    def record(self, k: int, node: str, status: str) -> None:
        import json

        from ..files.write import atomic_path

        self.known[k] = status
        steps = [{"prefix_end": i, "status": v} for i, v in sorted(self.known.items())]
        with atomic_path(self.path, suffix=".json") as tmp:
            tmp.write_text(json.dumps({"search": self.key, "steps": steps}, indent=1) + "\n")


def _not_a_replay_file(path: Path, e: BaseException) -> SurgeonError:
    return SurgeonError(path, f"is not a bisect replay file ({e.__class__.__name__}: {str(e)[:200]})",
                        "give --replay a new file name, or the file an earlier bisect wrote")


def _step(value: Any, nodes: int | None) -> int:
    """A recorded prefix end: a whole number of nodes, 0 to the model's node count (a string, a fraction, a bool
    or a step past the model is no step of this search: `ValueError`, the file refused)."""
    if type(value) is not int or not 0 <= value <= (nodes if isinstance(nodes, int) else value):
        raise ValueError(f"prefix_end {value!r} is not a step of a model of {nodes} nodes")
    return value


# ------------------------------------------------------------------------------------------------ the search


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


# ------------------------------------------------------------------------------------------------ the repro


def _cpu_values(g: Graph, names: Sequence[str], feeds: Mapping[str, np.ndarray], before: int, tmp: Path
                ) -> dict[str, np.ndarray]:
    """ORT CPU's values of `names` (graph inputs or tensors made by nodes before `before`): a prefix run on ORT
    CPU exposing them, the reference the runtime's run of the prefix was held against."""
    made = [n for n in names if n not in feeds]
    values = {n: feeds[n] for n in names if n in feeds}
    if made:
        path = save_model(sub_model(g, range(before), made), tmp / f"cpu_values_{before}.onnx")
        values.update(reference_outputs(path, dict(feeds)))
    return {n: values[n] for n in names}


def write_repro(g: Graph, first: int, last: int, values: Mapping[str, np.ndarray], directory: Path) -> Path:
    """The window's model, its inputs as `inputs.npz` and as ONNX TensorProto files with ORT CPU's outputs
    (`test_data_set_0/`, the layout onnxruntime's and ONNX's test runners read); returns the model's path."""
    import numpy as np
    from onnx import numpy_helper

    directory.mkdir(parents=True, exist_ok=True)
    outputs = [y for y in g.nodes[last].output if y]
    model = sub_model(g, range(first, last + 1), outputs, values)
    model_path = save_model(model, directory / "model.onnx")
    expected = reference_outputs(model_path, dict(values))
    if _type_outputs(model, expected):  # typed as ORT CPU makes them, so that onnx.checker passes the repro
        save_model(model, model_path)
    np.savez(directory / "inputs.npz", **values)
    data = directory / "test_data_set_0"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir()
    for i, (name, a) in enumerate(values.items()):
        (data / f"input_{i}.pb").write_bytes(numpy_helper.from_array(np.asarray(a), name).SerializeToString())
    for i, (name, a) in enumerate(expected.items()):
        (data / f"output_{i}.pb").write_bytes(numpy_helper.from_array(np.asarray(a), name).SerializeToString())
    return model_path


def make_repro(g: Graph, k: int, feeds: Mapping[str, np.ndarray], run: RunFn, directory: Path, tmp: Path,
               progress: Progress = None, errors: Sequence[str] = ()) -> Repro:
    """Node k alone, then wider windows before it (doubling, then halving back) until one goes wrong on its own.

    Whether a window goes wrong is asked of node k's own outputs only, the window's only outputs."""
    runs = 0
    tried: dict[int, RunOutcome] = {}

    def attempt(first: int) -> RunOutcome:
        nonlocal runs
        if first in tried:
            return tried[first]
        names = window_inputs(g, first, k)
        values = _cpu_values(g, names, feeds, first, tmp)
        window_dir = tmp / f"window_{first}"
        path = write_repro(g, first, k, values, window_dir)
        o = run(path, dict(values))
        runs += 1
        if progress:
            progress(f"repro run {runs}: nodes {first + 1}..{k + 1} ({k - first + 1} node(s)): {o.status}")
        tried[first] = o
        return o

    width, good = 1, 0  # good: the widest window known not to reproduce
    while True:
        first = max(k - width + 1, 0)
        if attempt(first).bad:
            break
        good = width
        if first == 0:
            first = None
            break
        width *= 2
    if first is not None:  # narrow: the smallest width in (good, width] that reproduces
        lo, hi = good, k - first + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(k - mid + 1).bad:
                hi = mid
            else:
                lo = mid
        first = k - hi + 1
        o = tried[first]
        shutil.copytree(tmp / f"window_{first}", directory, dirs_exist_ok=True)
        n = k - first + 1
        what = "node alone" if n == 1 else f"{n} nodes ({g.describe(first)} .. {g.describe(k)})"
        if o.status == FAIL:
            same = summarize_errors(o.errors) == summarize_errors(errors)
            detail = f"the {what} fails on its own" + (" with the same error" if same else ": " + _error_text(o.errors))
        else:
            worst = [o.verdicts[y] for y in o.differing()]
            detail = f"the {what} differs on its own " + (worst[0].text.removeprefix("differs ") if worst else
                                                             f"({len(o.errors)} uncaught WebGPU error(s))")
            if n > 1:
                detail += f" (node {g.describe(k)} alone does not: the cause needs the nodes before it)"
        return Repro(str(directory), str(directory / "model.onnx"), str(directory / "inputs.npz"), (first, k),
                     True, o.status, detail, runs)
    shutil.copytree(tmp / f"window_{max(k - width + 1, 0)}", directory, dirs_exist_ok=True)
    return Repro(str(directory), str(directory / "model.onnx"), str(directory / "inputs.npz"), (0, k), False,
                 AGREE, "does not go wrong on its own, not even as the whole prefix fed from its inputs with only the "
                        "node's outputs exposed: the cause needs the rest of the prefix's cut (the prefix models "
                        "the search ran go wrong; see the steps in --json)", runs)


# ------------------------------------------------------------------------------------------------ the API


def _load_inputs(inputs: str | Path | Mapping[str, Any] | None, seed: int, model: onnx.ModelProto,
                 path: object) -> tuple[dict[str, np.ndarray], list[str]]:
    """The feeds: from an .npz file or a dict, checked against the model's inputs, or seeded as placement's."""
    import numpy as np

    if inputs is None:
        return make_inputs(model, seed=seed)
    if isinstance(inputs, Mapping):
        given = {k: np.asarray(v) for k, v in inputs.items()}
        source: object = "inputs"
    else:
        source = inputs
        given = _read_npz(Path(inputs))
    inits = {i.name for i in model.graph.initializer}
    wanted = [i.name for i in model.graph.input if i.name not in inits]
    missing = [n for n in wanted if n not in given]
    extra = [n for n in given if n not in wanted]
    if missing or extra:
        problems = ([f"misses {', '.join(missing)}"] if missing else []) + (
            [f"names no input {', '.join(extra)}"] if extra else [])
        raise SurgeonError(source, "; ".join(problems), f"{path} takes {', '.join(wanted)}")
    for vi in (i for i in model.graph.input if i.name in given):
        if (why := _unlike(vi, given[vi.name])) is not None:
            raise SurgeonError(source, f"input {vi.name}: {why}", f"{path} takes {vi.name} as {_input_type(vi)}")
    return {n: np.ascontiguousarray(given[n]) for n in wanted}, []


NPZ_LIMIT = 16 << 30  # bytes an .npz of inputs may unpack to (a header claiming 37 GiB was a MemoryError)


def _read_npz(path: Path) -> dict:
    """The arrays of an .npz file: a regular file (a FIFO would block), each array's header read before its
    data, so a file that cannot be read or claims more than `NPZ_LIMIT` is one line, not a traceback."""
    import stat
    import zipfile

    import numpy as np

    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise SurgeonError(path, "is not a regular file (an .npz of input arrays is)")
        with zipfile.ZipFile(path) as z:
            total = 0
            for info in z.infolist():
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    header = {(1, 0): np.lib.format.read_array_header_1_0,
                              (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if header is None:
                        continue  # (format 3: np.load reads it; a failure there is still one line)
                    shape, _, dtype = header(f)
                total += int(np.prod(shape, dtype=object)) * dtype.itemsize
            if total > NPZ_LIMIT:
                raise SurgeonError(path, f"its arrays would take {total:,} bytes, more than {NPZ_LIMIT:,}")
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except SurgeonError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError, KeyError) as e:
        raise SurgeonError(path, f"cannot be read as a .npz of input arrays ({type(e).__name__}: {e})") from None


def _input_type(vi) -> str:
    import onnx

    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)} {dims}"


def _unlike(vi, array) -> str | None:
    """Why `array` cannot be fed as graph input `vi` (its element type, its rank, a fixed dim), or None."""
    import onnx

    t = vi.type.tensor_type
    if t.elem_type and array.dtype != onnx.helper.tensor_dtype_to_np_dtype(t.elem_type):
        return f"the file gives {array.dtype}, the model takes {_input_type(vi)}"
    if t.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if len(dims) != array.ndim or any(d is not None and d != a for d, a in zip(dims, array.shape, strict=False)):
            return f"the file gives shape {list(array.shape)}, the model takes {_input_type(vi)}"
    return None


def _check_timeout(value: object, name: str) -> None:
    """A run's time limit is a positive, finite number of seconds (NaN compared false with 0 and was taken)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SurgeonError(None, f"{name} must be a positive number of seconds (got {value!r})")


@api_call
def bisect(model: str | Path, *, runtime: str = "node", bundle: str = "webgpu", device_profile: str | None = None,
           input_shapes: dict[str, Sequence[int]] | None = None, seed: int = 0,
           inputs: str | Path | Mapping[str, Any] | None = None, repro_dir: str | Path | None = None,
           timeout: float | None = None, progress: Progress = None, marked: bool = False,
           replay: str | Path | None = None) -> BisectResult:
    """Runs `model` on a WebGPU runtime and on ORT CPU and names the first node, in topological order, whose output
    differs beyond the GPU tolerance or whose prefix fails (module docstring); with `repro_dir`, writes the repro
    there and runs it. `runtime`/`bundle`/`device_profile`/`seed` are placement's; `inputs` an .npz file or a dict
    of arrays instead of seeded ones; `input_shapes` fixes symbolic input dims first; `marked` first runs the model
    with every tensor an output and checks the node it names on the prefixes (fewer runs when it holds);
    `replay` keeps the search's verdicts in a JSON file and goes on from them (`Replay`)."""
    from ..graph.device import resolve_profile
    if runtime not in RUNTIMES:
        raise SurgeonError(None, f"runtime must be one of {', '.join(RUNTIMES)} (got {runtime!r})")
    if runtime == "browser" and bundle not in MODEL_BUNDLES:
        raise SurgeonError(None, f"bundle must be one of {', '.join(MODEL_BUNDLES)} (got {bundle!r})")
    msg = missing_setup(runtime)
    if msg:
        raise SurgeonError(None, str(SetupMissing(msg)))
    if timeout is not None:
        _check_timeout(timeout, "timeout")
    profile = resolve_profile(device_profile)
    where = runtime if runtime == "node" else f"browser/{bundle}"
    run = webgpu_run(runtime, bundle, profile, DEFAULT_TIMEOUT if timeout is None else timeout)
    return bisect_with(model, run, where, input_shapes=input_shapes, seed=seed, inputs=inputs, repro_dir=repro_dir,
                       progress=progress, marked=marked, replay=replay, profile=getattr(profile, "name", None),
                       timeout=DEFAULT_TIMEOUT if timeout is None else timeout)


def _file_sha256(path: Path) -> str:
    """The model file's content (a replay file of another model of the same size and node names was taken)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def bisect_with(model: str | Path, run: RunFn, where: str, *, input_shapes: Mapping[str, Sequence[int]] | None = None,
                seed: int = 0, inputs: str | Path | Mapping[str, Any] | None = None,
                repro_dir: str | Path | None = None, progress: Progress = None, marked: bool = False,
                replay: str | Path | None = None, profile: str | None = None, timeout: float | None = None
                ) -> BisectResult:
    """`bisect` on any runtime `run(model_path, feeds) -> RunOutcome` (the real ones: `webgpu_run`); `replay`: a
    JSON file of the search's verdicts, read where it exists and written after each run (`Replay`)."""
    import onnx

    from ..files import user_path
    from ..graph.input_shapes import check_input_shapes, fix_input_shapes

    path = user_path(model, "the model")
    shapes = check_input_shapes(dict(input_shapes) if input_shapes is not None else None)
    repro = Path(repro_dir) if repro_dir is not None else None
    if repro is not None and repro.exists() and (not repro.is_dir() or any(repro.iterdir())):
        raise SurgeonError(repro, "exists and is not an empty folder", "bisect writes its repro into a new folder")
    try:
        loaded = onnx.load(str(path))
    except Exception as e:  # protobuf's DecodeError and friends
        raise SurgeonError(path, f"is not a readable ONNX model ({e})") from None
    if shapes:
        fix_input_shapes(loaded, shapes, path)
    g = Graph.of(loaded, path)
    if not g.nodes:
        raise SurgeonError(path, "has no nodes to bisect")
    twice = sorted(m for m, c in Counter(n.name for n in g.nodes).items() if c > 1 and m)
    if twice:  # (onnx.checker passes such a model; ORT refuses it: every prefix and repro would fail the same)
        raise SurgeonError(path, f"names {len(twice)} node name(s) more than once ({', '.join(twice[:3])}), "
                                 "which onnxruntime refuses", "give each node its own name")
    feeds, notes = _load_inputs(inputs, seed, loaded, path)
    log = None
    if replay is not None:
        import hashlib

        import numpy as np

        digest = hashlib.sha256(b"".join(np.ascontiguousarray(feeds[n]).tobytes() for n in sorted(feeds)))
        log = Replay.open(replay, {"model_sha256": _file_sha256(path), "nodes": len(g.nodes),
                                   "first": g.nodes[0].name, "last": g.nodes[-1].name, "runtime": where,
                                   "timeout": timeout,
                                   "device_profile": profile, "inputs_sha256": digest.hexdigest()[:16],
                                   "input_shapes": {k: list(v) for k, v in shapes.items()} if shapes else None})
    result = BisectResult(str(path), where, len(g.nodes), notes=notes)
    tmp = Path(tempfile.mkdtemp(prefix="ds-bisect-"))
    try:
        whole_path = path if not shapes else save_model(loaded, tmp / "whole.onnx")

        def run_prefix(k: int) -> RunOutcome:
            if k == len(g.nodes) - 1:
                return run(whole_path, feeds)
            prefix = _typed(save_model(sub_model(g, range(k + 1), g.cut(k)), tmp / f"prefix_{k}.onnx"), feeds)
            try:
                return run(prefix, feeds)
            finally:
                prefix.unlink(missing_ok=True)

        def run_marked() -> RunOutcome:
            produced = [y for n in g.nodes for y in n.output if y and y not in g.constants]
            every = _typed(save_model(sub_model(g, range(len(g.nodes)), produced), tmp / "marked.onnx"), feeds)
            return run(every, feeds)

        whole, finding, runs, steps, notes = search(g, run_prefix, progress, run_marked if marked else None, log)
        result.whole, result.finding, result.search_runs, result.steps = whole, finding, runs, steps
        result.notes += notes
        if finding is not None and repro is not None:
            result.repro = make_repro(g, finding.index, feeds, run, repro, tmp, progress, finding.errors)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the command


class BisectTool(Tool):
    """find the first node whose output a WebGPU runtime gets wrong (or fails on), and write a repro

    Run MODEL on a real WebGPU runtime and on ORT CPU, bisect over prefixes of the unmodified graph and name the first
    node whose output differs beyond the GPU tolerance, or whose prefix fails, with its inputs' agreement and the
    runtime's error; write a minimal repro and run it (docs/bisect.md). Exit 0: nothing differs; 1: a node was found;
    2: bad input. Needs `deform-surgeon setup`.
    """

    name = "bisect"

    def add_args(self, p: argparse.ArgumentParser) -> None:
        from ..commands.args import DEVICE_PROFILE, INPUT_SHAPES, profile_help
        p.add_argument("model", metavar="MODEL", help="ONNX model to bisect")
        p.add_argument("--runtime", choices=RUNTIMES, default="node",
                       help="node: onnxruntime-node native WebGPU EP (default); browser: headless Chromium")
        p.add_argument("--bundle", choices=MODEL_BUNDLES, default="webgpu",
                       help="browser only: webgpu (native EP, transformers.js's), jsep (the default import), all")
        DEVICE_PROFILE.add_to(p, help=profile_help("the device the browser page requests"))
        INPUT_SHAPES.add_to(p)
        p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0, placement's)")
        p.add_argument("--inputs", metavar="FILE.npz", help="the inputs, one array per graph input, instead of seeded")
        p.add_argument("--repro", metavar="DIR",
                       help="write the repro into DIR, a new folder (default: <model name>.repro in this folder)")
        p.add_argument("--no-repro", action="store_true", help="name the node only; write and run no repro")
        p.add_argument("--marked", action="store_true",
                       help="first run the model with every tensor an output (Polygraphy's `mark all`) and check the "
                            "node it names on the unmodified prefixes: 4 runs when it holds; the prefixes decide")
        p.add_argument("--json", metavar="FILE", help="write the result (every step) as JSON")
        p.add_argument("--replay", metavar="FILE.json",
                       help="keep each run's verdict in FILE as it comes, and go on from the verdicts FILE holds "
                            "(an interrupted search of the same model, runtime, profile and inputs); "
                            "Polygraphy's debug replay")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SEC",
                       help=f"stop one run after SEC seconds (default {DEFAULT_TIMEOUT:g}); a run stopped so fails")

    def run(self, args: argparse.Namespace) -> int:
        from ..commands.args import INPUT_SHAPES
        from ..files.io_check import check_io

        _check_timeout(args.timeout, "--timeout")
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)  # ORT CPU's warnings about a prefix's unused weights are noise
        repro = None if args.no_repro else (args.repro or f"{Path(args.model).stem}.repro")
        check_io([args.model], others=[("--json", args.json), ("--replay", args.replay)],
                 other_reads=[(f"the --inputs file {args.inputs}", args.inputs)] if args.inputs else [])
        t0 = time.monotonic()

        def progress(text: str) -> None:
            print(f"[bisect {time.monotonic() - t0:7.1f}s] {text}", file=sys.stderr, flush=True)

        result = bisect(args.model, runtime=args.runtime, bundle=args.bundle, device_profile=args.device_profile,
                        input_shapes=INPUT_SHAPES.value(args), seed=args.seed, inputs=args.inputs, repro_dir=repro,
                        timeout=args.timeout, progress=progress, marked=args.marked, replay=args.replay)
        if args.json:  # (before the report: a stdout that fails costs no file, base/streams.py)
            import json

            Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
            wrote(args.json)
        print(result.format())
        return 0 if result.finding is None else 1

