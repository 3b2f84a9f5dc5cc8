"""The second stage of a patch run: each rewrite that is not exact by construction shown exact on its own before
anything is written (proofs/local_proof.py), with what the proofs need of the model outside the lifted region: the
nodes reading a tensor there (`outside_readers`) and the values it computes from stored tensors alone
(`outside_constants`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx

from ...base.stages import step
from ...graph.pipeline import Outcome
from ...passes.run_state import RunState
from .lift import Lifted


def prove_locally(lifted: Lifted, note: str, state: RunState, relift: Callable[[], tuple[Lifted, str]],
                  rounds: int = 3) -> tuple[Lifted, str]:
    """Show each rewrite that is not exact by construction exact on its own (proofs/local_proof.py): the nodes
    it replaced and the nodes it made, each with the nodes reading them, on ORT CPU at the real shapes. One that
    is not shown exact is kept whole (`state.keep_whole`) and the model lifted again (`relift`), and the proofs
    run again (keeping a node whole changes its neighbours' context). A rewrite without a proof is left to the
    whole-model check `patch` runs before writing. Returns the lift and the report's `note` (the --max-memory
    line), with how many rewrites were undone before it."""
    from ...proofs.local_proof import LEVELS, refusal

    undone = 0
    for _ in range(rounds):
        unproven = [a for a in lifted.actions if a.needs_verify and a.action == Outcome.REWRITTEN
                    and a.node in state.proofs]
        if not unproven:
            break
        outside = outside_readers(lifted)
        constant = outside_constants(lifted)
        failed = {}
        for k, a in enumerate(unproven, 1):
            step(f"local proof {k} of {len(unproven)}: {a.pass_name} '{a.node}'")
            if (why := refusal(lifted.ctx, state.proofs[a.node], outside, constant)) is not None:
                failed[a.node] = why
        if not failed:
            levels = " and ".join(f"'{x}'" for x in LEVELS)
            lifted.actions = [dataclasses.replace(a, needs_verify=False, reason=(
                f"{a.reason}: shown exact before writing, on its own: beside the nodes it replaced, with the nodes "
                f"reading it, on ORT CPU at levels {levels}, {every_count(state.proofs[a.node].threads)} (seeded "
                "inputs of the real shapes)"), details={**a.details, "shown_exact": "on_its_own",
                                                        "levels": list(LEVELS),
                                                        "threads": list(state.proofs[a.node].threads)})
                if a in unproven else a for a in lifted.actions]
            break
        state.keep_whole.update({node: why.prefixed("not shown exact: ", undone="on_its_own")
                                 for node, why in failed.items()})
        undone += len(failed)
        lifted, note = relift()
    if undone:
        note = "; ".join(x for x in (f"{undone} rewrite(s) undone: not shown exact on their own (see their lines)",
                                     note) if x)
    return lifted, note


def every_count(counts: tuple[int, ...]) -> str:
    """How a proof run at `counts` covers every intra-op thread count (docs/runtime-facts.md, "Threads")."""
    said = ", ".join(map(str, counts))
    return (f"at every intra-op thread count (run at {said}: one count of each class that splits its Convs and "
            "GEMMs alike)")


def outside_constants(lifted: Lifted, limit: int = 32):
    """name -> its value when the model computes it from stored tensors and Constant nodes only, in at most
    `limit` nodes (what ORT's constant folding makes an initializer before it fuses), else None."""
    from ...base.ort_cpu import run_ort_cpu

    graph = lifted.model.graph
    producer = {o: n for n in graph.node for o in n.output}
    initializers = {t.name: t for t in graph.initializer}
    memo: dict[str, np.ndarray | None] = {}

    def stored(name: str) -> np.ndarray:
        if name in lifted.weights.tensors:
            return lifted.weights.read(name)
        return onnx.numpy_helper.to_array(initializers[name])

    def value(name: str) -> np.ndarray | None:
        if name in memo:
            return memo[name]
        memo[name] = None
        if name in lifted.weights.tensors or name in initializers:
            memo[name] = stored(name)
            return memo[name]
        nodes, stack, leaves = {}, [name], set()
        while stack:
            t = stack.pop()
            if not t or t in lifted.weights.tensors or t in initializers:
                leaves.add(t)
                continue
            n = producer.get(t)
            if n is None or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for a in n.attribute):
                return None
            if id(n) not in nodes:
                nodes[id(n)] = n
                if len(nodes) > limit:
                    return None
                stack.extend(n.input)
        order = {id(n): k for k, n in enumerate(graph.node)}
        inits = [onnx.numpy_helper.from_array(np.asarray(stored(t)), t) for t in leaves if t]
        try:
            typ = lifted.ctx.types[name]
            model = onnx.helper.make_model(onnx.helper.make_graph(
                sorted(nodes.values(), key=lambda n: order[id(n)]), "fold", [],
                [onnx.helper.make_tensor_value_info(name, typ[0], None)], inits),
                opset_imports=lifted.model.opset_import)
            memo[name] = run_ort_cpu(model, {}, "disable", threads=1, quiet=True)[0]
        except Exception:  # noqa: BLE001 (not computable here: the proof treats it as a value)
            memo[name] = None
        return memo[name]

    return value


def outside_readers(lifted: Lifted):
    """name -> the nodes outside the lifted region reading that tensor, as NodeSpecs with their facts."""
    from ...proofs.local_proof import Facts, NodeSpec

    graph = lifted.model.graph
    inside = set(lifted.region.nodes)
    index: dict[str, list[int]] = {}
    for k, node in enumerate(graph.node):
        if k not in inside:
            for name in node.input:
                index.setdefault(name, []).append(k)
    made_by_constant = {o: k for k, n in enumerate(graph.node) if n.op_type == "Constant" for o in n.output}
    types = lifted.ctx.types

    def readers(name: str) -> list:
        out = []
        for k in index.get(name, []):
            node, facts = graph.node[k], Facts()
            for t in [*node.input, *node.output]:
                if not t or t in facts.types:
                    continue
                try:
                    elem, shape = types[t]
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
                except Exception:  # noqa: BLE001 (no type known: the proof says so)
                    elem, shape, dtype = 0, None, None
                facts.types[t] = (np.dtype(dtype), tuple(shape)) if dtype is not None and shape and all(
                    isinstance(d, int) for d in shape) else None
                value = None
                if t in lifted.weights.tensors:
                    value = lifted.weights.read(t)
                elif t in made_by_constant:
                    c = graph.node[made_by_constant[t]]
                    value = next((onnx.numpy_helper.to_array(a.t) for a in c.attribute if a.name == "value"), None)
                facts.constants[t] = value
            out.append((NodeSpec.of(node), facts))
        return out

    return readers


