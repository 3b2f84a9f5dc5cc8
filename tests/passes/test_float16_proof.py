"""The float16 proof of a split block that starts at the Conv's input (proofs/float16_proof.py
`cut_at_conv_inputs`): when the chunks' nodes before the Conv count as computing each element as the whole block's
nodes do. Each case is one way the chunks could round or read otherwise, on a two-node chain read from synthetic
graphs of ORT CPU (`Rounding`): a proof must not start at the Conv's input then."""

from __future__ import annotations

import dataclasses

from onnx import helper

from deform_surgeon.proofs import float16_proof
from deform_surgeon.proofs.precision import FLOAT32, TYPED, Rounding


def _chain(chunk_op: str = "Mul", reads: str = "x/rows") -> tuple[dict, dict]:
    """The whole block's `Mul_1` (x * w -> m) and its chunk `Mul_1/chunk0` reading rows of x cut by a Pad."""
    whole = helper.make_node("Mul", ["x", "w"], ["m"], name="Mul_1")
    copy = helper.make_node(chunk_op, [reads, "w"], ["m/chunk0"], name="Mul_1/chunk0")
    cut = helper.make_node("Pad", ["x", "pads"], ["x/rows"], name="x/rows")
    return {whole.name: whole}, {copy.name: copy, cut.name: cut}


def _roundings(**changed) -> callable:
    """ORT's graphs of the model without the split (False) and of the written file (True), at each level: x written
    as typed float16 by a Relu, the Muls run in float32 (ORT's float32 copies), the Pad cut in float32 (no
    float16 kernel), w read as typed; `changed` replaces entries of the written file's `made`."""
    original = Rounding({"m": (FLOAT32, "Mul"), "x": (TYPED, "Relu")}, {("Mul_1", "w"): TYPED})
    patched = Rounding({"m/chunk0": (FLOAT32, "Mul"), "x/rows": (FLOAT32, "Pad"), "x": (TYPED, "Relu"),
                        **changed}, {("Mul_1/chunk0", "w"): TYPED})
    return lambda is_patched, level: patched if is_patched else original


class _NoConstants:
    """The written file's view, for `_integer_constant`: no tensor here is a stored integer."""

    def type(self, name: str):
        return None

    def value(self, name: str):
        return None


def test_chunks_that_compute_and_round_as_the_whole_block_let_the_proof_start_at_the_conv_input():
    drop_b, drop_a = _chain()
    assert float16_proof._alike(drop_b, drop_a, _NoConstants(), _roundings())


def test_a_chunk_written_in_another_form_is_not_alike():
    drop_b, drop_a = _chain()
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(), _roundings(**{"m/chunk0": (TYPED, "Mul")}))


def test_a_cut_that_rounds_what_the_model_holds_unrounded_is_not_alike():
    """x held unrounded (ORT's float32 copy), cut by a node that writes typed float16: the chunk reads rounded
    values where the whole Mul reads the float32 ones."""
    drop_b, drop_a = _chain()
    roundings = _roundings(**{"x": (FLOAT32, "Relu"), "x/rows": (TYPED, "Slice")})
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(), roundings)


def test_a_chunk_node_that_sums_or_reads_another_tensor_is_not_alike():
    drop_b, drop_a = _chain(chunk_op="Sum")  # (a Sum of many inputs: its order is the kernel's)
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(), _roundings())
    drop_b, drop_a = _chain(reads="y")  # not x, nor rows of it
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(), _roundings())


def test_a_chunk_that_reads_its_input_in_another_form_at_level_disable_is_not_alike():
    drop_b, drop_a = _chain()
    original, patched = _roundings()(False, "disable"), _roundings()(True, "disable")
    other = dataclasses.replace(patched, read={("Mul_1/chunk0", "w"): FLOAT32})
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(),
                                    lambda is_patched, level: (other if is_patched else original))


def test_a_node_another_graph_fuses_away_is_not_followed():
    """A Mul ORT drops from the written file's graph only (fused there with others): not alike."""
    drop_b, drop_a = _chain()
    roundings = _roundings()
    patched = roundings(True, "all")
    gone = Rounding({k: v for k, v in patched.made.items() if k != "m/chunk0"}, patched.read)
    assert not float16_proof._alike(drop_b, drop_a, _NoConstants(),
                                    lambda is_patched, level: gone if is_patched and level == "all"
                                    else roundings(is_patched, level))


class _Before:
    """The model without the split, for `_joined_as_made`: X (1, 4, 6, 5) float16, read by `Conv_1`."""

    readers = {"X": [helper.make_node("Conv", ["X", "W"], ["Y"], name="Conv_1")]}

    def type(self, name: str):
        import numpy as np

        return (np.dtype(np.float16), (1, 4, 6, 5)) if name == "X" else None


def _joined(order: tuple[str, ...] = ("X/chunk0", "X/chunk1"), made: tuple = (TYPED, "Concat")) -> bool:
    rows = {"X/chunk0": ("X", 2, 0, 3), "X/chunk1": ("X", 2, 3, 6)}
    join = helper.make_node("Concat", list(order), ["X"], name="Conv_1/split/join", axis=2)
    group = float16_proof.Group([], [join], ["X"])
    original = Rounding({"X": (TYPED, "Reshape"), "Y": (FLOAT32, "Conv")}, {("Conv_1", "X"): FLOAT32})
    patched = Rounding({"X": made, "Y": (FLOAT32, "Conv")}, {("Conv_1", "X"): FLOAT32})
    return float16_proof._joined_as_made(group, rows, _Before(), None,
                                         lambda is_patched, level: patched if is_patched else original)


def test_a_join_of_every_row_in_order_written_as_the_whole_block_is_all_there_is_to_show():
    assert _joined()


def test_a_join_out_of_order_or_in_another_form_is_not():
    assert not _joined(order=("X/chunk1", "X/chunk0"))
    assert not _joined(order=("X/chunk0",))
    assert not _joined(made=(FLOAT32, "Concat"))  # (the chunks joined unrounded where the whole block rounds)
    assert not _joined(made=(TYPED, "com.microsoft.nchwc:Concat"))
