"""What a patch run carries from one lift of the model to the next: the run's decisions, taken from the whole
model, which the passes follow, and what the passes record on each lift, which the run reads.

Why: the passes see only the lifted deform regions, while some of their decisions depend on the whole model: how
many chunks a block needs for the peak of live tensors to fit `--max-memory` (budget's measure of the whole
patched model), and whether a rewrite that is not exact by construction is exact where ORT optimises the whole
graph (its proof, or a check of the whole patched model). `patch` measures them, writes them here and lifts the
model again; the split, bands and deform_conv passes of the next lift read them.

The run owns one `RunState`; `snapshot()` and `restore()` cover every field by construction (a field added here is
saved and restored with the others), and `start_lift()` clears every field marked `per_lift`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from ..graph.pipeline import Refuse
from ..proofs.local_proof import LocalProof

_PER_LIFT = {"per_lift": True}  # a field the passes write afresh on each lift: it names the nodes of that lift's graph


@dataclass
class RunState:
    """The state of one patch run across its lifts (see the module docstring)."""

    # decided by the run, read by the passes
    min_chunks: dict[str, int] = field(default_factory=dict)  # Conv name -> chunks --max-memory asks for
    keep_whole: dict[str, Refuse] = field(default_factory=dict)  # node name -> why its parts are not shown exact
    # False: the Conv chunks are not checked in the pass (a run of the whole Conv input and its chunks in one
    # session: 4 GB at 1024), since `patch` shows each of them exact with its proof (local_proof.py) anyway
    check_in_pass: bool = True
    # written by the passes
    chunks: dict[str, int] = field(default_factory=dict)  # Conv name -> chunks made (by the split pass)
    checked: dict[tuple, Refuse | None] = field(default_factory=dict)  # isolated Conv checks, by Conv and chunks
    # node name -> what shows its rewrite exact (local_proof.py; read by `patch` before it writes)
    proofs: dict[str, LocalProof] = field(default_factory=dict, metadata=_PER_LIFT)
    # Conv name -> its chunks' inputs -> (the whole Conv input, axis, first row, end row) they hold: where a proof
    # starts at the Conv's input (the Conv split or whole)
    rows: dict[str, dict[str, tuple[str, int, int, int]]] = field(default_factory=dict, metadata=_PER_LIFT)

    def start_lift(self) -> None:
        """Forget what an earlier lift recorded: its proofs and rows name the nodes of its own graph."""
        for f in dataclasses.fields(self):
            if f.metadata.get("per_lift"):
                getattr(self, f.name).clear()

    def snapshot(self) -> RunState:
        """A copy of every field (each dict copied, its values shared), for `restore`."""
        return RunState(**{f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def restore(self, saved: RunState) -> None:
        """Every field as in `saved`; a dict keeps its identity (a pass made for this run may hold it)."""
        for f in dataclasses.fields(self):
            value, mine = getattr(saved, f.name), getattr(self, f.name)
            if isinstance(mine, dict):
                mine.clear()
                mine.update(value)
            else:
                setattr(self, f.name, value)
