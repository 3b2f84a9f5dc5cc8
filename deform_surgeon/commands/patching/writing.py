"""The last stages of a patch run: write OUT while its checks run on the written file, and undo a rewrite a check
shows not exact (`Writing`, part of `PatchRun`); with nothing to rewrite, the copy `--copy-unchanged` asks for
(`Writing.write_unchanged`)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx

from ...base.background import Background
from ...base.errors import SurgeonError, VerificationError
from ...base.scratch import scratch
from ...base.stages import StageClock, step
from ...checks.run_in_segments import SEGMENT_LEVEL
from ...checks.verify import DEFAULT_ITERATIONS, level_of
from ...checks.verify import verify as verify_models
from ...files import DataForm, Written, check_spliced, copy_atomic, save_model_atomic
from ...graph.ops import op_histogram
from ...graph.pipeline import Options, Outcome, Refuse
from ...passes.run_state import RunState
from ...proofs.local_proof import unshown_threads
from ..report import PatchReport
from .lift import Lifted, lift_within_memory
from .notes import annotate, data_written, strict_note, weights_form
from .options import ComparisonOptions, WriteOptions

# what a model kept aside (`Writing._aside`) is for, in the words TMPDIR's line names it by (base/scratch.py)
_KEPT_ASIDE = {"float16": "the model kept aside for the float16 proofs",
               "undo": "the model kept aside for the search of the rewrite at fault"}


class NotShownExact(Exception):
    """Why a check did not show the rewrites not exact by construction exact, from the check to the undo:
    `undo`, the rewrites shown wrong and why (a float16 proof's difference); or `level` and `candidates`, the
    whole-model check that differed and the rewrites it checked (`Writing.culprits` then finds which)."""

    def __init__(self, text: str, *, undo: dict[str, Refuse] | None = None, level: str = "all",
                 candidates: list[str] | None = None, options: dict | None = None) -> None:
        super().__init__(text)
        self.text, self.undo, self.level, self.candidates = text, undo or {}, level, candidates or []
        self.options = options or {}  # the comparison that differed (`verify`'s keywords): what the search asks


class Writing:
    """The last stages of a patch run, part of `PatchRun` (commands/patch.py): `write` OUT while its checks run on
    the written file (`verify`), and when a check shows a rewrite not exact, `undo` that rewrite only and write
    again.

    The checks, in order: each float16 rewrite's own proof (`_prove_float16`: on the nodes around it, held to the
    roundings ORT CPU chooses in the original and in the patched model); then, for the rewrites still not shown
    exact (and all with `verify`), the whole patched model against the original on ORT CPU at the levels they ask.
    A float16 proof that disproves a rewrite names it; a whole-model check that differs names only the level, and
    `culprits` finds the rewrite(s) that make the difference by a search over them, as `bisect` searches over
    prefixes of a model. The file takes OUT's place only after every check passed.

    What it reads and writes of the run (`PatchRun`'s fields) and the stages it asks the run for again:"""

    model_path: Path
    rewrite: Options
    writing: WriteOptions
    comparison: ComparisonOptions
    clock: StageClock
    state: RunState
    report: PatchReport
    lifted: Lifted
    lift_note: str
    undone: dict[str, Refuse]

    def lift_once(self) -> Lifted:
        """One lift of the model (`PatchRun.lift_once`): what the undo search keeps aside."""
        raise NotImplementedError

    def lift(self, rounds: int) -> tuple[Lifted, str]:
        """The model lifted again (`PatchRun.lift`), after an undo."""
        raise NotImplementedError

    def prove(self) -> None:
        """The local proofs run again (`PatchRun.prove`), after an undo."""
        raise NotImplementedError

    def write_unchanged(self) -> PatchReport:
        """Nothing to rewrite: nothing written unless `copy_unchanged` (then an exact copy of the input)."""
        report, lifted, output_path, form = self.report, self.lifted, self.writing.output, self.writing.form
        model_path, weights = Path(report.model), lifted.weights
        report.webgpu = lifted.kernels(patched=False)
        nothing = f"nothing to rewrite in {model_path}" + (
            f" ({len(report.refused)} node(s) refused: see their reasons)" if report.refused else "")
        report.note = "; ".join(x for x in (nothing, report.note) if x)
        if output_path is not None and self.writing.copy_unchanged:
            if weights.external or report.weights["external_data"] or form.choice == "always":
                self.clock.enter("write")  # its data must move beside the copy (same tensors, re-pointed), or out
                written = save_model_atomic(lifted.model, output_path, weights=weights, form=form)
            else:  # (the copy's size as one file is the input's: "auto" decided by it)
                copy_atomic(model_path, output_path, check=weights.check_unchanged, inputs=weights.inputs.values())
                written = Written(None, os.path.getsize(output_path))
            report.written = True
            data_written(report, written, weights, form)
            report.note += f"; wrote an unchanged copy to {output_path}"
        elif output_path is not None:
            report.note += "; no output written (--copy-unchanged writes an unchanged copy)"
        if not report.written:  # what a page would be given is the input, as it is
            report.weights = weights_form(model_path, None, weights, DataForm(), as_is=True)
        return report

    def write(self) -> PatchReport:
        """Write OUT, checked; undo what a check shows not exact and write again; the report as written."""
        while True:
            self.clock.enter("write")
            patched, region = self.lifted.patched()
            check = self.verify if self.comparison.verify or self._unproven() else None
            try:
                written = self._write(patched, region, check)
            except VerificationError as exc:
                cause = exc.__cause__
                if not isinstance(cause, NotShownExact):
                    raise
                self.clock.enter("undo")
                found = cause.undo or self.culprits(cause)
                if not found:  # the model differs without the rewrites checked: not theirs to undo
                    raise
                self.undo(found)
                if self.writing.strict and self.report.findings:  # the rewrites undone are refused now
                    strict_note(self.report)
                    return self.report
                continue
            self.report.written = True
            data_written(self.report, written, self.lifted.weights, self.writing.form)
            return self.report

    def _unproven(self) -> list:
        return [a for a in self.report.actions if a.needs_verify and a.action == Outcome.REWRITTEN]

    def _write(self, patched: onnx.ModelProto, region: onnx.ModelProto,
               check: Callable[[Path], None] | None) -> Written:
        """Write `patched` while its spliced graph is checked on a second core; the file takes OUT's place only
        after that and `check(tmp)` passed. Returns what was written."""
        weights = self.lifted.weights
        checking = Background(check_spliced, patched, region, self.writing.output, weights)
        try:
            return save_model_atomic(patched, self.writing.output, verify=check, weights=weights,
                                     check=checking.result, form=self.writing.form)
        finally:
            checking.close()

    def verify(self, tmp: Path) -> None:
        """The checks of the written temporary file `tmp` (see the class docstring); raises `VerificationError`
        (from `NotShownExact`, what to undo or search) where one differs."""
        self.clock.enter("verify")
        float16 = [a for a in self._unproven() if a.details.get("float16")]
        if float16:
            self._prove_float16(float16, tmp)
        unproven = self._unproven()
        runs = self._runs(unproven)
        for kwargs in runs:
            result = self._compare(tmp, kwargs)
            if kwargs is runs[0]:  # the comparison the user asked for (the others only show rewrites exact)
                # (of the file that takes OUT's place: the report names OUT, not its temporary name)
                self.report.verification = dataclasses.replace(result, patched=str(self.writing.output)) \
                    if self.comparison.verify else None
            if not result.identical:
                self.lifted.weights.check_unchanged()
                found = result.mismatch.text() if result.mismatch else "outputs differ"
                raise VerificationError(self.writing.output, "patched model differs from the original, not written: "
                                        f"{found}") from (NotShownExact(found, level=result.opt_level, candidates=[
                                            a.node for a in unproven], options=kwargs) if unproven else None)
        if unproven:
            checked = "; ".join(f"level '{r.get('opt_level') or 'all'}', "
                                f"{r.get('iterations') or DEFAULT_ITERATIONS} input(s), {threads_said(r)}"
                                for r in runs)
            self._mark({a.node for a in unproven}, f"verified byte-identical before writing ({checked})",
                       {"shown_exact": "whole_model", "levels": [r.get("opt_level") or "all" for r in runs],
                        "threads": sorted({t for r in runs for t in thread_list(r)})})

    def _runs(self, unproven: list) -> list[dict]:
        """The comparisons of the whole model: the user's (`verify`), and for the rewrites not shown exact, as many
        inputs as `verify` compares by default (one input can round a float16 difference away) at ORT's default
        level and at each level a rewrite asks for (a float16 rewrite: both), each at the thread counts that split
        those rewrites' kernels differently (`_threads`)."""
        asked = self.comparison.options
        runs = [asked] if self.comparison.verify else [self._unshown({**asked})] if unproven else []
        if not unproven:
            return runs
        asked = [lvl for a in unproven for lvl in a.details.get("verify_levels", ())]
        segmented = runs[0].get("segment_memory") is not None
        # (runs in segments are at level disable: the whole model at ORT's default level was not asked for then,
        # and a level a rewrite asks for is run whole)
        for level in dict.fromkeys([*([] if segmented else ["all"]), *asked]):
            extra = self._at(level)
            if not any(covers(r, extra) for r in runs):  # (the user's own may: same level, inputs and counts)
                runs.append(extra)
        return runs

    def _at(self, level: str) -> dict:
        extra = self._unshown({**self.comparison.options, "opt_level": level})
        if level != SEGMENT_LEVEL:
            extra.pop("segment_memory", None)
        return extra

    def _unshown(self, options: dict) -> dict:
        """`options` for a comparison that decides the rewrites not shown exact on their own: at least `verify`'s
        default inputs, and the thread counts their kernels can differ at (`unshown_threads`) where the user named
        none."""
        options["iterations"] = max(options.get("iterations") or DEFAULT_ITERATIONS, DEFAULT_ITERATIONS)
        if options.get("threads") is None:
            options["threads"] = list(unshown_threads([self.state.proofs.get(a.node) for a in self._unproven()]))
        return options

    def _compare(self, path: Path, kwargs: dict):
        step(f"the whole model against the original on ORT CPU, level '{kwargs.get('opt_level') or 'all'}'"
             + (f", in segments of {kwargs['segment_memory']}" if kwargs.get("segment_memory") else ""))
        try:
            return verify_models(self.model_path, path, **kwargs, input_shapes=self.rewrite.input_shapes)
        except VerificationError:
            raise
        except SurgeonError as exc:
            self.lifted.weights.check_unchanged()  # an input changed under the comparison: the problem to name
            if exc.path != str(path):  # the original (or an option) is at fault: bad input
                raise
            problem = f"the patched model {exc.problem}, where the original runs; not written"
            unproven = self._unproven()
            raise VerificationError(self.writing.output, problem) from (
                NotShownExact(f"it could not be run: {exc.problem}", level=kwargs.get("opt_level") or "all",
                         candidates=[a.node for a in unproven], options=kwargs) if unproven else None)

    def _prove_float16(self, actions: list, tmp: Path) -> None:
        """The float16 rewrites' proofs (proofs/float16_proof.py): each connected group of the nodes they changed,
        between the model without them and the written file, held to ORT CPU's graphs of both. A group shown exact
        marks its rewrites so, one that differs is raised (its rewrites undone), and one whose proof cannot stand
        for the model leaves its rewrites to the whole-model check."""
        from ...proofs.float16_proof import ModelView, Unshown, groups, verdict
        from ...proofs.local_proof import LEVELS
        from ...proofs.precision import file_roundings

        shown, disproved, left, starts, counts = set(), {}, {}, {}, {}
        rows = {x: r for by_conv in self.state.rows.values() for x, r in by_conv.items()}  # (the written lift's)
        step(f"the model without the {len(actions)} float16 rewrite(s), for their proofs")
        with self._aside([a.node for a in actions], "float16") as before_path:
            step("ORT CPU's graphs of it and of the written file, at each level")
            read = file_roundings([(before_path, level) for level in LEVELS] + [(tmp, level) for level in LEVELS],
                                  "ORT CPU's graphs of the models they compare")
            roundings = {(path == tmp, level): r for (path, level), r in read.items()}
            before, after = ModelView(before_path), ModelView(tmp)
            found = groups(before, after)
            for k, group in enumerate(found, 1):
                covered = [a.node for a in actions if group.made & set(a.new_nodes)]
                if not covered:
                    continue
                step(f"float16 proof {k} of {len(found)}: {len(covered)} rewrite(s), {len(group.whole)} node(s) "
                     f"replaced by {len(group.parts)}")
                proof = verdict(group, before, after, lambda patched, level: roundings[(patched, level)],
                                self.lifted.ctx.ort_cpu, rows)
                why = proof.why
                if why is None:
                    shown.update(covered)
                    starts.update(dict.fromkeys(covered, list(proof.starts_at)))
                    counts.update({n: sorted({*counts.get(n, ()), *proof.threads}) for n in covered})
                elif isinstance(why, Unshown):
                    left.update(dict.fromkeys(covered, str(why)))
                else:
                    disproved.update({node: why.prefixed("not shown exact: ", undone="on_its_own",
                                                         together=sorted(covered),
                                                         **({"proof_starts_at": list(proof.starts_at)}
                                                            if proof.starts_at else {})) for node in covered})
            del before, after
        shown -= set(left) | set(disproved)  # (a rewrite in two groups: each must show it)
        if disproved:
            raise VerificationError(self.writing.output, f"{len(disproved)} float16 rewrite(s) not shown exact on "
                                    "their own") from NotShownExact("a float16 proof differs", undo=disproved)
        levels = " and ".join(f"'{x}'" for x in LEVELS)
        self._mark(shown, "shown exact before writing, on its own: the nodes it changed (with the rewrites they "
                          "touch), beside the nodes they replaced, with their readers and the producers ORT CPU "
                          f"rounds their inputs by, on ORT CPU at levels {levels} and every intra-op thread count "
                          "(one count of each class that splits their Convs and GEMMs alike; seeded inputs of the real "
                          "shapes), where ORT CPU runs them as in the model without it and in the written file "
                          "(read from its graphs)", {"shown_exact": "on_its_own", "levels": list(LEVELS)})
        self.report.actions = [dataclasses.replace(a, reason=f"{a.reason}; its split Conv's proof starts at the "
                                                   f"Conv's input ({', '.join(starts[a.node])}): the nodes before it "
                                                   "compute each element in the chunks as in the whole block "
                                                   "(ORT CPU's graphs of both round it alike)",
                                                   details={**a.details, "proof_starts_at": starts[a.node]})
                               if starts.get(a.node) and a.node in shown else a for a in self.report.actions]
        self.report.actions = [dataclasses.replace(a, details={**a.details, "not_shown_on_its_own": left[a.node]})
                               if a.node in left and a.needs_verify else a for a in self.report.actions]
        self.report.actions = [dataclasses.replace(a, details={**a.details, "threads": counts[a.node]})
                               if a.node in shown and a.node in counts else a for a in self.report.actions]

    def _mark(self, nodes: set[str], how: str, details: dict) -> None:
        self.report.actions = [dataclasses.replace(a, needs_verify=False, reason=f"{a.reason}: {how}",
                                                   details={**a.details, **details})
                               if a.node in nodes and a.needs_verify else a for a in self.report.actions]

    def culprits(self, cause: NotShownExact) -> dict[str, Refuse]:
        """The rewrites among `cause.candidates` that make the whole model differ, asked with the comparison that
        differed (`cause.options`: every input, level and thread count it ran): a search over prefixes of them
        (the model with a prefix applied and the rest undone), one rewrite found per binary search, each blamed
        with the difference measured with it applied and gone with it alone undone; {} when the model differs
        with all of them undone. A rewrite is kept unless a search shows it so."""
        rest, options = list(cause.candidates), cause.options or self._at(cause.level)
        if self._differs(rest, options) is not None:
            return {}
        bad: dict[str, Refuse] = {}
        while rest and (text := self._differs(list(bad), options)) is not None:
            lo, hi = 0, len(rest)  # rest[:lo] applied: identical; rest[:hi] applied (`bad` undone): differs (`text`)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                found = self._differs([*bad, *rest[mid:]], options)
                if found is None:
                    lo = mid
                else:
                    hi, text = mid, found
            bad[rest.pop(hi - 1)] = self._blame(len(cause.candidates), options, text)
        return bad

    @staticmethod
    def _blame(searched: int, options: dict, text: str) -> Refuse:
        level = options.get("opt_level") or "all"
        return Refuse(f"not shown exact on the whole model: with it the whole patched model was checked on ORT CPU "
                      f"and it differed from the original ({text}, opt level '{level}'), and with it alone undone it "
                      f"did not; found by a search over the {searched} rewrite(s) the check covered, with every "
                      "input and thread count the check ran, the others kept", undone="whole_model", level=level,
                      difference=text, threads=thread_list(options))

    def _differs(self, undo: list[str], options: dict) -> str | None:
        """The whole model's first difference from the original under `options` (the comparison that failed) with
        `undo` kept whole and every other rewrite applied; None when byte-identical."""
        step(f"the search: {len(undo)} rewrite(s) kept whole")
        with self._aside(undo, "undo") as path:
            result = self._compare(path, options)
        return None if result.identical else (result.mismatch.text() if result.mismatch else "outputs differ")

    @contextmanager
    def _aside(self, undo: list[str], what: str) -> Iterator[Path]:
        """The patched model with `undo` kept whole, written to a `scratch` folder (removed after), the run state as it
        was after: what the undo search compares, and what a float16 proof's whole side is held to."""
        saved = self.state.snapshot()
        self.state.keep_whole.update({n: Refuse("kept whole aside") for n in undo})
        try:
            lifted, _ = lift_within_memory(self.lift_once, self.state, self.rewrite.max_memory, 0)
            patched, _ = lifted.patched()
            with scratch(f"deform-surgeon-{what}-", _KEPT_ASIDE[what]) as folder:
                path = folder / self.writing.output.name
                save_model_atomic(patched, path, weights=lifted.weights, form=self.writing.form)
                del lifted, patched
                yield path
        finally:
            self.state.restore(saved)

    def undo(self, found: dict[str, Refuse]) -> None:
        """Keep `found` whole, lift again and prove again (keeping a node whole changes its neighbours' context)."""
        self.undone.update(found)
        self.state.keep_whole.update(found)
        self.report.verification = None
        self.lift(rounds=0)
        self.prove()
        patched, _ = self.lifted.patched()
        self.report.actions, self.report.ops_after = self.lifted.actions, op_histogram(patched)
        self.report.webgpu = self.lifted.kernels(patched=True)
        kinds = Counter(a.pass_name for a in self.report.actions if a.node in self.undone)
        annotate(self.report, self.lifted, f"{len(self.undone)} rewrite(s) undone ("
                  + ", ".join(f"{c} {k}" for k, c in sorted(kinds.items())) + "): not shown exact (see their lines); "
                  "the others written", self.lift_note)


def covers(run: dict, needed: dict) -> bool:
    """Whether the comparison `run` asks at least what `needed` asks: its level, as many inputs, every thread
    count of it (ORT's default count stands only for itself)."""
    def level(r: dict) -> str:
        return level_of(r.get("opt_level"), r.get("segment_memory"))

    def inputs(r: dict) -> int:
        return r.get("iterations") or DEFAULT_ITERATIONS

    counts, wanted = set(thread_list(run)), set(thread_list(needed))
    return level(run) == level(needed) and inputs(run) >= inputs(needed) and (
        wanted <= counts if wanted else not counts)


def thread_list(options: dict) -> list[int]:
    threads = options.get("threads")
    return [] if threads is None else [threads] if isinstance(threads, int) else list(threads)


def threads_said(options: dict) -> str:
    """"intra-op threads 1, 2, 5" (or "ORT's default intra-op threads"): a comparison's thread counts, as said."""
    counts = thread_list(options)
    return f"intra-op threads {', '.join(map(str, counts))}" if counts else "ORT's default intra-op threads"


