"""The pass form (`Pass`: the loop every pass runs in), the context passes share, and running passes to a fixed point.

Why a fixed point: one pass can expose work for another (a lowered gather leaves a Sum next to it, a chained
Sum leaves nothing), and running until nothing changes makes a second `patch` on a patched model a no-op by
construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.util.misc import SynchronizedList

from ..files import tidy
from .ranges import RangeProver, TypeInfo

if TYPE_CHECKING:
    from ..files import Weights


class Outcome(StrEnum):
    """What a pass did at one node: rewrote it (proven exact), rewrote it with `--allow-unproven`, or refused."""

    REWRITTEN = "rewritten"
    REWRITTEN_UNPROVEN = "rewritten_unproven"
    REFUSED = "refused"


class Refuse(Exception):
    """Raised deep inside a pass's check (or its rewrite) when a match must be left as it is; the message is the
    reason the report shows, `details` what it states as data (docs/report.md, "Details"): `Refuse(reason,
    limit_bytes=...)`. `Pass.run` catches it at the match, takes back what the match built and returns
    `Action(..., Outcome.REFUSED, str(exc), details=exc.details)`."""

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
    # the nodes built for it, in the order they were built: `Pass.run` records them (a rewrite need not name them)
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
    # the runtime a pass asks when exactness depends on a kernel, not on the graph: (model, feeds, level,
    # threads=...) -> outputs; None: ORT CPU (base.ort_cpu.run_ort_cpu). Tests give their own to reach the paths
    # it decides.
    ort_cpu: Callable[..., list[np.ndarray]] | None = None
    # the tensors ORT CPU makes with the model's own nodes (passes/cut_and_join.py `made_by_ort`), None where not read
    made_by_ort: frozenset[str] | None = None
    names: NameScope = field(init=False)
    _prover: RangeProver | None = field(default=None, init=False)
    _match: _Undo | None = field(default=None, init=False, repr=False)  # the match `Pass.run` is at, if any

    def __post_init__(self) -> None:
        self.names = NameScope(self.graph, self.reserved)
        if self.ort_cpu is None:
            from ..base.ort_cpu import run_ort_cpu

            self.ort_cpu = run_ort_cpu

    @property
    def prover(self) -> RangeProver:
        if self._prover is None:
            self._prover = RangeProver(self.graph, self.types, self.stored)
        return self._prover

    def held_in_float32(self, t: gs.Tensor) -> bool:
        """Whether ORT CPU holds the float16 tensor `t` in float32 (True where that was not read: the cut that keeps
        float32 values as they were, which is what most of a float16 deform block holds)."""
        return self.made_by_ort is None or t.name not in self.made_by_ort

    def invalidate(self) -> None:
        """Forget cached proofs after a mutation (proofs are cheap to redo; stale ones are not acceptable)."""
        self._prover = None

    def built(self) -> list[gs.Node]:
        """The nodes built so far for the match `Pass.run` is at (its check's and its rewrite's), in the order they
        were built: what the match's `Action` names, and what a refusal takes back."""
        return [] if self._match is None else self._match.built()

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

    def layer(self, op: str, base: str, inputs: list[gs.Tensor], dtype: np.dtype | type | None,
              shape: Sequence[int | str | None] | None, attrs: dict | None = None, *,
              output: str | None = None) -> gs.Variable:
        """A node of `op` named from `base` with one new output (named from `output`, else from `base` too), and
        that output: onnx-graphsurgeon's `Graph.layer`, for a chain built one tensor at a time."""
        out = self.var(base if output is None else output, dtype, shape)
        self.node(op, base, inputs, [out], attrs)
        return out


class Pass:
    """A rewrite in onnxscript's rewriter's shape (`RewriteRuleClassBase`: pattern, check, rewrite), with the loop
    written once, here, for every pass:

    - `matches(ctx)`: where the pattern occurs, a list taken before any rewrite (a node, or what a pass matches:
      a deform block, a Conv and its feeders); what all of one run's matches share is made here;
    - `check(ctx, match)`: the plan for rewriting the match, or `Refuse` with the reason it must not be;
    - `rewrite(ctx, match, plan)`: builds the replacement from the plan and returns its `Action`; it may still
      raise `Refuse` (the residency pass learns whether a chain is exact while it builds its float32 form);
    - `refused(match, why)`: the `Action` of a refusal, from the `Refuse` raised (a pass may name the node or word
      the reason its way).

    One `Action` per match, naming the nodes built for it (`Context.built`: `Pass.run` records them, as
    onnxscript's rewriter knows the nodes its replacement's builder made). A refused match leaves the graph as it
    was (`_Undo`): the nodes built for it are taken back, the nodes that were there get back their inputs, outputs,
    names, ops and attributes, and `memo` (what a run's matches share: the four corners of a deformable conv read
    one flattened data tensor) forgets what the match added. The names handed out stay taken, so that a name never
    means two tensors in one run (the prover's facts are kept by name).
    """

    name: str = ""

    def run(self, ctx: Context) -> list[Action]:
        self.memo: dict = {}
        # what refused matches built, kept alive until the run ends: caches keyed by id() (shapes.Shapes) must not
        # meet a new tensor at the address of a taken-back one
        self._taken_back: list[gs.Node] = []
        actions = []
        for match in self.matches(ctx):
            undo = ctx._match = _Undo(ctx.graph, self.memo)
            try:
                with undo:
                    action = self.rewrite(ctx, match, self.check(ctx, match))
                actions.append(replace(action, new_nodes=tuple(n.name for n in undo.built())))
            except Refuse as why:
                self._taken_back += undo.restore()
                self.memo = undo.memo
                actions.append(self.refused(match, why))
            finally:
                ctx._match = None
        return actions

    def matches(self, ctx: Context) -> Iterable[Any]:
        raise NotImplementedError

    def check(self, ctx: Context, match: Any) -> Any:
        raise NotImplementedError

    def rewrite(self, ctx: Context, match: Any, plan: Any) -> Action:
        raise NotImplementedError

    def refused(self, match: Any, why: Refuse) -> Action:
        """A refused node's `Action`; a match that is not a node names its node here."""
        return Action(self.name, match.name, match.op, Outcome.REFUSED, str(why), details=why.details)


class _Undo:
    """What one match changes in the graph, to put back if the match is refused.

    gs keeps a node's inputs and outputs and its tensors' producers and readers in step through its
    `SynchronizedList`, and sets a node's fields through `Node.__setattr__`: for the length of a match (`with`),
    both are wrapped to note the first state of every list and node field they change, and `restore` puts exactly
    those back with plain `list` methods (so a tensor's readers come back in their order). The cost is that of what
    changed: a copy of every node's and tensor's links before each match took 2/3 of the passes' time on the real
    BiRefNet-lite 512 export (181 matches on a region of about 2,500 nodes). A pass changes no tensor that was there
    (it makes new ones), so tensors' own fields are not noted."""

    _MUTATORS = ("append", "extend", "insert", "remove", "pop", "clear", "__setitem__", "__delitem__")

    def __init__(self, graph: gs.Graph, memo: dict) -> None:
        self.graph, self.memo = graph, dict(memo)
        self.nodes = list(graph.nodes)
        self.io = (list(graph.inputs), list(graph.outputs))
        self.lists: dict[int, tuple[list, list]] = {}
        self.fields: dict[tuple[int, str], tuple[gs.Node, str, Any]] = {}

    def _note(self, links: list) -> None:
        if id(links) not in self.lists:
            self.lists[id(links)] = (links, list.copy(links))

    def _noting(self, name: str, original: Callable) -> Callable:
        def noted(links: SynchronizedList, *args: Any) -> Any:
            if name == "extend":
                args = (list(args[0]),)
            self._note(links)
            touched = list(links) if name in ("pop", "remove", "clear", "__setitem__", "__delitem__") else []
            touched += args[0] if name == "extend" else [args[-1]] if name in ("append", "insert", "remove",
                                                                                  "__setitem__") else []
            for other in touched:  # the other side of each link
                self._note(getattr(other, links.field_name))
            return original(links, *args)
        return noted

    def __enter__(self) -> _Undo:
        self.originals = {name: SynchronizedList.__dict__[name] for name in self._MUTATORS}
        for name, original in self.originals.items():
            setattr(SynchronizedList, name, self._noting(name, original))
        self.node_setattr = gs.Node.__dict__["__setattr__"]
        fields, node_setattr = self.fields, self.node_setattr

        def setattr_noted(node: gs.Node, name: str, value: Any) -> None:
            if name not in ("inputs", "outputs") and name in node.__dict__ and (id(node), name) not in fields:
                fields[(id(node), name)] = (node, name, node.__dict__[name])
            node_setattr(node, name, value)

        gs.Node.__setattr__ = setattr_noted
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(SynchronizedList, name, original)
        gs.Node.__setattr__ = self.node_setattr

    def built(self) -> list[gs.Node]:
        """The nodes in the graph now that were not there when the match began, in the graph's order."""
        kept = {id(n) for n in self.nodes}
        return [n for n in self.graph.nodes if id(n) not in kept]

    def restore(self) -> list[gs.Node]:
        """Put the graph back; return the nodes taken back."""
        built = self.built()
        for links, saved in self.lists.values():
            list.__setitem__(links, slice(None), saved)
        for node, name, value in self.fields.values():
            object.__setattr__(node, name, value)
        self.graph.nodes[:] = self.nodes
        self.graph.inputs[:], self.graph.outputs[:] = self.io
        return built


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
