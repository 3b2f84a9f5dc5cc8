"""The one pass form (`pipeline.Pass`): every registered pass is written in it, it gives one `Action` per match,
and a match refused in its check or in the middle of its rewrite leaves the graph exactly as it was (the nodes
built taken back, the links, names, ops and attributes of the nodes that were there put back, the run's memo
without the match's entries), while the other matches of the run are rewritten as if it had not been tried."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from deform_surgeon.files import infer_value_types
from deform_surgeon.graph.pipeline import Action, Context, Outcome, Pass, Refuse
from deform_surgeon.passes.registry import REGISTRY, make_passes


def test_every_registered_pass_is_written_in_the_one_form():
    assert REGISTRY and all(issubclass(r.cls, Pass) for r in REGISTRY)
    for p in make_passes():
        assert type(p).run is Pass.run  # the loop is written once: no pass has its own
        assert type(p).matches is not Pass.matches and type(p).rewrite is not Pass.rewrite


def _relus(n: int = 3) -> onnx.ModelProto:
    """x -> Relu -> Relu -> ... -> y, each Relu also read by a Neg (so tensors have two readers, in an order)."""
    nodes, prev, outs = [], "x", []
    for k in range(n):
        nodes.append(helper.make_node("Relu", [prev], [f"r{k}"], name=f"relu{k}"))
        nodes.append(helper.make_node("Neg", [f"r{k}"], [f"n{k}"], name=f"neg{k}"))
        outs.append(helper.make_tensor_value_info(f"n{k}", TensorProto.FLOAT, [2, 3]))
        prev = f"r{k}"
    graph = helper.make_graph(nodes, "relus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, 3]), *outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class ReluToClip(Pass):
    """Relu -> Clip(0, +inf) through a Max with a built constant; refuses the Relus named in `refuse_in_rewrite`
    after it has built nodes, renamed the Relu, changed its attributes, taken its output and added to the memo."""

    name = "relu_to_clip"

    def __init__(self, refuse_in_check=(), refuse_in_rewrite=()) -> None:
        self.refuse_in_check, self.refuse_in_rewrite = set(refuse_in_check), set(refuse_in_rewrite)
        self.memo_seen: list[set] = []

    def matches(self, ctx):
        return [n for n in ctx.graph.nodes if n.op == "Relu"]

    def check(self, ctx, node):
        if node.name in self.refuse_in_check:
            raise Refuse(f"{node.name}: refused in its check")
        return node.name

    def rewrite(self, ctx, node, plan):
        self.memo_seen.append(set(self.memo))
        before = len(ctx.graph.nodes)
        out, x = node.outputs[0], node.inputs[0]
        zero = self.memo.setdefault(("zero", plan), ctx.const(f"{plan}/zero", np.array(0, np.float32)))
        wide = ctx.var(f"{plan}/wide", np.float32, [2, 3])
        ctx.node("Max", f"{plan}/max", [x, zero], [wide])
        node.outputs.clear()
        node.name, node.op, node.attrs = f"{plan}/replaced", "Identity", {"touched": 1}
        node.inputs.append(zero)
        ctx.node("Identity", f"{plan}/out", [wide], [out])
        if plan in self.refuse_in_rewrite:
            raise Refuse(f"{plan}: refused half way through its rewrite")
        return Action(self.name, plan, "Relu", Outcome.REWRITTEN, "Relu as Max(x, 0)",
                      tuple(n.name for n in ctx.graph.nodes[before:]))


def _state(graph: gs.Graph) -> tuple:
    """Everything a refused match must leave as it was: the nodes in order with their names, ops, attributes and
    links, and every tensor's producers and readers in order."""
    nodes = tuple((id(n), n.name, n.op, tuple(sorted(n.attrs.items())), tuple(id(t) for t in n.inputs),
                   tuple(id(t) for t in n.outputs)) for n in graph.nodes)
    tensors = {id(t): t for n in graph.nodes for t in (*n.inputs, *n.outputs)}
    links = tuple(sorted((k, tuple(id(p) for p in t.inputs), tuple(id(r) for r in t.outputs))
                         for k, t in tensors.items()))
    return nodes, links, tuple(id(t) for t in graph.inputs), tuple(id(t) for t in graph.outputs)


def _run(model: onnx.ModelProto, p: Pass) -> tuple[gs.Graph, list[Action]]:
    graph = gs.import_onnx(model)
    return graph, p.run(Context(graph, infer_value_types(model)))


@pytest.mark.parametrize("where", ["check", "rewrite"])
def test_a_refused_match_leaves_the_graph_exactly_as_it_was(where):
    model = _relus()
    graph = gs.import_onnx(model)
    before = _state(graph)
    names = [f"relu{k}" for k in range(3)]
    p = ReluToClip(**{f"refuse_in_{where}": names})
    actions = p.run(Context(graph, infer_value_types(model)))
    assert [(a.node, a.action) for a in actions] == [(n, Outcome.REFUSED) for n in names]  # one per match
    assert all(a.reason.startswith(f"{n}: refused") for a, n in zip(actions, names, strict=True))
    assert _state(graph) == before
    assert gs.export_onnx(graph).SerializeToString() == gs.export_onnx(gs.import_onnx(model)).SerializeToString()
    assert p.memo == {}


def test_the_other_matches_are_rewritten_as_if_the_refused_one_was_not_tried():
    """relu1 is refused half way: relu0 and relu2 come out as a run that never matched relu1 makes them, and
    relu2's rewrite does not see relu1's memo entry."""
    refusing = ReluToClip(refuse_in_rewrite={"relu1"})
    graph, actions = _run(_relus(), refusing)
    assert [(a.node, a.action) for a in actions] == [("relu0", Outcome.REWRITTEN), ("relu1", Outcome.REFUSED),
                                                     ("relu2", Outcome.REWRITTEN)]
    assert refusing.memo_seen == [set(), {("zero", "relu0")}, {("zero", "relu0")}]

    class SkipRelu1(ReluToClip):
        def matches(self, ctx):
            return [n for n in super().matches(ctx) if n.name != "relu1"]

    expected, _ = _run(_relus(), SkipRelu1())
    # the names the refused match handed out stay taken (a name never means two tensors in one run), and none of
    # them is left in the graph
    assert not any(n.name.startswith("relu1/") for n in graph.nodes)
    assert gs.export_onnx(graph).SerializeToString() == gs.export_onnx(expected).SerializeToString()
    relu1 = next(n for n in graph.nodes if n.name == "relu1")
    assert relu1.op == "Relu" and relu1.attrs == {} and [t.name for t in relu1.outputs] == ["r1"]
    assert [n.name for n in relu1.outputs[0].outputs] == ["neg1", "relu2/replaced", "relu2/max"]  # in order
