"""Index verdicts: whether every index a gather node can see lies inside the data it addresses, and why (or why not),
from the intervals the range prover gives its index components."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .intervals import Interval


class Status(StrEnum):
    PROVEN = "proven"
    UNPROVEN = "unproven"
    OUT_OF_RANGE = "out_of_range"


@dataclass(frozen=True)
class ComponentProof:
    """The proof (or its failure) for one index component addressing data dimension `dim` of size `size`."""

    dim: int
    size: int | None
    span: Interval
    status: Status
    why: str

    def details(self) -> dict:
        """This component as data (a report's `details`, docs/report.md): the data dim it addresses and its size,
        the interval of the index, and the clamp that bounds it or the node where the proof stops."""
        out = {"dim": self.dim, "size": self.size, "interval": [self.span.lo, self.span.hi], "nan": self.span.nan,
               "status": str(self.status)}
        if self.span.clamp:
            out["clamp"] = self.span.clamp
        if self.status is not Status.PROVEN and self.span.stop_node():
            out["stop"] = self.span.stop_node()
        return out


@dataclass(frozen=True)
class IndexVerdict:
    """Whether every index a gather node can see lies inside the data it addresses, and why (or why not)."""

    node: str
    op: str
    status: Status
    reason: str
    components: tuple[ComponentProof, ...] = field(default=())

    @property
    def proven(self) -> bool:
        return self.status is Status.PROVEN

    @property
    def details(self) -> dict:
        """The verdict as data: its status (`proof`) and one entry per index component (`indices`)."""
        return {"proof": str(self.status), "indices": [c.details() for c in self.components]}


def judge(dim: int, size: int | None, span: Interval, what: str = "index") -> ComponentProof:
    """Verdict for one index component against a data dimension: `[0, size-1]` proven, or why not."""
    label = f"data dim {dim}" + (f" (size {size})" if size is not None else "")
    if size is None or isinstance(size, str):
        return ComponentProof(dim, None, span, Status.UNPROVEN, f"{label}: size not known statically")
    if span.within(0, size - 1):
        by = f" by {span.clamp}" if span.clamp else f" ({span.source})" if span.source else ""
        return ComponentProof(dim, size, span, Status.PROVEN, f"{label}: {what} in {span.text()}{by}")
    if not span.nan and span.disjoint(-size, size - 1):
        return ComponentProof(
            dim, size, span, Status.OUT_OF_RANGE,
            f"{label}: every {what} is in {span.text()}, outside the valid [{-size}, {size - 1}]",
        )
    stop = f"proof stops at {span.stop_node()}"
    if not span.clamp:
        stop = "no Clip/Min/Max bounds it; " + stop
    history = span.history()
    return ComponentProof(
        dim, size, span, Status.UNPROVEN,
        f"{label}: {what} may be in {span.text()}, not within [0, {size - 1}]; {stop}"
        + (f" ({history})" if history else ""),
    )


def combine(node: str, op: str, parts: Sequence[ComponentProof]) -> IndexVerdict:
    if any(p.status is Status.OUT_OF_RANGE for p in parts):
        status = Status.OUT_OF_RANGE
    elif all(p.status is Status.PROVEN for p in parts):
        status = Status.PROVEN
    else:
        status = Status.UNPROVEN
    shown = [p for p in parts if p.status is status] if status is not Status.PROVEN else list(parts)
    return IndexVerdict(node, op, status, "; ".join(p.why for p in shown), tuple(parts))
