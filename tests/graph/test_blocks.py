"""Deform-block attribution: found from structure, stable across a patch, used to split placement per block."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from helpers import FIXTURES, patch_in_memory

from deform_surgeon.graph.blocks import OUTSIDE, block_of, deform_blocks
from deform_surgeon.webgpu.placement.command import per_block
from deform_surgeon.webgpu.placement.logparse import LogSummary
from deform_surgeon.webgpu.placement.result import Placement


@pytest.mark.parametrize("name", ["decoder_gathernd.onnx", "decoder_gatherelements_fp16.onnx"])
def test_every_sampler_and_sum_belongs_to_one_of_eight_blocks_that_survive_the_patch(name):
    model = onnx.load(str(FIXTURES / name))
    owner = deform_blocks(model)
    samplers = [n for n in model.graph.node if n.op_type in ("GatherND", "GatherElements", "Sum")]
    assert samplers and all(n.name in owner for n in samplers)
    assert len(set(owner.values())) == 8
    convs = {n.name for n in model.graph.node if n.op_type == "Conv" and n.name in owner}
    assert {label.split(" (")[0] for label in owner.values()} == {f"Conv '{c}'" for c in convs}  # its own Conv
    patched, _ = patch_in_memory(model)
    after = deform_blocks(patched)
    assert set(after.values()) == set(owner.values())
    assert all(after[n.name] for n in patched.graph.node if n.op_type == "Gather")


def test_ort_made_node_names_are_attributed_to_their_origin():
    owner = {"Slice_24": "Conv 'c'"}
    assert block_of("Slice_24/GatherSliceToSplitFusion", owner) == "Conv 'c'"
    assert block_of("Relu_1", owner) is None
    assert block_of("InsertedPrecisionFreeCast_t_9", owner, {"t_9": "Conv 'c'"}) == "Conv 'c'"


def test_per_block_counts_cpu_nodes_and_memcpy(tmp_path: Path):
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    owner = deform_blocks(model)
    sums = [n for n in model.graph.node if n.op_type == "Sum"]
    relu = next(n for n in model.graph.node if n.name not in owner)
    log = LogSummary(placement_logged=True, cpu_node_names=[sums[0].name, sums[1].name, relu.name],
                     memcpy_tensors=[sums[0].output[0], relu.output[0]])
    p = Placement(runtime="node", bundle=None, session_ok=True, error=None, log=log, adapter=None, run=None,
                  model=str(FIXTURES / "decoder_gathernd.onnx"))
    counts = per_block(p)
    assert counts[owner[sums[0].name]] == (1, 1) and counts[owner[sums[1].name]] == (1, 0)
    assert counts[OUTSIDE] == (1, 1)
    assert sum(c for c, _ in counts.values()) == 3 and len(counts) == 9


def test_budget_and_placement_read_the_same_blocks():
    """One block finder: every tensor budget attributes to a block is made by a node of that block in placement's
    table, before and after a patch, so the two tables join on the label."""
    from deform_surgeon.graph.budget import analyze

    model = onnx.load(str(FIXTURES / "decoder_gathernd_1024.onnx"))
    for m in (model, patch_in_memory(model)[0]):
        owner = deform_blocks(m)
        producer = {o: n.name for n in m.graph.node for o in n.output}
        report = analyze(m, max_buffer=1, max_binding=1, top=10**6)
        attributed = [t for t in report.largest if t.block is not None]
        assert attributed and all(owner[producer[t.name]] == t.block for t in attributed)
        assert {t.block for t in attributed} == set(owner.values())
