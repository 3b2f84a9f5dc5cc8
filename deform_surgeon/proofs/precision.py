"""Where ORT CPU rounds a float16 model, read from the graph it runs: what lets a float16 rewrite be shown exact
on the nodes around it instead of on the whole model.

Why: ORT CPU has no float16 kernel for most ops; it runs them in float32 behind Casts it inserts, drops the Cast
pairs between two of them, and runs in float32 a node that has a float16 kernel when its neighbours all run in
float32 (its InsertCastTransformer, passes/cut_and_join.py). Which tensor is rounded to float16 is therefore decided by
the graph around it. A few nodes taken out of the model (a local proof) are rounded where the whole model rounds
them only if ORT decides the same there, and a proof shows a float16 rewrite exact only then.

ORT says what it decided in the graph it saves (`optimized_model_filepath`): a node that runs in float32 writes
`InsertedPrecisionFreeCast_<name>` in place of `<name>` and reads the `InsertedPrecisionFreeCast_` copies of its
inputs. `Rounding` is that reading, per tensor (which node kind writes it, in which form) and, at level `disable`
where the nodes keep their names, per node input (the form it reads). Two graphs agree on a set of nodes when
every one of their tensors is written in the same form by the same kind of node and read in the same form: the
nodes then run the same kernels on the same roundings of their inputs, which is what decides their bytes (the
values do not: local_proof.py). A session is created, nothing is run: its cost is the graph's, not its tensors'.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..base.scratch import scratch

CAST_PREFIX = "InsertedPrecisionFreeCast_"
TYPED, FLOAT32 = "typed", "float32"  # a tensor as the graph types it, or ORT's float32 copy of a float16 one
GIVEN_ROUNDED = "held in float32 in the model, given rounded here"
PAST_PRODUCER = "and in the model what its producer reads (ORT drops a Cast pair there)"


@dataclass(frozen=True)
class Rounding:
    """What ORT CPU runs, at one level: `made[tensor]` = (form, op of the node writing it; "" for a graph input
    or a stored tensor, which ORT does not write), a tensor absent when ORT fused or folded it away;
    `read[(node, tensor)]` = the form the node reads (level `disable` only: other levels rename fused nodes)."""

    made: dict[str, tuple[str, str]]
    read: dict[tuple[str, str], str]

    def made_by_model(self) -> frozenset[str]:
        """The tensors the model's own nodes write as they are typed (passes/cut_and_join.py `made_by_ort`)."""
        return frozenset(t for t, (form, op) in self.made.items() if form == TYPED and op)

    def differences(self, other: Rounding, nodes: Iterable[tuple[str, tuple[str, ...], tuple[str, ...]]],
                    inputs: Iterable[str] = ()) -> dict[str, str]:
        """Where `other` (a proof's graph) runs `nodes` ((name, inputs, outputs) each) otherwise than `self` (the
        whole model's): tensor -> what differs, {} when they agree. `inputs`: the tensors `other` takes as graph
        inputs (typed: rounded already); one the model holds in float32 is named with "given rounded"."""
        found: dict[str, str] = {}
        given = set(inputs)
        for name, ins, outs in nodes:
            for t in outs:
                if t and self.made.get(t) != other.made.get(t):
                    found.setdefault(t, f"'{t}' is written {_said(self.made.get(t))} in the model, "
                                        f"{_said(other.made.get(t))} here")
            for t in ins:
                if not t:
                    continue
                if t in given and self.made.get(t, (TYPED, ""))[0] != TYPED:
                    found.setdefault(t, f"'{t}' is {GIVEN_ROUNDED}")
                elif self.read and (name, t) not in self.read and (name, t) in other.read and t in given:
                    found.setdefault(t, f"'{name}' reads '{t}' here, {PAST_PRODUCER}")
                elif self.read and self.read.get((name, t)) != other.read.get((name, t)):
                    found.setdefault(t, f"'{name}' reads '{t}' {self.read.get((name, t))} in the model, "
                                        f"{other.read.get((name, t))} here")
        return found


def _said(made: tuple[str, str] | None) -> str:
    if made is None:
        return "by no node (fused or folded away)"
    form, op = made
    return f"{'as typed' if form == TYPED else 'in float32'} by {op or 'no node (an input)'}"


def rounding(model: str | Path | onnx.ModelProto, level: str = "disable", folder: Path | None = None,
             what: str = "ORT CPU's graph of the model") -> Rounding:
    """ORT CPU's graph of `model` (a file, or a model in memory) at `level`, read as a `Rounding`. ORT saves it in a
    folder of its own inside `folder` (a `scratch` folder its caller removes: `file_roundings`), or else in a
    `scratch` folder for `what` (the words TMPDIR's line names it by)."""
    from ..base.ort_cpu import optimized_graph

    with (tempfile.TemporaryDirectory(prefix="ds-rounding-", dir=folder) if folder is not None else
          scratch("ds-rounding-", what)) as tmp:
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
        graph = optimized_graph(source, level, Path(tmp))
    return _read(graph, keep_reads=level == "disable")


def _read(graph: onnx.GraphProto, keep_reads: bool) -> Rounding:
    made: dict[str, tuple[str, str]] = {}
    read: dict[tuple[str, str], str] = {}
    for node in graph.node:
        if node.name.startswith(CAST_PREFIX) and node.op_type == "Cast":
            continue  # ORT's own Casts: what they make is the other form of a tensor a node of the model wrote
        op = f"{node.domain}:{node.op_type}" if node.domain else node.op_type
        for t in node.output:
            if t:
                made[_base(t)] = (_form(t), op)
        if keep_reads:
            for t in node.input:
                if t:
                    read[(node.name, _base(t))] = _form(t)
    return Rounding(made, read)


def _base(name: str) -> str:
    return name[len(CAST_PREFIX):] if name.startswith(CAST_PREFIX) else name


def _form(name: str) -> str:
    return FLOAT32 if name.startswith(CAST_PREFIX) else TYPED


def file_roundings(asked: list[tuple[Path, str]], what: str = "ORT CPU's graphs of the models"
                   ) -> dict[tuple[Path, str], Rounding]:
    """`rounding` of each (file, level), the second half of them on a second core (background.py): a session of
    a whole model is made for each, about a second each on BiRefNet's float16 files. Both write in one `scratch`
    folder of this process's, removed once the child is reaped: a child stopped while ORT writes (this side
    failed first) leaves nothing behind."""
    from ..base.background import Background

    mine, theirs = asked[:len(asked) // 2], asked[len(asked) // 2:]
    with scratch("ds-rounding-", what) as folder:
        child = Background(_roundings, theirs, folder)
        try:
            found = _roundings(mine, folder)
            found.update(child.result())
        finally:
            child.close()
    return found


def _roundings(asked: list[tuple[Path, str]], folder: Path) -> dict[tuple[Path, str], Rounding]:
    return {(path, level): rounding(path, level, folder) for path, level in asked}
