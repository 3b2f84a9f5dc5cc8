"""The Pass protocol, the context passes share, and running passes to a fixed point.

Why a fixed point: one pass can expose work for another (a lowered gather leaves a Sum next to it, a chained
Sum leaves nothing), and running until nothing changes makes a second `patch` on a patched model a no-op by
construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .model_io import tidy
from .ranges import RangeProver, TypeInfo

if TYPE_CHECKING:
    from .model_io import Weights


class Outcome(StrEnum):
    """What a pass did at one node: rewrote it (proven exact), rewrote it with `--allow-unproven`, or refused."""

    REWRITTEN = "rewritten"
    REWRITTEN_UNPROVEN = "rewritten_unproven"
    REFUSED = "refused"


class Refuse(Exception):
    """Raised deep inside a pass's check when a match must be left as it is; the message is the reason the report
    shows, `details` what it states as data (docs/report.md, "Details"): `Refuse(reason, limit_bytes=...)`. The pass
    catches it at the match and returns `Action(..., Outcome.REFUSED, str(exc), details=exc.details)`."""

    def __init__(self, reason: str, **details: Any) -> None:
        super().__init__(reason)
        self.details = json_safe(details)

    def prefixed(self, head: str, **details: Any) -> Refuse:
        """The same refusal under `head` (`f"{head}{reason}"`), with `details` added: for a check that refuses in
        the words of the match it is part of."""
        return Refuse(f"{head}{self}", **{**details, **self.details})


def json_safe(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers, tuples as lists and a float infinity or NaN as the string
    `"inf"`, `"-inf"` or `"nan"`: what `json.dumps` writes as standard JSON."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


@dataclass(frozen=True)
class Action:
    """What one pass did, or refused to do, at one node, and why."""

    pass_name: str
    node: str
    op: str
    action: Outcome
    reason: str
    new_nodes: tuple[str, ...] = ()
    # True when the rewrite is not exact by construction and was only checked on a part of the model (the split
    # pass's Conv chunks): `patch` then verifies the whole model before writing it, and undoes it if that fails
    needs_verify: bool = False
    # what `reason` states, as data (chunks, rows, sizes in bytes, bounds, the limit, a measured difference): one
    # vocabulary for every pass, docs/report.md "Details"; JSON-safe (numbers, strings, lists, mappings)
    details: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "details", json_safe(self.details))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["new_nodes"] = list(self.new_nodes)
        return d


def rewrite_each(pass_name: str, nodes: Iterable[gs.Node], check: Callable[[gs.Node], Any],
                 rewrite: Callable[[gs.Node, Any], Action]) -> list[Action]:
    """The one way a pass treats its matches: `check(node)` returns a plan or raises `Refuse` (the reason, as
    data, goes to the report); `rewrite(node, plan)` builds the replacement from the plan alone."""
    actions = []
    for node in nodes:
        try:
            plan = check(node)
        except Refuse as why:
            actions.append(Action(pass_name, node.name, node.op, Outcome.REFUSED, str(why), details=why.details))
            continue
        actions.append(rewrite(node, plan))
    return actions


SUM_MODES = ("chain", "tree", "none")  # Options.sum_mode (the sum_chain pass): Add chain, Add tree, left as Sum


@dataclass
class Options:
    """Patch options. `None` never appears: every field has its documented default."""

    allow_unproven: bool = False
    sum_mode: str = "chain"  # chain | tree | none
    max_buffer: int | None = None  # bytes; split deform blocks and band Convs/Resizes over it (None: no split)
    max_memory: int | None = None  # bytes; chunk deform blocks until budget's peak of live tensors fits (None: no)
    device_profile: str = "spec-default"  # the name of the device profile the model is fitted to
    storage_buffers: int | None = 8  # that profile's maxStorageBuffersPerShaderStage (None: no fitting)
    input_shapes: dict[str, tuple[int, ...]] | None = None  # --input-shape: inputs' dims fixed first (None: as is)
    skip_passes: tuple[str, ...] = ()  # --skip-pass: names of registered passes (passes/registry.py) not to run


class NameScope:
    """Fresh, deterministic names derived from an original node's name, never colliding with existing ones."""

    def __init__(self, graph: gs.Graph, reserved: set[str] | None = None) -> None:
        self.used: set[str] = {n.name for n in graph.nodes} | set(graph.tensors().keys()) | (reserved or set())

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name = f"{base}_{k}"
            k += 1
        self.used.add(name)
        return name


@dataclass
class Context:
    """Everything a pass needs: the graph it mutates in place, type facts, options and the range prover."""

    graph: gs.Graph
    types: TypeInfo
    options: Options = field(default_factory=Options)
    reserved: set[str] | None = None  # names taken outside `graph` (the rest of the model, when `graph` is a region)
    stored: Weights | None = None  # the stored tensors among the graph's inputs, whose values the prover may read
    # the runtime a pass asks when exactness depends on a kernel, not on the graph: (model, feeds, level) ->
    # outputs; None: ORT CPU (verify.run_ort_cpu). Tests give their own to reach the paths it decides.
    ort_cpu: Callable[[onnx.ModelProto, dict[str, np.ndarray], str], list[np.ndarray]] | None = None
    names: NameScope = field(init=False)
    _prover: RangeProver | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.names = NameScope(self.graph, self.reserved)
        if self.ort_cpu is None:
            from .verify import run_ort_cpu

            self.ort_cpu = run_ort_cpu

    @property
    def prover(self) -> RangeProver:
        if self._prover is None:
            self._prover = RangeProver(self.graph, self.types, self.stored)
        return self._prover

    def invalidate(self) -> None:
        """Forget cached proofs after a mutation (proofs are cheap to redo; stale ones are not acceptable)."""
        self._prover = None

    # -- small graph-building helpers shared by passes --------------------------------------------------------
    def const(self, base: str, values: np.ndarray) -> gs.Constant:
        return gs.Constant(self.names.fresh(base), np.array(values, order="C"))  # keeps 0-d arrays 0-d

    def var(self, base: str, dtype: np.dtype | type | None, shape: Sequence[int | str | None] | None) -> gs.Variable:
        return gs.Variable(self.names.fresh(base), dtype=None if dtype is None else np.dtype(dtype),
                           shape=None if shape is None else list(shape))

    def node(self, op: str, base: str, inputs: list[gs.Tensor], outputs: list[gs.Tensor],
             attrs: dict | None = None) -> gs.Node:
        node = gs.Node(op=op, name=self.names.fresh(base), attrs=attrs or {}, inputs=inputs, outputs=outputs)
        self.graph.nodes.append(node)
        return node


class Pass(Protocol):
    """A rewrite: finds its pattern, asks the prover where needed, rewrites in place, reports each node."""

    name: str

    def run(self, ctx: Context) -> list[Action]: ...


def run_passes(ctx: Context, passes: Iterable[Pass], max_rounds: int = 4) -> list[Action]:
    """Run passes in order until a round changes nothing; return every rewrite and the last round's refusals."""
    passes = list(passes)
    done: list[Action] = []
    refusals: dict[tuple[str, str], Action] = {}
    for _ in range(max_rounds):
        changed = False
        for p in passes:
            actions = p.run(ctx)
            for a in actions:
                if a.action == Outcome.REFUSED:
                    refusals[(a.pass_name, a.node)] = a
                else:
                    done.append(a)
                    changed = True
            if any(a.action != Outcome.REFUSED for a in actions):
                tidy(ctx.graph)
                ctx.invalidate()
        if not changed:
            break
    return done + list(refusals.values())
