"""One pass at a time, on small models written as text: the per-pass layer under the whole-road tests.

Each test parses a model with `onnx.parser.parse_model` (as onnxscript's rewriter tests do), runs one registered
pass on it through the pass registry and the `Context` `patch` gives its passes, and asserts what it did: how many
matches it rewrote or refused, the actions' `details` (docs/report.md), the op counts of the graph after, and, for
a rewrite, the outputs of the model before and after, byte for byte on ORT CPU at levels 'disable' and 'all'.
The byte-identity tests of the whole `patch` road (region lifting, splice, verification) stay the outer layer.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_graphsurgeon as gs
import pytest
from helpers import assert_bytes_equal

from deform_surgeon.base.ort_cpu import run_ort_cpu
from deform_surgeon.files import export_graph, infer_value_types
from deform_surgeon.graph.pipeline import Action, Context, Options, Outcome, run_passes
from deform_surgeon.passes.registry import REGISTRY
from deform_surgeon.passes.run_state import RunState
from deform_surgeon.proofs.local_proof import refusal

LEVELS = ("disable", "all")



def _refusal_one_ulp_off(ran, proof, runs: list[str]):
    """The local proof's answer when the rewritten side (every second ORT run) comes out one ulp up; `runs`
    collects the level of each run."""
    def one_ulp_off(model, feeds, level, threads=None):
        runs.append(level)
        out = run_ort_cpu(model, feeds, level, threads=threads)
        return [np.nextafter(x, np.float32(np.inf)) for x in out] if len(runs) % 2 == 0 else out

    ran.ctx.ort_cpu = one_ulp_off
    return refusal(ran.ctx, proof)

def test_details_are_json_as_given_and_stay_out_of_the_text():
    """Numpy numbers, tuples, arrays and infinite bounds become plain JSON; the text report shows the reason only."""
    from deform_surgeon.commands.report import PatchReport
    from deform_surgeon.graph.pipeline import Refuse

    why = Refuse("a reason", interval=(np.int64(-3), np.float32(np.inf)), sizes=np.array([1, 2]), nan=np.bool_(True))
    action = Action("p", "n", "Op", Outcome.REFUSED, str(why), details=why.details)
    assert action.details == {"interval": [-3, "inf"], "sizes": [1, 2], "nan": True}
    assert json.loads(json.dumps(action.to_dict(), allow_nan=False))["details"] == action.details
    text = PatchReport("m.onnx", actions=[action]).format()
    assert "  refused            Op             n: a reason" in text and "inf" not in text
HEADER = '<ir_version: 8, opset_import: ["" : 17]>\n'


def initializer(dtype: str, name: str, array: np.ndarray) -> str:
    """`array` as an initializer of the text format: `float[2, 3] name = {1, 2, ...}`."""
    dims = ", ".join(str(d) for d in array.shape)
    return f"{dtype}[{dims}] {name} = {{{', '.join(str(v) for v in array.reshape(-1).tolist())}}}"


class Ran:
    """One pass run on one model: its actions, the model before and after, the context it ran in."""

    def __init__(self, name: str, text: str, state: RunState | None = None, **options) -> None:
        self.before = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text), strict_mode=True)
        onnx.checker.check_model(self.before, full_check=True)
        self.state = state if state is not None else RunState()
        (registered,) = [r for r in REGISTRY if r.name == name]
        graph = gs.import_onnx(self.before)
        self.ctx = Context(graph, infer_value_types(self.before), Options(**options))
        self.actions: list[Action] = run_passes(self.ctx, [registered.make(self.state)])
        assert all(a.pass_name == name for a in self.actions)
        graph.cleanup().toposort()
        self.after = export_graph(graph, self.before)
        onnx.checker.check_model(self.after, full_check=True)

    def of(self, outcome: Outcome) -> list[Action]:
        return [a for a in self.actions if a.action == outcome]

    def ops(self, model: onnx.ModelProto | None = None) -> Counter:
        """The op counts of the model after the pass (or of `model`), Constant nodes aside (onnx-graphsurgeon
        writes the constants it imports as initializers)."""
        return Counter(n.op_type for n in (model or self.after).graph.node if n.op_type != "Constant")

    def same_bytes(self, feeds: dict[str, np.ndarray]) -> None:
        """The model after the pass gives the bytes of the model before, at every level."""
        for level in LEVELS:
            assert_bytes_equal(run_ort_cpu(self.before, feeds, level), run_ort_cpu(self.after, feeds, level))


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------------ gathernd
GATHERND = HEADER + """
g (float[1, 5, 4, 3] data, float[1, 6, 2] f) => (float[1, 6, 3] out) {
    fl = Floor(f)
    i = Cast<to = 7>(fl)
    lo = Constant<value_int = 0>()
    hi = Constant<value_int = 3>()
    [bound] k = %s
    [gather] out = GatherND<batch_dims = 1>(data, k)
}
"""


def test_gathernd_rewrites_a_clamped_gather():
    ran = Ran("gathernd", GATHERND % "Clip(i, lo, hi)")
    (done,) = ran.of(Outcome.REWRITTEN)
    assert len(ran.actions) == 1 and done.node == "gather"
    assert ran.ops()["GatherND"] == 0 and ran.ops()["Gather"] == 1 + 2  # a row Gather, one a component
    assert done.details["proof"] == "proven" and done.details["data_rows"] == 1 * 5 * 4
    # both components are clamped to [0, 3] by the one Clip; dim 1 (size 5) and dim 2 (size 4)
    assert [(i["dim"], i["size"], i["interval"], i["status"], i["clamp"]) for i in done.details["indices"]] == [
        (1, 5, [0, 3], "proven", "Clip 'bound'"), (2, 4, [0, 3], "proven", "Clip 'bound'")]
    for seed in range(3):  # any offset, NaN and infinities included, stays in range
        f = _rng(seed).uniform(-20, 20, (1, 6, 2)).astype(np.float32)
        f[0, seed] = [np.nan, np.inf][seed % 2]
        ran.same_bytes({"data": _rng(seed).standard_normal((1, 5, 4, 3)).astype(np.float32), "f": f})


def test_gathernd_refuses_an_unclamped_gather_and_says_where_the_proof_stops():
    ran = Ran("gathernd", GATHERND % "Identity(i)")
    (refused,) = ran.of(Outcome.REFUSED)
    assert len(ran.actions) == 1 and ran.ops() == ran.ops(ran.before)
    assert refused.details["proof"] == "unproven"
    assert all(i["status"] == "unproven" and i["stop"] for i in refused.details["indices"])


# ----------------------------------------------------------------------------------------- gather_elements
GATHER_ELEMENTS = HEADER + """
g (float[1, 2, 3, 8] data, float[1, 2, 1, 5] f) => (float[1, 2, 3, 5] out) {
    fl = Floor(f)
    i = Cast<to = 7>(fl)
    lo = Constant<value_int = 0>()
    hi = Constant<value_int = 7>()
    k = Clip(i, lo, hi)
    shape = Constant<value = int64[4] {1, 2, 3, 5}>()
    per_channel = Expand(k, shape)
    out = GatherElements<axis = 3>(data, per_channel)
}
"""


def test_gather_elements_rewrites_a_per_pixel_index():
    ran = Ran("gather_elements", GATHER_ELEMENTS)
    (done,) = ran.of(Outcome.REWRITTEN)
    assert ran.ops()["GatherElements"] == 0 and ran.ops()["Expand"] == 0 and ran.ops()["Gather"] == 1
    assert done.details["proof"] == "proven" and done.details["data_rows"] == 1 * 2 * 8
    assert done.details["indices"][0]["interval"] == [0, 7]
    for seed in range(2):
        ran.same_bytes({"data": _rng(seed).standard_normal((1, 2, 3, 8)).astype(np.float32),
                        "f": _rng(seed).uniform(-3, 11, (1, 2, 1, 5)).astype(np.float32)})


def test_gather_elements_refuses_an_index_that_differs_across_channels():
    ran = Ran("gather_elements", GATHER_ELEMENTS.replace("Expand(k, shape)", "Tile(k, reps)").replace(
        "shape = Constant<value = int64[4] {1, 2, 3, 5}>()", "reps = Constant<value = int64[4] {1, 1, 3, 1}>()"))
    (refused,) = ran.of(Outcome.REFUSED)
    assert ran.ops() == ran.ops(ran.before) and refused.op == "GatherElements"
    assert refused.reason  # the index is not the same for every channel, it says


# ------------------------------------------------------------------------------------------------ sum_chain
SUM = HEADER + """
g (%s[2, 3] a, %s[2, 3] b, %s[1, 3] c, %s[2, 1] d) => (%s[2, 3] y) {
    y = Sum(a, b, c, d)
}
"""


@pytest.mark.parametrize("dtype, accumulate", [("float", "float32"), ("float16", "float32")])
def test_sum_chain_rewrites_a_sum_into_adds_in_ort_cpus_order(dtype, accumulate):
    ran = Ran("sum_chain", SUM % ((dtype,) * 5))
    (done,) = ran.actions
    assert done.action == Outcome.REWRITTEN and done.details == {"inputs": 4, "mode": "chain",
                                                                  "accumulate": accumulate}
    assert ran.ops()["Sum"] == 0 and ran.ops()["Add"] == 3
    np_type = np.float16 if dtype == "float16" else np.float32
    for seed in range(3):
        rng = _rng(seed)
        ran.same_bytes({k: (rng.standard_normal(s) * 1e3).astype(np_type) for k, s in
                        (("a", (2, 3)), ("b", (2, 3)), ("c", (1, 3)), ("d", (2, 1)))})


def test_sum_chain_refuses_a_sum_of_unknown_element_type():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17, "custom" : 1]>
        g (float[3] a) => (y) { x = custom.Unknown(a)  y = Sum(x, x) }""")
    graph = gs.import_onnx(model)
    (registered,) = [r for r in REGISTRY if r.name == "sum_chain"]
    ctx = Context(graph, infer_value_types(model), Options())
    (refused,) = run_passes(ctx, [registered.make(RunState())])
    assert refused.action == Outcome.REFUSED and refused.details == {}
    assert [n.op for n in graph.nodes] == ["Unknown", "Sum"]


# ------------------------------------------------------------------------------------------------------ fit
def _wide(op: str, n: int = 9) -> str:
    names = [f"x{i}" for i in range(n)]
    inputs = ", ".join(f"float[2] {x}" for x in names)
    attrs = "<axis = 0>" if op == "Concat" else ""
    out = f"float[{2 * n}]" if op == "Concat" else "float[2]"
    return HEADER + f"g ({inputs}) => ({out} y) {{ y = {op}{attrs}({', '.join(names)}) }}"


@pytest.mark.parametrize("op, inputs", [("Concat", 9), ("Max", 9), ("Concat", 20)])
def test_fit_makes_a_tree_of_narrow_nodes(op, inputs):
    ran = Ran("fit", _wide(op, inputs), storage_buffers=8)
    (done,) = ran.actions
    assert done.action == Outcome.REWRITTEN
    assert done.details == {"inputs": inputs, "width": 7, "buffers": inputs + 1, "buffers_limit": 8}
    counts = ran.ops()
    assert counts[op] == len(done.new_nodes) >= 2 and set(counts) == {op}
    assert all(len(n.input) <= 7 for n in ran.after.graph.node)
    feeds = {f"x{i}": _rng(i).standard_normal(2).astype(np.float32) for i in range(inputs)}
    ran.same_bytes(feeds)


def test_fit_refuses_a_wide_mean():
    ran = Ran("fit", _wide("Mean"), storage_buffers=8)
    (refused,) = ran.actions
    assert refused.action == Outcome.REFUSED and refused.op == "Mean"
    assert refused.details == {"buffers": 10, "buffers_limit": 8} and ran.ops() == Counter({"Mean": 1})


# ------------------------------------------------------------------------------------------------ residency
RESIDENCY = HEADER + """
g (float[10, 3] data, float[6] f) => (float[6, 3] out) {
    fl = %s(f)
    [to_i64] i = Cast<to = 7>(fl)
    one = Constant<value_int = 1>()
    j = Add(i, one)
    lo = Constant<value_int = 0>()
    hi = Constant<value_int = 9>()
    k = Clip(j, lo, hi)
    k32 = Cast<to = 6>(k)
    out = Gather<axis = 0>(data, k32)
}
"""


def test_residency_computes_the_index_chain_in_float32():
    ran = Ran("residency", RESIDENCY % "Floor")
    (done,) = ran.actions
    assert done.action == Outcome.REWRITTEN and done.details == {"bound": 2**24}
    assert ran.ops()["Clip"] == 1 and ran.ops()["Where"] == 1  # the unbounded Floor's Clip is NaN-safe
    assert not any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.INT64 for n in ran.after.graph.node)
    for seed in range(3):
        f = _rng(seed).uniform(-40, 40, 6).astype(np.float32)
        f[:3] = [np.nan, 1e15, -1e15]  # (an infinite offset is the one the int64 Cast leaves undefined)
        ran.same_bytes({"data": _rng(seed).standard_normal((10, 3)).astype(np.float32), "f": f})


def test_residency_refuses_a_float_not_proven_integral():
    ran = Ran("residency", RESIDENCY % "Relu")
    (refused,) = ran.actions
    assert refused.action == Outcome.REFUSED and refused.details == {"stop": "Cast 'to_i64'"}
    assert ran.ops() == ran.ops(ran.before)


# ---------------------------------------------------------------------------------------------------- split
def _block(h: int = 4, w: int = 4, channels: int = 2, k: int = 2, rows: int = 20) -> str:
    """A deform block as the gather passes leave it: Gather(rows of flat data, index) -> Transpose -> Reshape ->
    Conv with kernel == stride, so each output row reads its own band of gathered rows."""
    index = _rng(1).integers(0, rows, (h * k, w * k))
    weight = _rng(2).integers(-2, 3, (3, channels, k, k)).astype(np.float32)
    return HEADER + f"""
g (float[{rows}, {channels}] data) => (float[1, 3, {h}, {w}] y) <{initializer("int64", "idx", index)},
                                                             {initializer("float", "weight", weight)}> {{
    sampled = Gather<axis = 0>(data, idx)
    channels_first = Transpose<perm = [2, 0, 1]>(sampled)
    shape = Constant<value = int64[4] {{1, {channels}, {h * k}, {w * k}}}>()
    columns = Reshape(channels_first, shape)
    [conv] y = Conv<kernel_shape = [{k}, {k}], strides = [{k}, {k}]>(columns, weight)
}}
"""


def test_split_cuts_a_block_into_row_chunks():
    ran = Ran("split", _block(), max_buffer=200)  # 512 B tensors, 128 B a row
    (done,) = ran.actions
    assert done.action == Outcome.REWRITTEN and done.needs_verify and done.node == "conv"
    d = done.details
    assert (d["chunks"], d["chunk_rows"], d["rows"], d["gathers"]) == (4, [1, 1, 1, 1], 4, 1)
    assert (d["size_bytes"], d["chunk_bytes"], d["limit_bytes"]) == (512, 128, 200)
    assert d["conv_split"] and not d["over_limit"] and d["conv_input_bytes"] == 512
    assert ran.ops()["Conv"] == 4 and ran.ops()["Gather"] == 4 and ran.state.chunks == {done.node: 4}
    for seed in range(2):  # integer-valued data and weights: any summation order gives the same bytes
        ran.same_bytes({"data": _rng(seed).integers(-8, 8, (20, 2)).astype(np.float32)})


def test_split_refuses_a_limit_below_one_row():
    ran = Ran("split", _block(), max_buffer=100)
    (refused,) = ran.actions
    assert refused.action == Outcome.REFUSED and ran.ops() == ran.ops(ran.before)
    assert {k: refused.details[k] for k in ("row_bytes", "rows", "size_bytes", "limit_bytes")} == {
        "row_bytes": 128, "rows": 4, "size_bytes": 512, "limit_bytes": 100}


# ---------------------------------------------------------------------------------------------------- bands
def _concat_conv(also_output: bool = False) -> str:
    weight = _rng(3).integers(-2, 3, (2, 7, 3, 3)).astype(np.float32)
    extra = ", float[1, 7, 16, 16] cat" if also_output else ""
    return HEADER + f"""
g (float[1, 4, 16, 16] a, float[1, 3, 16, 16] b) => (float[1, 2, 16, 16] y{extra})
  <{initializer("float", "w", weight)}> {{
    [join] cat = Concat<axis = 1>(a, b)
    [conv] y = Conv<kernel_shape = [3, 3], pads = [1, 1, 1, 1]>(cat, w)
}}
"""


def _integers(seed: int) -> dict[str, np.ndarray]:
    rng = _rng(seed)
    return {"a": rng.integers(-8, 8, (1, 4, 16, 16)).astype(np.float32),
            "b": rng.integers(-8, 8, (1, 3, 16, 16)).astype(np.float32)}


def test_bands_compute_a_conv_in_row_bands_and_local_proof_shows_them_exact():
    ran = Ran("bands", _concat_conv(), max_buffer=5 * 1024)  # the Concat is 7,168 B
    (done,) = ran.actions
    d = done.details
    assert done.action == Outcome.REWRITTEN and done.needs_verify
    assert (d["tensor"], d["size_bytes"], d["limit_bytes"], d["rows"], d["source"]) == ("cat", 7168, 5120, 16, "join")
    assert d["bands"] == len(d["band_rows"]) == 2 and sum(d["band_rows"]) == 16 and d["band_bytes"] <= 5120
    assert ran.ops()["Conv"] == 2 and ran.ops()["Concat"] == 3  # a Concat of each band's rows, and the join
    for seed in range(2):
        ran.same_bytes(_integers(seed))
    # the local proof `patch` runs before writing: shown exact (None), or, when a run differs, a refusal that
    # carries the level and the measured difference
    proof = ran.state.proofs[done.node]
    assert refusal(ran.ctx, proof) is None
    runs: list[str] = []
    why = _refusal_one_ulp_off(ran, proof, runs)
    # (whole, rewritten, then the whole side once more: only its digests were held while the other side ran, and
    # a difference is measured on the arrays)
    assert runs == ["disable", "disable", "disable"] and why.details == {
        "level": "disable", "threads": why.details["threads"], "max_diff": pytest.approx(why.details["max_diff"]),
        "neighbours": False} and 0 < why.details["max_diff"] < 1e-3
    assert f"{why.details['threads']} intra-op thread(s)" in str(why)


def test_bands_refuse_an_input_that_is_needed_whole_anyway():
    ran = Ran("bands", _concat_conv(also_output=True), max_buffer=5 * 1024)
    (refused,) = ran.actions
    assert refused.action == Outcome.REFUSED and ran.ops() == ran.ops(ran.before)
    assert refused.details == {"tensor": "cat", "size_bytes": 7168, "limit_bytes": 5120, "read_elsewhere": "cat"}


# ------------------------------------------------------------------------------------------ bands: row chains
def _mlp(reader: str = "", bias: tuple[int, ...] = (4,)) -> str:
    """x [1, 16, 4] -> MatMul -> Relu -> MatMul -> bias Add: the 512 B hidden tensor over a 300 B limit (32 B a
    row), the 256 B input and output under it. `reader`: one more node reading the hidden tensor."""
    w1, w2 = _rng(4).integers(-2, 3, (4, 8)).astype(np.float32), _rng(5).integers(-2, 3, (8, 4)).astype(np.float32)
    b2 = _rng(6).integers(-2, 3, bias).astype(np.float32)
    extra = ", float[1, 8, 16] t" if reader else ""
    return HEADER + f"""
g (float[1, 16, 4] x) => (float[1, 16, 4] y{extra})
  <{initializer("float", "w1", w1)}, {initializer("float", "w2", w2)}, {initializer("float", "b2", b2)}> {{
    [fc1] h = MatMul(x, w1)
    [act] a = Relu(h)
    [fc2] m = MatMul(a, w2)
    [bias] y = Add(m, b2)
    {reader}
}}
"""


def test_bands_compute_a_matmul_chain_in_row_chunks_and_local_proof_shows_them_exact():
    ran = Ran("bands", _mlp(), max_buffer=300)
    (done,) = ran.actions
    d = done.details
    assert done.action == Outcome.REWRITTEN and done.needs_verify and done.node == "fc1"
    assert (d["chunks"], d["chunk_rows"], d["rows"], d["axis"], d["chunk_bytes"]) == (2, [8, 8], 16, 1, 256)
    assert (d["tensor"], d["size_bytes"], d["limit_bytes"], d["made_in_rows"]) == ("h", 512, 300, ["h", "a"])
    assert (d["chain"], d["sliced"], d["ends"], d["carried"]) == (["MatMul", "Relu", "MatMul", "Add"], ["x"], ["y"],
                                                                  ["Add"])
    assert ran.ops() == {"Slice": 2, "MatMul": 4, "Relu": 2, "Add": 2, "Concat": 1}
    for seed in range(2):
        ran.same_bytes({"x": _rng(seed).standard_normal((1, 16, 4)).astype(np.float32)})
    proof = ran.state.proofs[done.node]
    assert refusal(ran.ctx, proof) is None
    why = _refusal_one_ulp_off(ran, proof, [])
    assert why.details["level"] == "disable" and 0 < why.details["max_diff"] < 1e-3


def test_bands_refuse_a_chain_a_transpose_reads():
    """A tensor over the limit read by a node that mixes rows stays whole: refused once, naming that node."""
    ran = Ran("bands", _mlp("[swap] t = Transpose<perm = [0, 2, 1]>(h)"), max_buffer=300)
    (refused,) = ran.actions  # fc2 is part of the same chain: not matched again
    assert refused.action == Outcome.REFUSED and ran.ops() == ran.ops(ran.before)
    assert "Transpose 'swap' is not a MatMul by a constant matrix or an elementwise op" in refused.reason
    assert refused.details == {"tensor": "h", "size_bytes": 512, "limit_bytes": 300, "node": "swap"}


def test_bands_do_not_carry_a_constant_that_varies_along_the_rows():
    """A bias of one value per row and column after the chain's end is not carried per chunk: the chain ends at
    the MatMul, and the Add reads the joined rows."""
    ran = Ran("bands", _mlp(bias=(1, 16, 4)), max_buffer=300)
    (done,) = ran.actions
    assert done.action == Outcome.REWRITTEN and (done.details["ends"], done.details["carried"]) == (["m"], [])
    ran.same_bytes({"x": _rng(0).standard_normal((1, 16, 4)).astype(np.float32)})


# ---------------------------------------------------------------------------------------------- deform_conv
DEFORM = """<ir_version: 9, opset_import: ["" : 19]>
g (%s[1, 2, 5, 6] x, %s[2, 2, 3, 3] w, %s[1, 18, 5, 6] offset) => (%s[1, 2, 5, 6] y) {
    y = DeformConv<kernel_shape = [3, 3], pads = [1, 1, 1, 1]>(x, w, offset)
}
"""


def test_deform_conv_lowers_to_gathers_and_a_matmul():
    ran = Ran("deform_conv", DEFORM % (("float",) * 4))
    (done,) = ran.actions
    d = done.details
    assert done.action == Outcome.REWRITTEN and done.needs_verify and d["proof"] == "proven"
    assert (d["kernel"], d["pads"], d["group"], d["offset_group"], d["mask"], d["bias"]) == (
        [3, 3], [1, 1, 1, 1], 1, 1, False, False)
    assert (d["rows"], d["chunks"], d["chunk_rows"]) == (5, 1, [5])
    assert ran.ops()["DeformConv"] == 0 and ran.ops()["MatMul"] == 1 and ran.ops()["Gather"] >= 4
    for seed, spread in ((0, 0.5), (1, 4.0)):
        rng = _rng(seed)
        offset = rng.uniform(-spread, spread, (1, 18, 5, 6)).astype(np.float32)
        offset[0, 0, 0, :2] = [np.nan, np.inf]
        ran.same_bytes({"x": rng.standard_normal((1, 2, 5, 6)).astype(np.float32),
                        "w": rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "offset": offset})


def test_deform_conv_refuses_float64():
    ran = Ran("deform_conv", DEFORM % (("double",) * 4))
    (refused,) = ran.actions
    assert refused.action == Outcome.REFUSED and refused.details == {"dtype": "float64"}
    assert ran.ops() == Counter({"DeformConv": 1})
