"""Bands pass: ordinary tensors over --max-buffer (BiRefNet's decoder tail) are computed in row bands (Conv) and
channel groups (Resize), each shown exact on its own (proofs/local_proof.py) before anything is written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import assert_bytes_equal, patch_in_memory
from helpers.bands import LEVELS, KiB, bands_actions, feeds_for, over, run
from helpers.graphs import decoder_tail, decoder_tail_full, swin_mlp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import patch
from deform_surgeon.graph.budget import analyze
from deform_surgeon.graph.pipeline import Outcome, Refuse


def assert_same_at_both_levels(model: onnx.ModelProto, patched: onnx.ModelProto | str) -> None:
    """The same bytes from both models on ORT CPU at levels `all` and `disable`, on two seeded inputs."""
    for seed in (0, 1):
        feeds = feeds_for(model, seed)
        for level in LEVELS:
            assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))


# At this replica's 64x64 the image branch's last 3x3 Conv (24 channels in: K = 216 > 128) sums its last 64 pixels
# in blocks of 256 at 15 intra-op threads, MLAS's last thread segment of the whole Conv, which no row bands can
# match (docs/runtime-facts.md, "Threads"): its bands are undone, shown to differ at 15 threads, and 'ipt_conv1'
# stays over the limit. At BiRefNet's 1024 every band's segments are thousands of pixels: one order at any count.
NOT_AT_EVERY_COUNT = "Conv_ipt_conv_out"


def undone_at_15_threads(act) -> None:
    assert act.action == Outcome.REFUSED and act.details["undone"] == "on_its_own", act.reason
    assert act.details["threads"] == 15 and act.details["max_diff"] > 0 and "15 intra-op thread(s)" in act.reason


# ------------------------------------------------------------------------------------ BiRefNet's decoder tail
@pytest.mark.parametrize("current", [False, True], ids=["legacy", "current"])
def test_decoder_tail_fits_the_limit_and_is_byte_identical(tmp_path, current):
    """The replica of BiRefNet's decoder tail at 300 KiB: the 512 KiB Resize in channel groups, the three Convs
    reading 320-640 KiB inputs in row bands; each is shown exact on its own before writing, nothing is over. In the
    current code's form the Resize is also read by a Shape (a Constant afterwards) and the image branch's first
    Conv has an input of unknown shape (derived from its output for the bands)."""
    src, out, limit = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx", 300 * KiB
    onnx.save(decoder_tail(current=current), src)
    assert sorted(over(str(src), limit)) == ["att_cat", "dec_up", "ipt_conv1", "out_cat"]
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    assert sorted(acts) == ["Conv_att_conv1", "Conv_ipt_conv_out", "Conv_mask", "Resize_dec_up"]
    undone_at_15_threads(acts.pop(NOT_AT_EVERY_COUNT))
    assert all(a.action == Outcome.REWRITTEN and not a.needs_verify for a in acts.values())
    assert all(a.details["shown_exact"] == "on_its_own" for a in acts.values())
    resize = acts["Resize_dec_up"].details
    assert (resize["groups"], resize["group_channels"], resize["channels"]) == (2, [16, 16], 32)
    assert resize["source"] == "Conv_dec_conv_out"  # the Conv computed for each group's channels, not a Slice
    assert resize["shape_readers"] == (1 if current else 0)  # a Shape reader becomes a Constant
    assert acts["Conv_att_conv1"].details["carried"] == ["Relu"]
    assert all(a.details["band_bytes"] <= limit for a in acts.values() if a.op == "Conv")
    assert report.written and over(str(out), limit) == ["ipt_conv1"]
    model = onnx.load(src)
    assert_same_at_both_levels(model, str(out))
    # a second patch changes nothing: what is left over is refused again, for the same reason
    again = patch(out, tmp_path / "again.onnx", max_buffer=limit)
    assert not again.changed and [a.node for a in again.refused] == [NOT_AT_EVERY_COUNT]


def test_a_resize_read_by_an_add_is_computed_in_channel_groups_with_the_add(tmp_path):
    """BiRefNet_HR's form: the Resize is read by an Add with a lateral Conv's output, and the Add by the
    channel Concat. The Add is carried per channel group, reading the lateral Conv computed for the group's
    channels; nothing is over the limit and the bytes are those of the original at both levels."""
    src, out, limit = tmp_path / "hr.onnx", tmp_path / "hr.patched.onnx", 300 * KiB
    onnx.save(decoder_tail(lateral=True), src)
    assert {"dec_up", "dec_up_lateral", "lateral"} <= set(over(str(src), limit))
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    resize = acts["Resize_dec_up"]
    assert resize.action == Outcome.REWRITTEN and resize.details["carried"] == ["Add"]
    assert resize.details["shown_exact"] == "on_its_own" and "then its Add 'Add_dec_up_lateral' per group" in \
        resize.reason
    patched = onnx.load(str(out))
    assert {n.name for n in patched.graph.node if n.op_type == "Conv" and n.name.startswith("Conv_lateral/group")} == \
        {"Conv_lateral/group0", "Conv_lateral/group1"}  # the lateral Conv per group, not Slices of its output
    undone_at_15_threads(acts[NOT_AT_EVERY_COUNT])
    assert report.written and over(str(out), limit) == ["ipt_conv1"]
    assert_same_at_both_levels(onnx.load(src), str(out))


def pyramid_tail(lateral_op: str = "Add") -> onnx.ModelProto:
    """decoder_tail's HR form with the image pyramid; `lateral_op`: what joins the upsampling and the lateral Conv."""
    model = decoder_tail(lateral=True, pyramid=12)
    next(n for n in model.graph.node if n.name == "Add_dec_up_lateral").op_type = lateral_op
    return model


def test_a_channel_concat_several_nodes_read_is_taken_apart_by_its_readers(tmp_path):
    """BiRefNet_HR's image pyramid ('/Concat_3', 192 MiB at 2048): a channel Concat read by the lateral
    Conv, a Resize (sizes from its Shape) and Shapes. Each reader takes its part from the Concat's inputs: the Shapes
    become Constants, the Resize one Resize per input joined on the channels (shown exact on its own), and the
    lateral Conv's channel groups (made for the upsampling's groups), its only readers then, are computed in row
    bands from the inputs' rows. Here the lateral Conv is joined by a Mul (no ORT fusion: see the next test):
    nothing is over the limit, the Concat is never made, and the bytes are the original's at both levels."""
    src, out, limit = tmp_path / "pyr.onnx", tmp_path / "pyr.patched.onnx", 300 * KiB
    onnx.save(pyramid_tail("Mul"), src)
    assert "pyramid" in over(str(src), limit)
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    shared = acts["Concat_pyramid"]
    assert shared.action == Outcome.REWRITTEN and shared.details["resizes"] == ["Resize_pyr_small"]
    # (the Shape that sized the upsampling is read by nothing once its groups take constant sizes)
    assert shared.details["shape_readers"] == 1 and shared.details["shown_exact"] == "on_its_own"
    assert shared.details["convs"] == ["Conv_lateral/group0", "Conv_lateral/group1"]
    for k in (0, 1):
        assert acts[f"Conv_lateral/group{k}"].action == Outcome.REWRITTEN  # in row bands
    undone_at_15_threads(acts[NOT_AT_EVERY_COUNT])
    assert report.written and over(str(out), limit) == ["ipt_conv1"]
    patched = onnx.load(str(out))
    assert "pyramid" not in {o for n in patched.graph.node for o in n.output}  # never made whole
    assert {n.name for n in patched.graph.node if n.op_type == "Resize" and "pyr_small" in n.name} == \
        {"Resize_pyr_small/part0", "Resize_pyr_small/part1"}
    assert_same_at_both_levels(onnx.load(src), str(out))


def test_bands_of_a_conv_whose_add_ort_fuses_are_refused_with_what_the_proof_measured(tmp_path):
    """HR's real form: the lateral Conv's output is added to the upsampling's group, itself in ORT's NCHWc layout
    (its Resize reads a Conv's output); at level all ORT fuses the Add into the whole Conv, which a Concat of bands
    stops. The local proof runs the Add with the producers of its other input (their layout), measures the
    difference and the bands are refused; the Concat stays for them, and the bytes are the original's at both
    levels. (Without those producers the proof passed, and the patched model differed by 1.2e-7 at level all.)"""
    src, out, limit = tmp_path / "pyr.onnx", tmp_path / "pyr.patched.onnx", 300 * KiB
    onnx.save(pyramid_tail("Add"), src)
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    assert acts["Concat_pyramid"].action == Outcome.REWRITTEN  # its Resize and Shape take their parts all the same
    for k in (0, 1):
        act = acts[f"Conv_lateral/group{k}"]
        assert act.action == Outcome.REFUSED and act.details["level"] == "all" and act.details["neighbours"]
        assert act.details["max_diff"] > 0 and "not shown exact" in act.reason
    assert over(str(out), limit) == ["ipt_conv1", "pyramid"]
    assert_same_at_both_levels(onnx.load(src), str(out))


def test_a_channel_concat_read_by_another_op_is_refused_with_its_reader():
    model = pyramid_tail()
    lateral = next(n for n in model.graph.node if n.name == "Conv_lateral")
    lateral.input[0] = "pyramid_relu"  # the lateral Conv reads a Relu of the Concat: a reader with no part to take
    model.graph.node.insert(list(model.graph.node).index(lateral),
                            helper.make_node("Relu", ["pyramid"], ["pyramid_relu"], name="Relu_pyramid"))
    _, actions = patch_in_memory(model, max_buffer=300 * KiB)
    act = next(a for a in bands_actions(actions) if a.node == "Concat_pyramid")
    assert act.action == Outcome.REFUSED and act.details["reader"] == "Relu_pyramid"
    assert "it is read by Relu 'Relu_pyramid' (each reader must take its part from the Concat's inputs" in act.reason


def test_a_resize_read_by_an_op_that_is_not_elementwise_is_refused_with_its_reader():
    def with_reader(op: str) -> onnx.ModelProto:
        model = decoder_tail(lateral=True)
        next(n for n in model.graph.node if n.name == "Add_dec_up_lateral").op_type = op
        return model

    _, actions = patch_in_memory(with_reader("Max"), max_buffer=300 * KiB)  # elementwise too: carried
    assert next(a for a in bands_actions(actions) if a.node == "Resize_dec_up").action == Outcome.REWRITTEN
    _, actions = patch_in_memory(with_reader("MatMul"), max_buffer=300 * KiB)  # not elementwise: refused, named
    act = next(a for a in bands_actions(actions) if a.node == "Resize_dec_up")
    assert act.action == Outcome.REFUSED and act.details["reader"] == "Add_dec_up_lateral"
    assert "it is read by MatMul 'Add_dec_up_lateral', not only by Concats on the channel axis" in act.reason


def test_the_float16_decoder_tail_is_cut_where_ort_cpu_rounds_and_shown_exact_on_the_whole_model(tmp_path):
    """transformers.js's fp16 file of the tail (the float16 converter keeps the Resize in float32 between two Casts,
    as in the real BiRefNet-lite 1024 fp16): the Resize in channel groups made by its Conv through the converter's
    Cast, the Cast after it carried per group; the ASPP Concat's Conv in row bands, its cuts Pads where ORT CPU holds
    the values in float32; both shown exact by the whole model at both levels (a local proof would feed float16
    inputs, rounded already). The Convs whose bias of at most 8 elements ORT would share between the bands (and
    then run them on another kernel: measured on the real file) run their bands without it, and one Add after the
    join adds it; the written model has nothing over the limit and the original's bytes."""
    from helpers.variant_replicas import _script

    src, out, limit = tmp_path / "tail16.onnx", tmp_path / "tail16.patched.onnx", 150 * KiB
    onnx.save(_script().fp16(decoder_tail()), src)
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    resize, conv = acts["Resize_dec_up"], acts["Conv_att_conv1"]
    assert resize.action == conv.action == Outcome.REWRITTEN and resize.details["float16"] and conv.details["float16"]
    assert resize.details["source"] == "Conv_dec_conv_out" and resize.details["carried"] == ["Cast"]
    for act in (resize, conv):
        assert act.details["shown_exact"] == "whole_model" and set(act.details["levels"]) == {"disable", "all"}
    patched = onnx.load(str(out))
    cuts = [n for n in patched.graph.node if "/rows" in n.name and n.op_type in ("Pad", "Slice")]
    relu_cuts = [n for n in cuts if "relu" in n.name]  # the branches' Relus run in float32 on ORT CPU: Pads
    assert relu_cuts and {n.op_type for n in relu_cuts} == {"Pad"}
    # Slices only of what a float16 kernel makes: the converter's Cast after the Resize, carried per group (read
    # in rows by the mask Conv's bands)
    assert {n.input[0] for n in cuts if n.op_type == "Slice"} == {f"dec_up/group{k}" for k in range(4)}
    for name, bias in (("Conv_ipt_conv_out", "ipt_conv_out_b"), ("Conv_mask", "mask_b")):  # 8 and 1 elements
        assert acts[name].action == Outcome.REWRITTEN and acts[name].details["bias_after_join"] == bias
        assert "is added once (ORT CPU would share a copy of it between the bands" in acts[name].reason
        assert any(n.op_type == "Add" and n.name == f"{name}/bands/bias" for n in patched.graph.node)
    assert report.written and over(str(out), limit) == []
    original = onnx.load(src)
    for seed in (0, 1):
        feeds = feeds_for(original, seed)
        for level in LEVELS:
            assert_bytes_equal(run(original, feeds, level), run(str(out), feeds, level))


def test_a_float16_conv_with_a_small_bias_and_a_fusable_tail_is_refused_with_what_was_measured():
    """The bias can wait for the join only where the ops after the Conv give the same bytes fused or not (Relu,
    Cast); with a Sigmoid after it (which the bias must precede, and which the bands would carry) the bands would
    share the bias copy ORT CPU makes, and they are refused, naming it."""
    from helpers.variant_replicas import _script

    model = _script().fp16(decoder_tail())
    mask = next(n for n in model.graph.node if n.name == "Conv_mask")
    reader = next(n for n in model.graph.node if mask.output[0] in n.input)
    reader.input[list(reader.input).index(mask.output[0])] = "mask_sigmoid"
    model.graph.node.insert(list(model.graph.node).index(mask) + 1,
                            helper.make_node("Sigmoid", [mask.output[0]], ["mask_sigmoid"], name="Sigmoid_mask"))
    _, actions = patch_in_memory(model, max_buffer=150 * KiB)
    act = next(a for a in bands_actions(actions) if a.node == "Conv_mask")
    assert act.action == Outcome.REFUSED and act.details["shared"] == "mask_b", act.reason
    assert "reads 'mask_b' of 1 element(s), which ORT CPU would share between the bands" in act.reason


def test_a_float16_resize_whose_groups_would_read_slices_is_refused(tmp_path):
    """When the Conv before the Resize is also read elsewhere (a second graph output), the groups would read Slices
    of its output; in a float16 model that is refused with what was measured on the real file (the float32 model
    decides by the local proof: test_groups_from_a_slice_when_the_conv_output_is_read_elsewhere)."""
    from helpers.variant_replicas import _script

    model = decoder_tail()
    model.graph.output.append(helper.make_tensor_value_info("dec_conv_out", TensorProto.FLOAT, [1, 32, 32, 32]))
    _, actions = patch_in_memory(_script().fp16(model), max_buffer=150 * KiB)
    act = next(a for a in bands_actions(actions) if a.node == "Resize_dec_up")
    assert act.action == Outcome.REFUSED and "in a float16 model its groups would read Slices" in act.reason


def test_the_proofs_run_without_neighbours_at_level_disable_only(tmp_path, monkeypatch):
    """Each proof of the decoder tail runs its two sides at both levels; at `disable` (no graph transformation on
    a float32 graph) each side is the rewritten nodes alone compared at their ends, at `all` with the readers and
    the producers ORT fuses them with, compared at the readers' outputs (the graph output 'mask' has none)."""
    import importlib

    verify = importlib.import_module("deform_surgeon.base.ort_cpu")
    real, asked = verify.run_ort_cpu, []

    def recording(model, feeds, level="all", **kwargs):
        if model.graph.name == "local_proof":
            asked.append((level, {n.name for n in model.graph.node}, {o.name for o in model.graph.output}))
        return real(model, feeds, level, **kwargs)

    monkeypatch.setattr(verify, "run_ort_cpu", recording)
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, out, max_buffer=300 * KiB)
    assert report.written and len(bands_actions(report.actions)) == 4
    # (each side runs at each thread count of its proof's classes, and a side that differed once more)
    disable = [(nodes, outs) for level, nodes, outs in asked if level == "disable"]
    at_all = [(nodes, outs) for level, nodes, outs in asked if level == "all"]
    assert disable and at_all
    for nodes, _ in at_all:  # the neighbours at `all` only
        assert any(alone < nodes for alone, _ in disable)
    for _, outs in disable:  # compared at the rewritten nodes' ends at `disable`, at the readers' at `all`
        assert any(outs.isdisjoint(compared) or outs == compared == {"mask"} for _, compared in at_all)
    model = onnx.load(src)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds_for(model), level), run(str(out), feeds_for(model), level))


def test_the_guard_sees_what_ort_changes_at_level_disable():
    """The proofs drop the neighbours at level `disable` only where ORT runs the graph as it is: a float32 chain,
    yes; a float16 one, no (ORT inserts Casts around the nodes it has no float16 kernel for)."""
    from deform_surgeon.proofs.local_proof import _untransformed

    def chain(elem: int) -> onnx.ModelProto:
        graph = helper.make_graph([helper.make_node("Sin", ["x"], ["y"], name="sin"),
                                   helper.make_node("Relu", ["y"], ["z"], name="relu")], "chain",
                                  [helper.make_tensor_value_info("x", elem, [1, 4])],
                                  [helper.make_tensor_value_info("z", elem, [1, 4])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    assert _untransformed(chain(TensorProto.FLOAT))
    assert not _untransformed(chain(TensorProto.FLOAT16))


def test_a_chunk_is_seeded_with_the_same_bytes_as_its_rows_of_the_whole():
    """A split Conv's chunks are fed their rows of the whole input's seeded values, made without the whole."""
    from deform_surgeon.proofs.local_proof import SEED_PERIOD, _seeded

    f32 = np.dtype(np.float32)
    for shape, rows in [((1, 3, 10, 7), (2, 3, 8)), ((2, 5, 700, 301), (2, 111, 530)), ((1, 4, 9), (1, 0, 4)),
                        ((1, 1, SEED_PERIOD // 100 + 7, 100), (2, 5, SEED_PERIOD // 100 + 3))]:
        whole = _seeded("x", f32, shape)
        index = [slice(None)] * len(shape)
        index[rows[0]] = slice(rows[1], rows[2])
        part = _seeded("x", f32, shape, rows=rows)
        assert part.shape == whole[tuple(index)].shape
        assert part.tobytes() == np.ascontiguousarray(whole[tuple(index)]).tobytes()
    assert _seeded("x", f32, (3, SEED_PERIOD)).reshape(-1)[SEED_PERIOD:2 * SEED_PERIOD].tobytes() == \
        _seeded("x", f32, (SEED_PERIOD,)).tobytes()  # the block repeats


def test_without_max_buffer_the_tail_is_left_alone(tmp_path):
    src = tmp_path / "tail.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, tmp_path / "out.onnx")
    assert not bands_actions(report.actions) and not report.changed


def test_a_band_not_shown_exact_on_the_whole_model_is_undone(tmp_path):
    """What `patch` does when the whole patched model differs: it keeps those nodes whole (the run
    state's keep_whole, here given up front as the fallback gives it), says why, and writes the rest."""
    from deform_surgeon.commands.patch import PatchRun
    from deform_surgeon.commands.patching.options import rewrite_options
    from deform_surgeon.passes.run_state import RunState

    src = tmp_path / "tail.onnx"
    onnx.save(decoder_tail(), src)
    why = "not shown exact on the whole model: (test)"
    state = RunState(keep_whole={"Conv_mask": Refuse(why, undone="whole_model"),
                                 "Resize_dec_up": Refuse(why, undone="whole_model")})
    lifted, _ = PatchRun(src, rewrite_options(max_buffer=300 * KiB), state=state).lift()
    acts = {a.node: a for a in bands_actions(lifted.actions)}
    assert acts["Conv_mask"].action == Outcome.REFUSED and acts["Conv_mask"].details["undone"] == "whole_model"
    assert acts["Conv_mask"].reason.endswith(why)  # the reason says why, for a person
    resize = acts["Resize_dec_up"]
    assert resize.action == Outcome.REFUSED and resize.details["undone"] == "whole_model"
    assert (resize.details["tensor"], resize.details["size_bytes"], resize.details["limit_bytes"]) == \
        ("dec_up", 524_288, 300 * KiB)
    assert acts["Conv_att_conv1"].action == Outcome.REWRITTEN


def test_groups_from_a_slice_when_the_conv_output_is_read_elsewhere(tmp_path):
    """When the Conv before the Resize is also read elsewhere (here: a second graph output), the groups would read
    Slices of its output. Whatever ORT's level-all layout makes of that, what is written is byte-identical."""
    model = decoder_tail()
    model.graph.output.append(helper.make_tensor_value_info("dec_conv_out", TensorProto.FLOAT, [1, 32, 32, 32]))
    src, out = tmp_path / "tail2.onnx", tmp_path / "tail2.patched.onnx"
    onnx.save(model, src)
    report = patch(src, out, max_buffer=300 * KiB)
    act = next(a for a in bands_actions(report.actions) if a.node == "Resize_dec_up")
    # its proof runs the Conv before it too (the NCHWc layout reaches the whole Resize, not the Slices' groups):
    # the groups differ at level 'all', so the Resize is kept whole, with the measured difference
    assert act.action == Outcome.REFUSED and act.details["undone"] == "on_its_own"
    assert act.details["level"] == "all" and 0 < act.details["max_diff"] < 1e-7  # measured: 3e-08
    assert "2 rewrite(s) undone: not shown exact on their own" in report.note  # (and NOT_AT_EVERY_COUNT's bands)
    feeds = feeds_for(model)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))



# ------------------------------------------------------------------- the full BiRefNet's decoder: the nested form
FULL_LIMIT, FULL_MEMORY = 256 * KiB, 2_930_000  # 128 MiB and 1.5 GB scaled as the replica is (tests/helpers/graphs.py)


def test_nested_decoder_form_is_undone_where_a_thread_count_sums_it_otherwise(tmp_path):
    """At this replica's 64x64, the nested bands (below) give the whole chain's bytes at this machine's count but
    not at every count: the image branch's 3x3 Convs sum their bands' last pixels in other K blocks at 5 and 9
    threads (docs/runtime-facts.md, "Threads"). Their proofs, run at one count of each class, say so: the last
    Conv's bands and the image branch's own are undone, named with the count, and the file keeps the original's
    bytes; the Concat stays over the limit."""
    src, out = tmp_path / "full.onnx", tmp_path / "full.patched.onnx"
    onnx.save(decoder_tail_full(), src)
    report = patch(src, out, max_buffer=FULL_LIMIT, max_memory=FULL_MEMORY)
    acts = {a.node: a for a in bands_actions(report.actions)}
    for node in ("Conv_mask", NOT_AT_EVERY_COUNT):
        act = acts[node]
        assert act.action == Outcome.REFUSED and act.details["undone"] == "on_its_own", act.reason
        assert 1 <= act.details["threads"] <= 16 and act.details["max_diff"] > 0
    assert all(acts[n].action == Outcome.REWRITTEN for n in ("Conv_att_conv1", "Resize_dec_up"))
    assert "out_cat" in over(str(out), FULL_LIMIT) and "REMAINS OVER the limit" in report.note
    assert_same_at_both_levels(onnx.load(src), str(out))


@pytest.fixture
def one_thread_count(monkeypatch):
    """The proofs at this machine's thread count only, as before they ran at one count of each class: for the
    rewrites' own structure at a replica size where no bands are exact at every count (the test above)."""
    import os

    from deform_surgeon.proofs import local_proof

    monkeypatch.setattr(local_proof, "thread_counts", lambda kernels, default: (os.cpu_count() or 1,))


def test_nested_decoder_form_fits_and_is_byte_identical(tmp_path, one_thread_count):
    """The full BiRefNet's tail: the last Conv's channel Concat reads a Conv output itself over the limit, made by
    a Conv from another one over the limit. The last Conv is computed in row bands through the whole chain (each
    band makes its rows of the two image-branch Convs, with their halos, and slices the Resize's groups), shown
    exact on its own (at this machine's thread count: `one_thread_count`); nothing is over the limit, the peak
    fits --max-memory, the outputs are byte-identical."""
    src, out = tmp_path / "full.onnx", tmp_path / "full.patched.onnx"
    onnx.save(decoder_tail_full(), src)
    assert sorted(over(str(src), FULL_LIMIT)) == ["att_cat", "dec_conv_out", "dec_up", "ipt_conv1", "ipt_conv_out",
                                                  "out_cat"]
    before = analyze(src).peak_bytes
    assert before > FULL_MEMORY
    report = patch(src, out, max_buffer=FULL_LIMIT, max_memory=FULL_MEMORY)
    acts = {a.node: a for a in bands_actions(report.actions)}
    # the image branch's Convs are computed inside the last Conv's bands: no line of their own
    assert sorted(acts) == ["Conv_att_conv1", "Conv_mask", "Resize_dec_up"]
    assert all(a.action == Outcome.REWRITTEN for a in acts.values())
    assert all(a.details["shown_exact"] == "on_its_own" for a in acts.values())
    mask = acts["Conv_mask"].details
    assert (mask["source"], mask["made_in_rows"]) == ("Concat_out_cat", ["ipt_conv_out", "ipt_conv1"])
    assert mask["band_bytes"] <= FULL_LIMIT
    assert ("from the rows of each input of Concat 'Concat_out_cat' ('ipt_conv_out' (393,216 B, over the limit "
            "too) made by Conv 'Conv_ipt_conv_out' computed for those rows from the rows it reads of 'ipt_conv1' "
            "(524,288 B, over the limit too), made by Conv 'Conv_ipt_conv1' computed for those rows from the rows "
            "of 'img_up' it reads)") in acts["Conv_mask"].reason
    assert report.written and over(str(out), FULL_LIMIT) == []
    assert "within the limit" in report.note
    assert analyze(out).peak_bytes <= FULL_MEMORY < before
    model = onnx.load(src)
    assert_same_at_both_levels(model, str(out))
    again = patch(out, tmp_path / "again.onnx", max_buffer=FULL_LIMIT)
    assert not again.changed and not again.refused


def test_nested_form_with_the_last_conv_kept_whole(tmp_path):
    """When the last Conv's bands are not shown exact (here: the run state's keep_whole, as a failed proof gives it),
    it is refused with the reason, and the image branch's Conv gets row bands of its own, as before the nested form
    was fitted; the Concat stays over the limit and `patch --max-memory` says what holds the peak."""
    from deform_surgeon.commands.patch import PatchRun
    from deform_surgeon.commands.patching.options import rewrite_options
    from deform_surgeon.passes.run_state import RunState

    src = tmp_path / "full.onnx"
    onnx.save(decoder_tail_full(), src)
    why = "not shown exact on its own: (test)"
    options = rewrite_options(max_buffer=FULL_LIMIT, max_memory=FULL_MEMORY)
    state = RunState(keep_whole={"Conv_mask": Refuse(why, undone="on_its_own")})
    lifted, line = PatchRun(src, options, state=state).lift()
    acts = {a.node: a for a in bands_actions(lifted.actions)}
    assert acts["Conv_mask"].action == Outcome.REFUSED and acts["Conv_mask"].details["undone"] == "on_its_own"
    inner = acts["Conv_ipt_conv_out"]
    assert inner.action == Outcome.REWRITTEN and inner.details["source"] == "Conv_ipt_conv1"
    assert inner.details["made_in_rows"] == []
    assert "REMAINS OVER the limit at Concat 'Concat_out_cat'" in line and "(none of it in a deform block)" in line
    assert "largest tensors live there: 'out_cat' 2.0 MB (1.9 MiB) from Concat 'Concat_out_cat'" in line


def test_nested_refusal_names_the_tensor_that_cannot_be_made_in_rows():
    """A Concat input over the limit made by an op that is not computed in rows (here a Relu of a graph input) is
    refused with what makes it."""
    model = _concat_conv([("a", 12), ("b", 2)])
    model.graph.node.insert(0, helper.make_node("Relu", ["a0"], ["a"], name="relu"))
    model.graph.input[0].name = "a0"
    _, actions = patch_in_memory(onnx.shape_inference.infer_shapes(model), max_buffer=10 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and (act.details["source"], act.details["source_bytes"]) == ("a", 12288)
    assert "Concat 'cat' reads 'a' (12,288 B), itself over the limit, made by Relu 'relu', which is not computed " \
        "in rows (a Concat on the channels or the rows, or a Conv, is)" in act.reason

# ---------------------------------------------------------------- the full BiRefNet's backbone: the Swin MLP in rows
MLP_OVER = ["act", "act_add", "act_div", "act_erf", "act_mul", "fc1", "fc1_mm"]  # the [1, 4096, 768] tensors


def test_swin_mlp_fits_in_row_chunks_and_is_byte_identical(tmp_path):
    """The replica of the full BiRefNet's stage-1 Swin MLP against 8 MiB: its seven 12 MiB hidden tensors are made
    in 2 chunks of 2,048 tokens (fc1 -> bias Add -> GELU -> fc2 -> bias Add per chunk, one Concat of fc2's bias Add),
    shown exact on its own before writing; nothing is over afterwards and the outputs are the same bytes."""
    src, out, limit = tmp_path / "mlp.onnx", tmp_path / "mlp.patched.onnx", 8 << 20
    onnx.save(swin_mlp(), src)
    assert sorted(over(str(src), limit)) == MLP_OVER
    report = patch(src, out, max_buffer=limit)
    (act,) = bands_actions(report.actions)
    d = act.details
    assert (act.node, act.op, act.action, act.needs_verify) == ("MatMul_fc1_mm", "MatMul", Outcome.REWRITTEN, False)
    assert (d["shown_exact"], d["levels"]) == ("on_its_own", ["disable", "all"])
    assert (d["chunks"], d["chunk_rows"], d["rows"], d["axis"]) == (2, [2048, 2048], 4096, 1)
    assert (d["tensor"], d["size_bytes"], d["chunk_bytes"], d["limit_bytes"]) == ("fc1_mm", 12 << 20, 6 << 20, limit)
    assert d["chain"] == ["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul", "MatMul", "Add"]
    assert (sorted(d["made_in_rows"]), d["sliced"], d["ends"], d["carried"]) == (MLP_OVER, ["norm2"], ["fc2"], ["Add"])
    assert report.written and over(str(out), limit) == [] and "STAYS OVER" not in (report.note or "")
    model = onnx.load(src)
    assert_same_at_both_levels(model, str(out))
    again = patch(out, tmp_path / "again.onnx", max_buffer=limit)
    assert not again.changed and not again.refused and not (tmp_path / "again.onnx").exists()


def test_swin_mlp_needed_whole_is_refused_and_stays_over(tmp_path):
    """When a hidden tensor is needed whole anyway (here: also a graph output), the chain is refused once, with
    the tensor that is, and the report says what stays over the limit; nothing is written."""
    src, out, limit = tmp_path / "mlp.onnx", tmp_path / "mlp.patched.onnx", 8 << 20
    onnx.save(swin_mlp(also_output=True), src)
    report = patch(src, out, max_buffer=limit)
    (act,) = bands_actions(report.actions)
    assert act.action == Outcome.REFUSED and act.node == "MatMul_fc1_mm"
    assert act.details == {"tensor": "fc1_mm", "size_bytes": 12 << 20, "limit_bytes": limit,
                           "read_elsewhere": "act_erf"}
    assert "'act_erf' is read outside the rewritten part or is a graph output" in act.reason
    assert not report.written and not out.exists() and "STAYS OVER the device profile: 7 tensor(s)" in report.note


def test_swin_mlp_not_shown_exact_is_undone(tmp_path, monkeypatch):
    """A chain whose local proof finds a difference (here: the chunked side made one ulp off) is kept whole, with
    the level and the difference measured, and the rest is written."""
    import importlib

    verify = importlib.import_module("deform_surgeon.base.ort_cpu")
    real, runs = verify.run_ort_cpu, []

    def chunked_side_off(model, feeds, level="all", **kwargs):
        out = real(model, feeds, level, **kwargs)
        if model.graph.name != "local_proof":
            return out
        runs.append(level)
        return [np.nextafter(x, np.float32(np.inf)) for x in out] if len(runs) % 2 == 0 else out

    monkeypatch.setattr(verify, "run_ort_cpu", chunked_side_off)
    src, out = tmp_path / "mlp.onnx", tmp_path / "mlp.patched.onnx"
    onnx.save(swin_mlp(), src)
    report = patch(src, out, max_buffer=8 << 20, copy_unchanged=True)
    (act,) = bands_actions(report.actions)
    assert act.action == Outcome.REFUSED and act.details["undone"] == "on_its_own"
    assert act.details["level"] == "disable" and 0 < act.details["max_diff"] < 1e-3
    assert "not shown exact" in act.reason and "1 rewrite(s) undone" in report.note
    assert report.written and sorted(over(str(out), 8 << 20)) == MLP_OVER


# -------------------------------------------------------------------------------------- refusals, with reasons
def _concat_conv(inputs: list[tuple[str, int]], hw: int = 16, extra_reader: bool = False, stride: int = 1
                 ) -> onnx.ModelProto:
    """Inputs [1, c, hw, hw] -> Concat(axis 1) -> 3x3 Conv (pads 1) -> y (and the Concat also a graph output)."""
    c = sum(ch for _, ch in inputs)
    w = numpy_helper.from_array(np.ones((2, c, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Concat", [n for n, _ in inputs], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[stride, stride])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, [1, c, hw, hw]))
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, ch, hw, hw]) for n, ch in inputs]
    graph = helper.make_graph(nodes, "concat_conv", ins, outs, [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_refused_when_the_input_is_needed_whole_anyway():
    _, actions = patch_in_memory(_concat_conv([("a", 4), ("b", 4)], extra_reader=True), max_buffer=4 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and act.details["read_elsewhere"] == "cat"


def test_refused_when_a_concat_input_is_itself_over_the_limit():
    _, actions = patch_in_memory(_concat_conv([("a", 12), ("b", 2)]), max_buffer=10 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and (act.details["source"], act.details["source_bytes"]) == ("a", 12_288)
    assert act.details["source_bytes"] > act.details["limit_bytes"] == 10 * KiB


# --------------------------------------------------------------------------- the band geometry, for any window
def _conv_chain(cin: int, hw: int, first: tuple, second: tuple, seed: int, *more: tuple) -> onnx.ModelProto:
    """x -> Conv(first) -> h -> Conv(second) [-> h2 -> Conv(more[0]) ...] -> y, integer weights (any summation
    order gives the same bytes, so the comparison checks which values each band reads, not how a kernel rounds)."""
    rng = np.random.default_rng(seed)
    nodes, inits, c = [], [], cin
    windows = (first, second, *more)
    names = ["x", "h", *(f"h{k}" for k in range(2, len(windows))), "y"]
    for k, (kernel, stride, dilation, pad_top, pad_bottom, cout) in enumerate(windows):
        inits.append(numpy_helper.from_array(rng.integers(-2, 3, (cout, c, kernel, kernel)).astype(np.float32),
                                             f"w{k}"))
        nodes.append(helper.make_node("Conv", [names[k], f"w{k}"], [names[k + 1]],
                                      name=f"conv{k}", kernel_shape=[kernel, kernel], strides=[stride, 1],
                                      dilations=[dilation, 1], pads=[pad_top, 1, pad_bottom, 1]))
        c = cout
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


window = st.tuples(st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
                   st.integers(0, 2), st.integers(0, 2), st.integers(2, 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=window, second=window, hw=st.integers(12, 40), fraction=st.sampled_from([2, 3, 5]),
       seed=st.integers(0, 99))
@example(first=(1, 1, 1, 0, 0, 6), second=(3, 1, 2, 0, 0, 5), hw=14, fraction=3, seed=0)  # 10 bands: a join tree
def test_bands_read_exactly_the_rows_the_conv_reads(first, second, hw, fraction, seed):
    model = _conv_chain(3, hw, first, second, seed)
    h = next(vi for vi in model.graph.value_info if vi.name == "h")
    h_shape = [d.dim_value for d in h.type.tensor_type.shape.dim]
    y_rows = (h_shape[2] + second[3] + second[4] - ((second[0] - 1) * second[2] + 1)) // second[1] + 1
    if h_shape[2] < 1 or y_rows < 2:
        return  # the Convs have no room to band
    h_bytes, x_bytes = 4 * int(np.prod(h_shape)), 4 * 3 * hw * 6
    limit = max(x_bytes, h_bytes // fraction)
    if h_bytes <= limit:
        return  # the Conv's input is not over any limit its own input fits
    patched, actions = patch_in_memory(model, max_buffer=limit)
    (act,) = bands_actions(actions)
    feeds = feeds_for(model, seed, integers=True)
    if act.action == Outcome.REFUSED:  # no room to band, or its proof (float data, levels disable and all) differs
        assert act.details.get("band_bytes", 0) > limit or "output_rows" in act.details \
            or act.details.get("undone") == "on_its_own"
        return
    assert act.details["bands"] == len(act.details["band_rows"]) >= 2 and act.details["band_bytes"] <= limit
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))
    # weights, and the joined output (over the limit as before) with the partial joins the fit pass makes of it
    # when there are more bands than a Concat may bind: each holds some of the output's rows
    whole = {t.name for t in model.graph.initializer} | _join_tree(patched, "y")
    assert [t for t in over(patched, limit) if t not in whole] == []


wide = st.tuples(st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
                 st.integers(0, 2), st.integers(0, 2), st.integers(4, 10))  # a window with more channels than x
REFUSALS = ("even one output row per band needs", "nothing but the zero padding",
            "not shown exact: run on its own ")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=wide, second=wide, third=window, hw=st.integers(12, 40), fraction=st.sampled_from([2, 3]),
       seed=st.integers(0, 99))
@example(first=(3, 1, 1, 1, 1, 6), second=(3, 1, 1, 1, 1, 6), third=(1, 1, 1, 0, 0, 2), hw=24, fraction=2, seed=0)
def test_nested_bands_read_exactly_the_rows_the_chain_reads(first, second, third, hw, fraction, seed):
    """x -> Conv -> h -> Conv -> h2 -> Conv -> y with h and h2 over the limit: the last Conv's bands make their
    rows of h2 and of h in turn (each with its kernel's halo, stride and dilation), so neither is made whole."""
    model = _conv_chain(3, hw, first, second, seed, third)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.value_info}
    if any(d < 1 for name in ("h", "h2") for d in shapes[name]) or \
            (shapes["h2"][2] + third[3] + third[4] - ((third[0] - 1) * third[2] + 1)) // third[1] + 1 < 2:
        return  # no room for the chain or for bands
    x_bytes, inner = 4 * 3 * hw * 6, min(4 * int(np.prod(shapes[t])) for t in ("h", "h2"))
    limit = max(x_bytes, inner // fraction)
    if inner <= limit:
        return  # h or h2 is not over any limit x fits
    patched, actions = patch_in_memory(model, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(actions)}
    assert acts and all(a.action == Outcome.REWRITTEN or any(r in a.reason for r in REFUSALS)
                        for a in acts.values()), [a.reason for a in acts.values()]
    if acts.get("conv2") is not None and acts["conv2"].action == Outcome.REWRITTEN:
        assert "'h2' (" in acts["conv2"].reason and "over the limit too" in acts["conv2"].reason
        assert "conv1" not in acts  # computed inside conv2's bands
        whole = {t.name for t in model.graph.initializer} | _join_tree(patched, "y")
        assert [t for t in over(patched, limit) if t not in whole] == []
    feeds = feeds_for(model, seed, integers=True)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))

def _join_tree(model: onnx.ModelProto, name: str) -> set[str]:
    """`name` and the outputs of the Concats that feed it through Concats only."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    tree, todo = set(), [name]
    while todo:
        t = todo.pop()
        tree.add(t)
        node = made_by.get(t)
        if node is not None and node.op_type == "Concat":
            todo += [i for i in node.input if i in made_by and made_by[i].op_type == "Concat"]
    return tree


@pytest.mark.parametrize("stride", [1, 2])
def test_concat_bands_with_halo_and_stride(stride):
    model = _concat_conv([("a", 4), ("b", 3)], hw=20, stride=stride)
    patched, actions = patch_in_memory(model, max_buffer=7 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REWRITTEN, act.reason
    feeds = feeds_for(model, 3, integers=True)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))


# ------------------------------------------------------------------------------------- on the WebGPU runtimes
@pytest.mark.webgpu
@pytest.mark.parametrize("runtime,bundle", [("node", None), ("browser", "webgpu"), ("browser", "jsep")])
def test_the_banded_tail_stays_on_the_gpu_and_matches_ort_cpu(tmp_path, runtime, bundle):
    """The bands and groups are Slice / Concat / Conv / Resize: every node has a kernel on both WebGPU EPs, so
    the patched tail runs with 0 CPU nodes and 0 Memcpy, its output within the GPU's Conv tolerance of ORT CPU."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    assert patch(src, out, max_buffer=300 * KiB).written
    p = measure_placement(out, runtime, bundle, run=True, timeout=300)
    assert p.session_ok and p.cpu_nodes == 0 and p.memcpy == 0, (p.error, p.cpu_ops)
    assert p.run["ok"], p.run["error"]
    assert max(o["max_abs_diff"] for o in p.run["outputs"].values()) < 1e-4


# ------------------------------------------------------- a Concat on the rows (a split deform block's join) as a source
def _joined_branches(hw: int = 16) -> onnx.ModelProto:
    """BiRefNet's ASPP at 2048 in small: one branch of a channel Concat is the join (Concat on the rows) of a split
    deform block's chunks, each under the limit, the branch itself over it; a 3x3 Conv reads the Concat."""
    rng = np.random.default_rng(0)
    half = hw // 2
    w = numpy_helper.from_array(rng.standard_normal((3, 8, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["top"], ["top_r"], name="relu_top"),
             helper.make_node("Relu", ["bottom"], ["bottom_r"], name="relu_bottom"),
             helper.make_node("Concat", ["top_r", "bottom_r"], ["a"], name="join", axis=2),
             helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    ins = [helper.make_tensor_value_info("top", TensorProto.FLOAT, [1, 6, half, 8]),
           helper.make_tensor_value_info("bottom", TensorProto.FLOAT, [1, 6, hw - half, 8]),
           helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 2, hw, 8])]
    graph = helper.make_graph(nodes, "joined", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_bands_slice_the_chunks_a_row_join_holds(tmp_path):
    """The branch over the limit (3,072 B) is never made whole: each band slices the rows it needs (with the 3x3
    halo) from the chunks the join held, joining two chunks' rows where a band spans both."""
    model = _joined_branches()
    assert sorted(over(model, 2 * KiB)) == ["a", "cat"]
    patched, actions = patch_in_memory(model, max_buffer=2 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REWRITTEN and act.details["made_in_rows"] == ["a"]
    assert act.details["source"] == "cat" and act.details["band_bytes"] <= 2 * KiB
    assert "Slices of the 2 inputs of Concat 'join' (on the rows) holding them" in act.reason
    assert over(patched, 2 * KiB) == []
    assert not {"a", "cat"} & {o for n in patched.graph.node for o in n.output}
    assert_same_at_both_levels(model, patched)


def test_refused_when_a_row_join_holds_a_chunk_over_the_limit():
    _, actions = patch_in_memory(_joined_branches(), max_buffer=1 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and (act.details["source"], act.details["source_bytes"]) == ("top_r", 1536)
    assert "Concat 'join' joins rows of 'top_r' (1,536 B), itself over the limit" in act.reason
