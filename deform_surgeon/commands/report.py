"""The PatchReport: what was rewritten, what was refused and why, op counts before/after; as a table or JSON."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..base.stages import stage_lines
from ..checks.verify import VerifyResult
from ..graph.kernels import KernelReport
from ..graph.pipeline import Action, Outcome
from .args import API_NAMES

REPORT_VERSION = 1
_ALWAYS_SHOWN = ("GatherND", "GatherElements", "Sum", "Gather")

# What a patch came to, in one word (batch's summary table shows it per model). `refused` is a finding: some node was
# left unchanged, or some tensor of the model stays over the device profile, so the model does not run wholly on
# the GPU of the profile (a refused node runs on the CPU EP; a tensor over the binding size fails when it runs).
OK, UNCHANGED, REFUSED = "ok", "unchanged", "refused"
FINDING_EXIT = 3  # `patch` and `batch` exit with it on a finding (the model written unless --strict)

# The reasons and notes name options as the command line spells them; an API user reads the keywords instead. The
# flags and their keywords are the argument groups' own (args.API_NAMES), longest first ("--input-shapes" whole)
_FLAG = re.compile("(?P<flag>" + "|".join(re.escape(f) for f in sorted(API_NAMES, key=len, reverse=True))
                   + r")(?![\w-])")


def api_words(text: str) -> str:
    """`text` with the command line's option names replaced by the Python API's keywords (`--max-memory` ->
    `max_memory`), for a report read through the API."""
    return _FLAG.sub(lambda m: API_NAMES[m["flag"]], text)


@dataclass
class PatchReport:
    model: str
    output: str | None = None
    written: bool = False
    options: dict = field(default_factory=dict)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    verification: VerifyResult | None = None
    note: str = ""
    webgpu: KernelReport | None = None  # the nodes without a WebGPU kernel, of the output (or the input if unchanged)
    passes: list[str] = field(default_factory=list)  # the registered passes that ran, in order (--skip-pass: not all)
    weights: dict | None = None  # where OUT's weights go and why (`notes.weights_form`), with a browser problem
    stays_over: list[str] = field(default_factory=list)  # tensors the output still makes over the profile's binding
    stages: list[dict] = field(default_factory=list)  # each stage's wall time and peak RSS (stages.py), in order

    @property
    def rewritten(self) -> list[Action]:
        return [a for a in self.actions if a.action in (Outcome.REWRITTEN, Outcome.REWRITTEN_UNPROVEN)]

    @property
    def unproven(self) -> list[Action]:
        return [a for a in self.actions if a.action == Outcome.REWRITTEN_UNPROVEN]

    @property
    def refused(self) -> list[Action]:
        return [a for a in self.actions if a.action == Outcome.REFUSED]

    @property
    def changed(self) -> bool:
        return bool(self.rewritten)

    @property
    def status(self) -> str:
        """The one word for what this patch came to: `refused` on a finding (`findings`), else `unchanged` when
        nothing was rewritten, else `ok`. Why here: `patch` and `batch` must judge the same file alike (not exit 0
        with a note in one and "refused" with exit 3 in the other); `patch`'s exit code and `batch`'s status (read
        from the JSON's `status`, which its workers send) both come from this."""
        if self.findings:
            return REFUSED
        return OK if self.changed else UNCHANGED

    @property
    def findings(self) -> str:
        """What makes the status `refused`, counted ("" when nothing does): what `--strict` refuses to write."""
        parts = [f"{len(self.refused)} node(s) refused" if self.refused else "",
                 f"{len(self.stays_over)} tensor(s) over the device profile" if self.stays_over else ""]
        return ", ".join(p for p in parts if p)

    def to_dict(self) -> dict:
        return {
            "version": REPORT_VERSION,
            "model": self.model,
            "output": self.output,
            "written": self.written,
            "options": self.options,
            "passes": self.passes,
            "ops_before": self.ops_before,
            "ops_after": self.ops_after,
            "summary": {
                "rewritten": len(self.rewritten) - len(self.unproven),
                "rewritten_unproven": len(self.unproven),
                "refused": len(self.refused),
            },
            "status": self.status,
            "stays_over": self.stays_over,
            "nodes": [a.to_dict() for a in self.actions],
            "verification": None if self.verification is None else self.verification.to_dict(),
            "webgpu": None if self.webgpu is None else self.webgpu.to_dict(),
            "weights": self.weights,
            "stages": self.stages,
            "note": self.note,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def op_table(self) -> str:
        ops = sorted({k for k in set(self.ops_before) | set(self.ops_after)
                      if self.ops_before.get(k, 0) != self.ops_after.get(k, 0) or k in _ALWAYS_SHOWN})
        rows = [("op type", "before", "after")] + [
            (k, str(self.ops_before.get(k, 0)), str(self.ops_after.get(k, 0))) for k in ops]
        rows.append(("(all nodes)", str(sum(self.ops_before.values())), str(sum(self.ops_after.values()))))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}" for r in rows)

    def weights_lines(self) -> list[str]:
        """Where the written weights are (a page must be given an external data file), or why what is written (or
        the input, left as it is) will not load in a browser page."""
        w = self.weights
        if not w:
            return []
        if w["browser_problem"]:
            what = "" if self.written or self.output is None else " (the input, left as it is)"
            return [f"WARNING: will not load in a browser page{what}: {w['browser_problem']}"]
        if w["external_data"] and (self.written or self.output is None):
            return [f"weights: external data in {w['external_data']} ({w['why']}); onnxruntime-web needs it as "
                    f"`externalData: [{{path: '{w['external_data']}', data: URL}}]`, transformers.js when config.json "
                    f"says so (batch of a model folder writes that)"]
        return []

    def format(self, verbose: bool = False, cli: bool = False) -> str:
        """The terminal report: the op table, a per-node summary and the verdict lines. `cli`: name the command
        line's flags (`--verbose`) where it tells how to see more, else the Python API's (`verbose=True`)."""
        more = "--verbose or --report FILE.json lists all" if cli else "format(verbose=True) or to_json() lists all"
        unproven = "--allow-unproven" if cli else "allow_unproven=True"
        skipped = self.options.get("skip_passes") or ()
        lines = [f"model: {self.model}",
                 f"passes: {', '.join(self.passes) or '(none)'}" + (f" (skipped: {', '.join(skipped)})" if skipped
                                                                     else ""),
                 self.op_table(), ""]
        by_kind: dict[tuple[str, str], list[Action]] = {}
        for a in self.actions:
            by_kind.setdefault((a.pass_name, a.action), []).append(a)
        for (pass_name, action), items in by_kind.items():
            lines.append(f"{pass_name}: {len(items)} node(s) {action}")
            shown = items if (verbose or action != Outcome.REWRITTEN) else items[:3]
            for a in shown:
                lines.append(f"  {action:<18} {a.op:<14} {a.node}: {a.reason}")
            if len(shown) < len(items):
                lines.append(f"  ... {len(items) - len(shown)} more ({more})")
        if self.unproven:
            lines.append(f"WARNING: {len(self.unproven)} node(s) rewritten WITHOUT a range proof "
                         f"({unproven}); an out-of-range index there reads a wrong element silently on WebGPU:")
            lines.extend(f"WARNING:   {a.op} '{a.node}'" for a in self.unproven)
        if self.refused:
            lines.append(f"{len(self.refused)} node(s) left unchanged (refused, see reasons above)")
        if self.webgpu is not None:
            lines.extend(self.webgpu.lines())
        if self.verification is not None:
            lines.append(self.verification.summary())
        lines.extend(self.weights_lines())
        lines.extend(stage_lines(self.stages))
        if self.note:
            lines.append(self.note)
        text = "\n".join(lines)
        return text if cli else api_words(text)
