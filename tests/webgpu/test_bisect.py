"""`deform-surgeon bisect`: the first node whose output a WebGPU runtime gets wrong, found on prefixes of the
unmodified graph, and its repro.

Two kinds of tests:

- On a **test-only runtime stub** (`PlantedRuntime`, no GPU): ORT CPU running each model it is given with a
  difference planted at the nodes named to it (their output + 0.5), or failing when the model holds a node named to
  fail. It stands in for a WebGPU runtime so that the search itself (the node named at the start, middle and end of
  a long chain, the number of runs, nothing named for a model that agrees, the repro) is checked in seconds. The
  stub is a stand-in for the search's tests only; the verdicts come from the real comparison code
  (`model_io.compare_outputs`, `model_io.reference_outputs`, verdict.py).
- On the **real runtimes** (`webgpu` marker): the JSEP bug of the exporter's rank-5 GatherND on
  `decoder_gathernd.onnx` in headless Chromium, nothing for its patched form, and a 32-output Split that fails on
  onnxruntime-node's WebGPU EP.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from helpers.graphs import wide_split
from onnx import TensorProto, helper, numpy_helper

import deform_surgeon as ds
from deform_surgeon.commands.cli import main
from deform_surgeon.webgpu.bisect import FAIL, Graph, RunOutcome, bisect_with, outcome_of, sub_model
from deform_surgeon.webgpu.placement import missing_setup
from deform_surgeon.webgpu.placement.runner import compare_outputs, reference_outputs

FIXTURES = Path(__file__).parents[1] / "fixtures"


# ------------------------------------------------------------------------------------------------ the stub


class PlantedRuntime:
    """TEST-ONLY runtime stub (not a WebGPU runtime): runs a model on ORT CPU with every node named in `planted`
    giving its output + 0.5, and fails (no outputs) on a model holding a node named in `failing`. Counts its runs."""

    def __init__(self, planted: set[str] = frozenset(), failing: set[str] = frozenset()) -> None:
        self.planted, self.failing, self.runs = set(planted), set(failing), 0

    def __call__(self, path: Path, feeds: dict[str, np.ndarray]) -> RunOutcome:
        self.runs += 1
        model = onnx.load(str(path))
        onnx.checker.check_model(model)  # as placement's runner does (budget.analyze): every output typed
        names = {n.name for n in model.graph.node}
        if names & self.failing:
            return RunOutcome(FAIL, errors=[f"stub: kernel {sorted(names & self.failing)[0]} failed"])
        nodes = []
        for n in model.graph.node:
            nodes.append(n)
            if n.name in self.planted:
                y = n.output[0]
                n.output[0] = f"{y}__planted"
                nodes.append(helper.make_node("Add", [n.output[0], "__half"], [y], name=f"{n.name}__plant"))
        if names & self.planted:
            del model.graph.node[:]
            model.graph.node.extend(nodes)
            model.graph.initializer.append(numpy_helper.from_array(np.float32(0.5), "__half"))
        planted = path.with_suffix(".planted.onnx")
        onnx.save(model, planted)
        got = reference_outputs(planted, feeds)
        entries = compare_outputs(got, reference_outputs(path, feeds))
        return outcome_of(SimpleNamespace(run={"outputs": entries}, session_ok=True, error=None, model=str(path)))


def chain(n: int) -> onnx.ModelProto:
    """x -> n0 -> n1 -> ...: a long chain of distinct, named nodes (Add 0.25 and Mul -1 alternating, so that a
    difference keeps its size)."""
    nodes, prev = [], "x"
    for i in range(n):
        op = "Add" if i % 2 == 0 else "Mul"
        nodes.append(helper.make_node(op, [prev, "c_add" if op == "Add" else "c_mul"], [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 4, 8, 8])],
                              [numpy_helper.from_array(np.float32(0.25), "c_add"),
                               numpy_helper.from_array(np.float32(-1.0), "c_mul")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def gathernd_chain(n: int, at: int) -> onnx.ModelProto:
    """`chain(n)`'s Adds and Muls on rank-5 data [1, 1, 10, 10, 4], with node `at` the exporter's rank-5 GatherND
    (batch_dims 2, constant int64 indices [1, 1, 64, 2] in range): a node JSEP gets wrong (its shader does not
    compile; onnxruntime issue 32731), in a chain of nodes it gets right."""
    idx = np.random.default_rng(0).integers(0, 10, size=(1, 1, 64, 2)).astype(np.int64)
    nodes, prev = [], "x"
    for i in range(n):
        if i == at:
            nodes.append(helper.make_node("GatherND", [prev, "idx"], [f"t{i}"], name=f"n{i}", batch_dims=2))
        else:
            op = "Add" if i % 2 == 0 else "Mul"
            nodes.append(helper.make_node(op, [prev, "c_add" if op == "Add" else "c_mul"], [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    graph = helper.make_graph(
        nodes, "gathernd_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 10, 10, 4])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 1, 64, 4])],
        [numpy_helper.from_array(idx, "idx"), numpy_helper.from_array(np.float32(0.25), "c_add"),
         numpy_helper.from_array(np.float32(-1.0), "c_mul")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def chain64(tmp_path: Path) -> Path:
    path = tmp_path / "chain64.onnx"
    onnx.save(chain(64), path)
    return path


# ------------------------------------------------------------------------------------------------ stub tests


@pytest.mark.parametrize("at", [0, 31, 63])
def test_a_planted_difference_is_named_at_the_start_middle_and_end(chain64: Path, tmp_path: Path, at: int) -> None:
    stub = PlantedRuntime(planted={f"n{at}"})
    result = bisect_with(chain64, stub, "stub", repro_dir=tmp_path / "repro")
    f = result.finding
    assert f is not None and (f.node, f.op, f.index, f.status) == (f"n{at}", "Add" if at % 2 == 0 else "Mul", at,
                                                                   "differs")
    (out,) = f.outputs.values()
    assert out["kind"] == "differs" and out["max_abs_diff"] == pytest.approx(0.5) and out["tolerance"] == 1e-3
    assert out["max_diff_at"] is not None and len(out["max_diff_at"]) == 4
    # its input agreed in the prefix ending before it (or is the graph input)
    (x, how), (c, const) = f.inputs.items()
    assert const == "constant" and (how.startswith("graph input") if at == 0 else how.startswith("byte-identical"))
    # the whole model, then a binary search over 64 prefix ends: 1 + log2(64) runs; the node alone reproduces
    assert result.search_runs == 1 + math.ceil(math.log2(64))
    assert result.repro is not None and result.repro.reproduces and result.repro.window == (at, at)
    assert result.repro.runs == 1 and stub.runs == result.runs == result.search_runs + 1
    assert f"runs: {result.search_runs}" in result.format()


def test_nothing_is_named_for_a_model_that_agrees(chain64: Path, tmp_path: Path) -> None:
    stub = PlantedRuntime()
    result = bisect_with(chain64, stub, "stub", repro_dir=tmp_path / "repro")
    assert result.finding is None and result.repro is None and result.search_runs == stub.runs == 1
    assert "nothing differs" in result.format() and not (tmp_path / "repro").exists()


class Interrupted(Exception):
    pass


def test_an_interrupted_search_goes_on_from_its_replay_file(chain64: Path, tmp_path: Path) -> None:
    """Each run's verdict is in the replay file as it comes; a search stopped after 4 of its 7 runs (the whole
    model, prefix ends 31, 47, 39) goes on from them: the same node, with the whole model run again (always: a
    recorded verdict of it would end or start the search unchecked) and the 3 runs left (35, 37, 36). Run again
    from the finished file, it runs the whole model and the two prefixes the finding reads (their tensors'
    verdicts are not kept)."""
    replay = tmp_path / "search.json"
    first = PlantedRuntime(planted={"n37"})

    def stopping(path: Path, feeds: dict) -> RunOutcome:
        if first.runs == 4:
            raise Interrupted
        return first(path, feeds)

    with pytest.raises(Interrupted):
        bisect_with(chain64, stopping, "stub", replay=replay)
    recorded = json.loads(replay.read_text())
    assert len(recorded["steps"]) == 4 and recorded["search"]["nodes"] == 64
    again = PlantedRuntime(planted={"n37"})
    result = bisect_with(chain64, again, "stub", replay=replay)
    assert result.finding.node == "n37" and result.finding.inputs["t36"].startswith("byte-identical")
    assert again.runs == result.search_runs == 1 + 7 - 4
    assert any("4 verdict(s) from" in n and "contradicted" not in n for n in result.notes)
    text = result.format()
    assert "runs: 4 on stub (1 whole model + 3 prefixes" in text
    assert len(json.loads(replay.read_text())["steps"]) == 7  # every prefix end the search ran, once
    # a finished search run again from its file: the whole model and the two prefixes the finding reads
    third = PlantedRuntime(planted={"n37"})
    assert bisect_with(chain64, third, "stub", replay=replay).finding.node == "n37" and third.runs == 3


def test_a_replay_file_the_runs_contradict_is_not_believed(chain64: Path, tmp_path: Path) -> None:
    """A replay file whose verdicts this run contradicts (every run timed out and was recorded `fails`; a file
    saying the whole model agrees; a hand-edited one naming a node that differs where it does not) must not name a
    wrong node or "nothing differs": the whole model is always run, and where a run contradicts the file the search
    goes on from what this run measured, and says so."""
    replay = tmp_path / "search.json"
    bisect_with(chain64, PlantedRuntime(planted={"n37"}), "stub", replay=replay)
    data = json.loads(replay.read_text())
    for lie in ("fails", "agrees"):  # every verdict, the whole model's included
        data["steps"] = [{"prefix_end": k, "status": lie} for k in range(64)]
        replay.write_text(json.dumps(data))
        runtime = PlantedRuntime(planted={"n37"})
        result = bisect_with(chain64, runtime, "stub", replay=replay)
        assert result.finding is not None and result.finding.node == "n37", lie
        assert any("this run contradicted them" in n for n in result.notes), result.notes
    data["steps"] = [{"prefix_end": 4, "status": "agrees"}, {"prefix_end": 5, "status": "differs"}]
    replay.write_text(json.dumps(data))  # "n5 differs": hand-edited
    result = bisect_with(chain64, PlantedRuntime(planted={"n37"}), "stub", replay=replay)
    assert result.finding.node == "n37" and result.finding.outputs["t37"]["kind"] == "differs"


def test_a_replay_file_of_another_model_or_timeout_is_refused(chain64: Path, tmp_path: Path) -> None:
    """A file of another model with the same size, node count and first/last node names was accepted; the replay
    is now identified by the model's content, and by the time limit (a run that timed out is recorded `fails`)."""
    replay = tmp_path / "search.json"
    bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay, timeout=0.05)
    with pytest.raises(ds.SurgeonError, match=r"records another search: timeout 0.05 \(now 600"):
        bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay, timeout=600.0)
    other = tmp_path / "other.onnx"
    model = onnx.load(str(chain64))
    w = next(t for t in model.graph.initializer if t.raw_data)
    w.raw_data = bytes(len(w.raw_data))  # same size, same nodes, other weights
    onnx.save(model, other)
    assert other.stat().st_size == chain64.stat().st_size
    with pytest.raises(ds.SurgeonError, match="records another search: model_sha256"):
        bisect_with(other, PlantedRuntime(planted={"n5"}), "stub", replay=replay, timeout=0.05)


@pytest.mark.parametrize("text", ['{"search": {}, "steps": [{"prefix_end": Infinity, "status": "agrees"}]}',
                                  "[" * 5000 + "]" * 5000], ids=["infinity", "deep"])
def test_a_replay_file_with_an_infinite_step_or_deep_nesting_is_one_line(chain64: Path, tmp_path: Path,
                                                                        text: str) -> None:
    """An infinite step or deep nesting is refused in one line naming the file, not an OverflowError or
    RecursionError traceback (the file of an empty search is another search)."""
    replay = tmp_path / "search.json"
    replay.write_text(text)
    with pytest.raises(ds.SurgeonError, match="is not a bisect replay file|records another search: model") as info:
        bisect_with(chain64, PlantedRuntime(), "stub", replay=replay)
    assert info.value.path == str(replay) and "\n" not in str(info.value)


def test_a_replay_file_of_another_search_is_refused(chain64: Path, tmp_path: Path) -> None:
    replay = tmp_path / "search.json"
    bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay)
    with pytest.raises(ds.SurgeonError, match=r"records another search: inputs_sha256"):
        bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay, seed=1)
    with pytest.raises(ds.SurgeonError, match="records another search: runtime 'stub' \\(now 'other'\\)"):
        bisect_with(chain64, PlantedRuntime(planted={"n5"}), "other", replay=replay)
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    with pytest.raises(ds.SurgeonError, match="is not a bisect replay file"):
        bisect_with(chain64, PlantedRuntime(), "stub", replay=junk)


def test_a_failure_is_bisected_to_the_failing_node_with_its_error(chain64: Path, tmp_path: Path) -> None:
    stub = PlantedRuntime(failing={"n40"})
    result = bisect_with(chain64, stub, "stub", repro_dir=tmp_path / "repro")
    f = result.finding
    assert (f.node, f.status) == ("n40", "fails") and f.errors == ["stub: kernel n40 failed"]
    assert f.inputs["t39"].startswith("byte-identical")
    assert result.repro.reproduces and result.repro.status == "fails" and result.repro.window == (40, 40)
    text = result.format()  # the error once, beside the node
    assert text.count("stub: kernel n40 failed") == 1 and "fails on its own with the same error" in text


def test_the_repro_is_the_node_alone_with_cpu_inputs(chain64: Path, tmp_path: Path) -> None:
    result = bisect_with(chain64, PlantedRuntime(planted={"n31"}), "stub", repro_dir=tmp_path / "repro")
    repro = onnx.load(result.repro.model)
    assert [n.name for n in repro.graph.node] == ["n31"] and [i.name for i in repro.graph.input] == ["t30"]
    assert [o.name for o in repro.graph.output] == ["t31"] and [t.name for t in repro.graph.initializer] == ["c_mul"]
    onnx.checker.check_model(repro, full_check=True)
    inputs = dict(np.load(result.repro.inputs))
    # t30 as ORT CPU computes it in the original model
    x = ds.webgpu.bisect.load_inputs(None, 0, onnx.load(str(chain64)), chain64)[0]
    g = Graph.of(onnx.load(str(chain64)), chain64)
    expected = reference_outputs(_saved(sub_model(g, range(31), ["t30"]), tmp_path / "p.onnx"), x)["t30"]
    assert inputs["t30"].tobytes() == expected.tobytes()
    data = Path(result.repro.directory) / "test_data_set_0"
    assert sorted(p.name for p in data.iterdir()) == ["input_0.pb", "output_0.pb"]
    assert numpy_helper.to_array(onnx.load_tensor(str(data / "input_0.pb"))).tobytes() == expected.tobytes()


def test_the_repro_widens_when_the_node_alone_does_not_go_wrong(chain64: Path, tmp_path: Path) -> None:
    """A stub that goes wrong only when n20 runs after n17 (as a fusion would): the repro of n20 widens to n17..n20."""

    class NeedsContext(PlantedRuntime):
        def __call__(self, path: Path, feeds: dict[str, np.ndarray]) -> RunOutcome:
            names = {n.name for n in onnx.load(str(path)).graph.node}
            self.planted = {"n20"} if {"n17", "n20"} <= names else set()
            return super().__call__(path, feeds)

    stub = NeedsContext()
    result = bisect_with(chain64, stub, "stub", repro_dir=tmp_path / "repro")
    assert result.finding.node == "n20"
    r = result.repro
    assert r.reproduces and r.window == (17, 20) and "alone does not" in r.detail
    assert [n.name for n in onnx.load(r.model).graph.node] == ["n17", "n18", "n19", "n20"]
    assert r.runs == 4  # widths 1, 2, 4 (reproduces), then 3 between 2 and 4


def test_inputs_from_a_file_and_bad_input_are_one_line(chain64: Path, tmp_path: Path, capsys) -> None:
    feeds = tmp_path / "in.npz"
    np.savez(feeds, x=np.full((1, 4, 8, 8), 2.0, np.float32))
    result = bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", inputs=feeds)
    assert result.finding.node == "n5" and result.repro is None
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, y=np.zeros(3, np.float32))
    with pytest.raises(ds.SurgeonError, match=r"wrong.npz: misses x; names no input y"):
        bisect_with(chain64, PlantedRuntime(), "stub", inputs=wrong)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ds.SurgeonError, match="exists and is not an empty folder"):
        bisect_with(chain64, PlantedRuntime(), "stub", repro_dir=tmp_path / "full")
    not_onnx = tmp_path / "not.onnx"
    not_onnx.write_text("hello")
    assert main(["bisect", str(not_onnx), "--no-repro"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not.onnx" in err[0]


@pytest.mark.parametrize("case", ["empty", "not_a_zip", "huge_header", "fifo", "dtype", "shape"])
def test_bad_inputs_files_are_one_line(chain64: Path, tmp_path: Path, case: str) -> None:
    """An empty .npz (else EOFError), a header claiming 37 GiB (else MemoryError), a FIFO (else a hang), an array of
    the wrong dtype or shape (else "ORT CPU fails on this model"): each is one line naming the file."""
    import os
    import zipfile

    path = tmp_path / "in.npz"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "not_a_zip":
        path.write_bytes(b"PK\x03\x04 not really")
    elif case == "huge_header":
        header = {"descr": "<f4", "fortran_order": False, "shape": (10_000_000_000,)}
        with zipfile.ZipFile(path, "w") as z, z.open("x.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, header)
    elif case == "fifo":
        os.mkfifo(path)
    else:
        bad = np.zeros((1, 4, 8, 8), np.float64) if case == "dtype" else np.zeros((1, 4, 8, 9), np.float32)
        np.savez(path, x=bad)
    expected = {"empty": "cannot be read as a .npz", "not_a_zip": "cannot be read as a .npz",
                "huge_header": "its arrays would take 40,000,000,000 bytes", "fifo": "is not a regular file",
                "dtype": "input x: the file gives float64, the model takes float32 [1, 4, 8, 8]",
                "shape": "input x: the file gives shape [1, 4, 8, 9]"}[case]
    with pytest.raises(ds.SurgeonError, match=re.escape(expected)) as info:
        bisect_with(chain64, PlantedRuntime(), "stub", inputs=path)
    assert info.value.path == str(path) and "\n" not in str(info.value)


def test_a_model_with_duplicate_node_names_is_one_line(chain64: Path, tmp_path: Path) -> None:
    """onnx.checker passes such a model and ORT refuses it: bisect says so in one line naming the file, not in a
    traceback in the repro window."""
    model = onnx.load(str(chain64))
    model.graph.node[3].name = model.graph.node[2].name
    path = tmp_path / "twice.onnx"
    onnx.save(model, path)
    onnx.checker.check_model(model)
    with pytest.raises(ds.SurgeonError, match=r"names 1 node name\(s\) more than once \(n2\), which onnxruntime "
                                              "refuses") as info:
        bisect_with(path, PlantedRuntime(), "stub")
    assert info.value.path == str(path)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1, "5", True])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(timeout) -> None:
    with pytest.raises(ds.SurgeonError, match="timeout must be a positive number of seconds"):
        ds.bisect("model.onnx", timeout=timeout)


def test_bisect_is_a_command_and_an_api_name() -> None:
    from deform_surgeon.commands.cli import TOOLS

    assert TOOLS["bisect"] == "deform_surgeon.webgpu.bisect.command:BisectTool"
    assert ds.bisect.__name__ == "bisect" and "bisect" in ds.__all__


def _saved(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


# ------------------------------------------------------------------------------------------------ real runtimes

_SETUP = missing_setup()
_BROWSER = missing_setup("browser")


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_a_split_over_the_storage_buffers_fails_and_is_named(tmp_path: Path) -> None:
    """onnxruntime-node's WebGPU EP (12 storage buffers on SwiftShader) fails the 32-output Split: bisect names it,
    with the runtime's error, among nodes that run."""
    model = wide_split(n=32)
    split = model.graph.node[0]
    pre = helper.make_node("Relu", ["x"], ["x_relu"], name="pre_relu")
    split.input[0] = "x_relu"
    del model.graph.node[:]
    model.graph.node.extend([pre, split])
    path = tmp_path / "split32.onnx"
    onnx.save(model, path)
    result = ds.bisect(path, runtime="node", repro_dir=tmp_path / "repro")
    f = result.finding
    assert (f.node, f.op, f.status) == ("wide_split", "Split", "fails"), result.format()
    assert any("storage buffers" in e for e in f.errors), f.errors
    assert f.inputs["x_relu"].startswith(("byte-identical", "agrees"))
    assert result.search_runs == 2 and result.repro.reproduces and result.repro.window == (1, 1)


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_placement_run_suggests_bisect_when_the_run_fails(tmp_path: Path, capsys) -> None:
    path = tmp_path / "split32.onnx"
    onnx.save(wide_split(n=32), path)
    assert main(["placement", str(path), "--run", "--seed", "4"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"find where it goes wrong: deform-surgeon bisect {path} --runtime node --seed 4" in lines


@pytest.mark.webgpu
@pytest.mark.skipif(_BROWSER is not None, reason=f"browser runtime not set up: {_BROWSER}")
def test_the_jsep_gathernd_bug_is_found_and_its_repro_differs(tmp_path: Path) -> None:
    """The exporter's rank-5 GatherND on JSEP (onnxruntime issue 32731) in headless Chromium: the run returns with a
    wrong mask; bisect names the first GatherND, its inputs agreeing, and its repro differs on its own. The patched
    file: nothing differs."""
    out = tmp_path / "bisect.json"
    code = main(["bisect", str(FIXTURES / "decoder_gathernd.onnx"), "--runtime", "browser", "--bundle", "jsep",
                 "--repro", str(tmp_path / "repro"), "--json", str(out)])
    doc = json.loads(out.read_text())
    f = doc["finding"]
    assert code == 1 and f["op"] == "GatherND" and f["status"] == "differs", doc
    (own,) = f["outputs"].values()
    assert own["kind"] == "differs" and own["max_diff_at"] is not None
    assert all(how == "constant" or how.startswith(("byte-identical", "agrees")) for how in f["inputs"].values())
    assert any("WGSL" in e for e in f["errors"])
    g = Graph.of(onnx.load(str(FIXTURES / "decoder_gathernd.onnx")), "fixture")
    first = next(i for i, n in enumerate(g.nodes) if n.op_type == "GatherND")
    assert f["index"] == first
    assert doc["search_runs"] <= 2 + math.ceil(math.log2(len(g.nodes)))
    repro = doc["repro"]
    assert repro["reproduces"] and repro["window"] == [first, first] and "differs on its own" in repro["detail"]
    assert [n.op_type for n in onnx.load(repro["model"]).graph.node] == ["GatherND"]

    patched = tmp_path / "patched.onnx"
    assert ds.patch(FIXTURES / "decoder_gathernd.onnx", patched).written
    result = ds.bisect(patched, runtime="browser", bundle="jsep", repro_dir=tmp_path / "repro2")
    assert result.finding is None and result.search_runs == 1 and "nothing differs" in result.format()


def test_the_suggested_command_has_the_runs_arguments() -> None:
    from deform_surgeon.checks.verdict import bisect_hint

    assert bisect_hint("a b.onnx", "browser", "jsep", seed=3) == \
        "deform-surgeon bisect 'a b.onnx' --runtime browser --bundle jsep --seed 3"
    assert bisect_hint("m.onnx", "node", "webgpu", seed=0, device_profile="limits.json") == \
        "deform-surgeon bisect m.onnx --runtime node --device-profile limits.json --seed 0"
    assert bisect_hint("m.onnx", "browser", "webgpu", inputs="in.npz", device_profile="spec-default") == \
        "deform-surgeon bisect m.onnx --runtime browser --bundle webgpu --inputs in.npz"


def test_a_marked_outputs_run_confirmed_on_the_prefixes_takes_four_runs(chain64: Path) -> None:
    stub = PlantedRuntime(planted={"n45"})
    result = bisect_with(chain64, stub, "stub", marked=True)
    assert result.finding.node == "n45" and result.search_runs == stub.runs == 4 and not result.notes
    assert [s.get("prefix_end", "marked") for s in result.steps] == [63, "marked", 44, 45]
    assert "1 with every tensor marked + 2 prefixes" in result.format()


def test_a_difference_only_the_marked_run_shows_is_not_named(chain64: Path) -> None:
    """A stub that also goes wrong at n10 when every tensor is an output (as a runtime computing another program
    would): the prefixes refute n10 and the search goes on to n45."""

    class MarkingMatters(PlantedRuntime):
        def __call__(self, path: Path, feeds: dict[str, np.ndarray]) -> RunOutcome:
            marked = len(onnx.load(str(path)).graph.output) > 8
            self.planted = {"n45", "n10"} if marked else {"n45"}
            return super().__call__(path, feeds)

    stub = MarkingMatters()
    result = bisect_with(chain64, stub, "stub", marked=True)
    assert result.finding.node == "n45" and result.steps[1]["candidate"] == "n10"
    assert "do not confirm it" in result.notes[0]
    assert result.search_runs == stub.runs <= 4 + math.ceil(math.log2(64))


def test_input_shapes_fix_a_symbolic_input_before_the_search(tmp_path: Path) -> None:
    model = chain(16)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    path = tmp_path / "dynamic.onnx"
    onnx.save(model, path)
    result = bisect_with(path, PlantedRuntime(planted={"n7"}), "stub", input_shapes={"x": (1, 4, 5, 8)})
    assert result.finding.node == "n7" and result.finding.outputs["t7"]["max_diff_at"][2] < 5
    with pytest.raises(ds.SurgeonError, match="'y', which is not an input"):
        bisect_with(path, PlantedRuntime(), "stub", input_shapes={"y": (1,)})


@pytest.mark.webgpu
@pytest.mark.skipif(_SETUP is not None, reason=f"WebGPU runtimes not set up: {_SETUP}")
def test_a_float16_model_without_shader_f16_fails_at_its_first_gpu_node(tmp_path: Path) -> None:
    """SwiftShader has no `shader-f16`: onnxruntime-node's WebGPU EP fails the fp16 fixture's session at its first
    Conv (the weights' Transpose program needs f16), and bisect names it with the session's own error."""
    result = ds.bisect(FIXTURES / "decoder_gathernd_fp16.onnx", runtime="node", repro_dir=tmp_path / "repro")
    if result.finding is None:
        pytest.skip("this machine's adapter offers shader-f16: the fp16 model runs")
    f = result.finding
    assert (f.index, f.op, f.status) == (0, "Conv", "fails") and any("requires f16" in e for e in f.errors), f.errors
    assert result.search_runs <= 1 + math.ceil(math.log2(result.nodes)) and result.repro.reproduces


@pytest.mark.webgpu
@pytest.mark.skipif(_BROWSER is not None, reason=f"browser runtime not set up: {_BROWSER}")
@pytest.mark.parametrize("at", [0, 16, 31])
def test_a_real_difference_is_named_at_the_start_middle_and_end(tmp_path: Path, at: int) -> None:
    """A rank-5 GatherND at the start, middle and end of a 32-node chain, on JSEP in headless Chromium (not a stub):
    named, with 1 + log2(32) runs and a 1-run repro."""
    path = tmp_path / "chain.onnx"
    onnx.save(gathernd_chain(32, at), path)
    result = ds.bisect(path, runtime="browser", bundle="jsep", repro_dir=tmp_path / "repro")
    f = result.finding
    assert f is not None and (f.node, f.op, f.status) == (f"n{at}", "GatherND", "differs"), result.format()
    assert f.outputs[f"t{at}"]["kind"] == "differs" and any("WGSL" in e for e in f.errors)
    assert all(how == "constant" or how.startswith(("byte-identical", "graph input")) for how in f.inputs.values())
    assert result.search_runs == 1 + 5 and result.repro.runs == 1 and result.repro.reproduces


def test_a_tensor_shape_inference_cannot_type_is_typed_from_ort_cpu(tmp_path: Path) -> None:
    """com.microsoft's Gelu has no ONNX shape inference: its output, exposed in the prefixes, is typed by ORT CPU's
    array, so that onnx.checker (which placement's runner applies) passes every prefix."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Gelu", ["a"], ["b"], name="gelu", domain="com.microsoft"),
             helper.make_node("Neg", ["b"], ["c"], name="neg"), helper.make_node("Neg", ["c"], ["d"], name="neg2")]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft",
                                                                                                     1)])
    model.ir_version = 8
    path = tmp_path / "gelu.onnx"
    onnx.save(model, path)
    assert "b" not in Graph.of(onnx.load(str(path)), path).types
    result = bisect_with(path, PlantedRuntime(planted={"neg"}), "stub", repro_dir=tmp_path / "repro")
    assert result.finding.node == "neg" and result.finding.inputs["b"].startswith("byte-identical")
    assert onnx.load(result.repro.model).graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT


@pytest.mark.parametrize("step", [-1, 100_000, 9.5, True, "9", None])
def test_a_replay_file_with_an_impossible_step_is_one_line(chain64: Path, tmp_path: Path, step) -> None:
    """Steps of -1, past the model, 9.5, true or "9" (a string not read as its number) are not taken: a step is a
    whole number of nodes of this model, or the file is refused in one line."""
    import json

    replay = tmp_path / "search.json"
    bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay)
    data = json.loads(replay.read_text())
    data["steps"][0]["prefix_end"] = step
    replay.write_text(json.dumps(data))
    with pytest.raises(ds.SurgeonError, match="is not a bisect replay file") as info:
        bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay)
    assert info.value.path == str(replay) and "\n" not in str(info.value)


def test_a_replay_file_with_a_key_this_search_has_not_names_it(chain64: Path, tmp_path: Path) -> None:
    """An extra key in `search` is named in the refusal ("records another search: extra 1"), not left as
    "records another search: " with nothing after it."""
    import json

    replay = tmp_path / "search.json"
    bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay)
    data = json.loads(replay.read_text())
    data["search"]["extra"] = 1
    replay.write_text(json.dumps(data))
    with pytest.raises(ds.SurgeonError, match=r"records another search: extra 1 \(not part of this search\)"):
        bisect_with(chain64, PlantedRuntime(planted={"n5"}), "stub", replay=replay)
