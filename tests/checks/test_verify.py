"""`deform_surgeon.checks.verify`: zero tolerance on ORT CPU, decided by an exact byte comparison.

The tiny models here pin down what the byte comparison catches that polygraphy's own `atol=0, rtol=0` verdict
gets wrong (identical NaNs fail it, -0.0 vs +0.0 passes it), which is why `verify` does not simply trust it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import graphs
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import SurgeonError, verify

FIXTURES = Path(__file__).parents[1] / "fixtures"
ONE = np.float32(1.0)
ONE_PLUS_ULP = np.nextafter(ONE, np.float32(2))


def save(folder: Path, name: str, nodes: list, outputs: list, inits: tuple = ()) -> Path:
    """A one-input model, `x` float32 [2, 3], saved as folder/name.onnx."""
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="test_verify")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path = folder / f"{name}.onnx"
    onnx.save(model, path)
    return path


def out(name: str = "y", elem: int = TensorProto.FLOAT, shape: tuple = (2, 3)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def ort_run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def times(folder: Path, name: str, k) -> Path:
    """y = x * k (k a scalar constant)."""
    return save(folder, name, [helper.make_node("Mul", ["x", "k"], ["y"])], [out()], (const("k", k),))


def constant_output(folder: Path, name: str, c: np.ndarray) -> Path:
    """y = x * 0 + c, which is exactly c for the inputs in [0, 1) (depends on x so nothing is folded)."""
    nodes = [helper.make_node("Mul", ["x", "zero"], ["t"]), helper.make_node("Add", ["t", "c"], ["y"])]
    return save(folder, name, nodes, [out()], (const("zero", 0.0), const("c", c)))


def test_identical_models_pass(tmp_path):
    a = times(tmp_path, "a", 3.0)
    b = tmp_path / "b.onnx"
    shutil.copyfile(a, b)
    result = verify(a, b)
    assert result.identical and result.mismatch is None
    assert result.outputs_compared == ["y"] and result.max_abs_diff == {"y": 0.0}
    assert result.polygraphy_passed
    assert result.summary().startswith("verify: PASSED: 1 output(s) byte-identical (max |diff| 0) on 3 seeded")


def test_exporter_fixture_and_its_patch_pass(tmp_path):
    from deform_surgeon import patch

    patched = tmp_path / "p.onnx"
    patch(FIXTURES / "gathernd_b2g2.onnx", patched)
    assert verify(FIXTURES / "gathernd_b2g2.onnx", patched).identical


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_sets_the_sessions_intra_op_threads(tmp_path, threads, monkeypatch):
    """batch gives each worker its share of the cores; the sessions verify builds must get it. (Each session is
    made in its own forked process: the spy writes down what it saw in a file.)"""
    import onnxruntime

    made = tmp_path / "made.txt"
    real = onnxruntime.InferenceSession

    def spy(path, options=None, **kwargs):
        with open(made, "a") as f:
            f.write(f"{options.intra_op_num_threads}\n")
        return real(path, options, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", spy)
    c = np.full((2, 3), ONE, np.float32)
    a = constant_output(tmp_path, "a", c)
    assert verify(a, a, threads=threads).identical
    assert made.read_text().split() == [str(threads), str(threads)]


def test_the_models_run_one_after_the_other_each_in_its_own_process(tmp_path, monkeypatch):
    """The original's session and outputs are gone before the patched model's session is made, so the
    peak is the larger model's, not the sum. Each run is a forked process (where the machine can fork) reaped before
    the next starts; the result reports each run's peak RSS and the caller's."""
    import onnxruntime

    from deform_surgeon.base.background import _can_fork

    made = tmp_path / "made.txt"
    real = onnxruntime.InferenceSession

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def spy(path, options=None, **kwargs):
        earlier = [int(line.split()[0]) for line in made.read_text().splitlines()] if made.exists() else []
        with open(made, "a") as f:  # this session's process, and whether the earlier run's still exists
            f.write(f"{os.getpid()} {int(any(alive(p) for p in earlier if p != os.getpid()))}\n")
        return real(path, options, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", spy)
    a = constant_output(tmp_path, "a", np.full((2, 3), ONE, np.float32))
    result = verify(a, a, iterations=2)
    assert result.identical and set(result.peak_rss) == {"original", "patched", "caller"}
    assert all(v > 0 for v in result.peak_rss.values())
    assert "; peak RSS " in result.summary() and result.to_dict()["peak_rss"] == result.peak_rss
    (first, _), (second, earlier_alive) = (map(int, line.split()) for line in made.read_text().splitlines())
    if _can_fork():
        assert os.getpid() not in (first, second) and first != second
        assert earlier_alive == 0  # the original's process had ended (and been reaped) before the patched one ran


def test_a_run_the_system_kills_is_named_and_not_run_again_here(tmp_path, monkeypatch):
    """A model's run whose process is killed (the OOM killer's SIGKILL, here sent by the run to itself) is one
    line naming that model, and is not run again in the caller, where it would take the caller's memory too."""
    import importlib
    import signal

    from deform_surgeon.base.background import _can_fork

    verify_module = importlib.import_module("deform_surgeon.checks.verify_runs")  # (the runs: where `_run_one` is)

    if not _can_fork():
        pytest.skip("the runs are made in the caller here: nothing to kill")
    caller = os.getpid()
    real = verify_module._run_one

    def killed(name, *args):
        if name == "patched" and os.getpid() != caller:
            os.kill(os.getpid(), signal.SIGKILL)
        assert os.getpid() != caller, "run again in the caller"
        return real(name, *args)

    monkeypatch.setattr(verify_module, "_run_one", killed)
    a = constant_output(tmp_path, "a", np.full((2, 3), ONE, np.float32))
    b = constant_output(tmp_path, "b", np.full((2, 3), ONE, np.float32))
    with pytest.raises(SurgeonError) as exc:
        verify(a, b)
    assert exc.value.path == str(b) and "killed by signal 9" in exc.value.problem, exc.value.one_line()


def test_one_ulp_fails_and_is_located(tmp_path):
    c = np.full((2, 3), ONE, np.float32)
    c_ulp = c.copy()
    c_ulp[1, 2] = ONE_PLUS_ULP
    assert int(c_ulp.view(np.uint32)[1, 2]) - int(c.view(np.uint32)[1, 2]) == 1
    a, b = constant_output(tmp_path, "a", c), constant_output(tmp_path, "b", c_ulp)
    x = np.random.default_rng(0).random((2, 3), dtype=np.float32)
    assert ort_run(a, x).tobytes() == c.tobytes() and ort_run(b, x).tobytes() == c_ulp.tobytes()

    result = verify(a, b)
    assert not result.identical
    m = result.mismatch
    assert (m.iteration, m.output, m.index) == (0, "y", (1, 2))
    assert m.original == repr(float(ONE)) and m.patched == repr(float(ONE_PLUS_ULP))
    text = m.text()
    assert "'y'" in text and "[1, 2]" in text and m.original in text and m.patched in text
    assert result.max_abs_diff["y"] == float(ONE_PLUS_ULP) - 1.0
    assert not result.polygraphy_passed


def test_negative_zero_fails_although_polygraphy_passes(tmp_path):
    a, b = times(tmp_path, "plus_zero", 0.0), times(tmp_path, "minus_zero", -0.0)
    x = np.random.default_rng(0).random((2, 3), dtype=np.float32)
    assert (ort_run(a, x).view(np.uint32) == 0x00000000).all()  # ORT CPU really gives +0.0 ...
    assert (ort_run(b, x).view(np.uint32) == 0x80000000).all()  # ... and -0.0

    result = verify(a, b)
    assert not result.identical
    assert result.mismatch.output == "y" and result.mismatch.index == (0, 0)
    assert (result.mismatch.original, result.mismatch.patched) == ("0.0", "-0.0")
    assert result.polygraphy_passed  # polygraphy alone would have called these equal


def nan_models(folder: Path) -> tuple[Path, Path]:
    a = save(folder, "nan_a", [helper.make_node("Div", ["x", "x"], ["y"])], [out()])
    b = save(folder, "nan_b", [helper.make_node("Div", ["x", "x"], ["q"]), helper.make_node("Identity", ["q"], ["y"])],
             [out()])
    return a, b


def test_identical_nans_pass_although_polygraphy_fails(tmp_path):
    a, b = nan_models(tmp_path)
    zeros = np.zeros((2, 3), np.float32)
    ya, yb = ort_run(a, zeros), ort_run(b, zeros)
    assert np.isnan(ya).all() and ya.tobytes() == yb.tobytes()

    result = verify(a, b, val_range={"x": (0, 0)})
    assert result.identical and result.mismatch is None
    assert not result.polygraphy_passed  # NaN != NaN: polygraphy's zero tolerance fails identical outputs
    assert result.val_range == {"x": (0, 0)}


@pytest.mark.parametrize("extra_in", ["original", "patched"])
def test_output_in_only_one_model_fails(tmp_path, extra_in):
    one = times(tmp_path, "one", 2.0)
    two = save(tmp_path, "two", [helper.make_node("Mul", ["x", "k"], ["y"]), helper.make_node("Neg", ["x"], ["z"])],
               [out(), out("z")], (const("k", 2.0),))
    result = verify(two, one) if extra_in == "original" else verify(one, two)
    assert not result.identical
    assert result.mismatch.output == "z" and "only one model" in result.mismatch.problem


def test_dtype_difference_fails(tmp_path):
    f32 = save(tmp_path, "f32", [helper.make_node("Identity", ["x"], ["y"])], [out()])
    f64 = save(tmp_path, "f64", [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE)],
               [out(elem=TensorProto.DOUBLE)])
    result = verify(f32, f64)
    assert not result.identical
    assert result.mismatch.output == "y" and "dtype" in result.mismatch.problem


def test_shape_difference_fails(tmp_path):
    same = save(tmp_path, "same", [helper.make_node("Identity", ["x"], ["y"])], [out()])
    flat = save(tmp_path, "flat", [helper.make_node("Flatten", ["x"], ["y"], axis=0)], [out(shape=(1, 6))])
    result = verify(same, flat)
    assert not result.identical
    assert result.mismatch.output == "y" and "shape" in result.mismatch.problem


@pytest.mark.parametrize("refused_is", ["original", "patched"])
def test_model_that_cannot_run_is_named(tmp_path, refused_is):
    """Offsets in [-50, 50] push the refused fixture's (unclamped) GatherND indices out of range: ORT errors."""
    runs = tmp_path / "clamped.onnx"
    onnx.save(graphs.exporter_like(), runs)  # same inputs, every index clamped: runs for any offset
    fails = tmp_path / "refused.onnx"
    shutil.copyfile(FIXTURES / "gathernd_refused.onnx", fails)
    pair = (fails, runs) if refused_is == "original" else (runs, fails)
    with pytest.raises(SurgeonError) as info:
        verify(*pair, val_range={"offset": (-50, 50)})
    assert info.value.path == str(fails)
    assert str(info.value).startswith(f"{fails}: ") and "fails to run" in str(info.value)
    assert str(runs) not in str(info.value)


def test_zero_iterations_is_rejected_as_such(tmp_path):
    a = times(tmp_path, "a", 2.0)
    with pytest.raises(SurgeonError) as info:
        verify(a, a, iterations=0)
    assert "iterations" in str(info.value) and str(a) not in str(info.value), str(info.value)


@pytest.mark.parametrize("bad", [{"not_an_input": (0.0, 1.0)}, {"x": (1.0, 0.0)}, {"x": (float("nan"), 1.0)}],
                         ids=["unknown-name", "lo-above-hi", "nan-bound"])
def test_bad_val_range_is_rejected(tmp_path, bad):
    a = times(tmp_path, "a", 2.0)
    with pytest.raises(SurgeonError):
        verify(a, a, val_range=bad)


# -- the CLI -----------------------------------------------------------------------------------------------------

def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_cli_verify_mismatch_exit_1_and_first_mismatch(tmp_path):
    c = np.full((2, 3), ONE, np.float32)
    c_ulp = c.copy()
    c_ulp[1, 2] = ONE_PLUS_ULP
    constant_output(tmp_path, "a", c)
    constant_output(tmp_path, "b", c_ulp)
    proc = cli("verify", "a.onnx", "b.onnx", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = [ln for ln in proc.stdout.splitlines() if ln.startswith("verify:")]
    assert len(verdicts) == 1 and verdicts[0].startswith("verify: FAILED"), proc.stdout
    assert [ln for ln in proc.stdout.splitlines() if "FAILED" in ln] == verdicts, proc.stdout
    for part in ("'y'", "[1, 2]", repr(float(ONE)), repr(float(ONE_PLUS_ULP))):
        assert part in verdicts[0], verdicts[0]
    # the vocabulary of every command (deform_surgeon/checks/verdict.py): on the same runtime the tolerance is 0
    ulp = float(np.float64(ONE_PLUS_ULP) - np.float64(ONE))
    assert f"differs (max |diff| {ulp:.3g} > 0)" in verdicts[0], verdicts[0]


@pytest.fixture(scope="module")
def cli_nan_run(tmp_path_factory):
    """`deform-surgeon verify` of two models that output identical NaNs (a success, exit 0)."""
    folder = tmp_path_factory.mktemp("nan")
    nan_models(folder)
    proc = cli("verify", "nan_a.onnx", "nan_b.onnx", "--val-range", "x:[0,0]", "--json", "v.json", cwd=folder)
    return proc, folder


def test_cli_verify_success_exit_0(cli_nan_run):
    proc, folder = cli_nan_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = [ln for ln in proc.stdout.splitlines() if ln.startswith("verify:")]
    assert len(verdicts) == 1 and verdicts[0].startswith("verify: PASSED") and "failed (NaNs)" in verdicts[0]
    result = json.loads((folder / "v.json").read_text())
    assert result["identical"] is True and result["polygraphy_passed"] is False
    assert result["val_range"] == {"x": [0.0, 0.0]}


def test_cli_verify_prints_only_its_verdict(cli_nan_run):
    """Polygraphy's own comparator lines ('[E] FAILED | ...' for identical NaNs) must not reach the terminal."""
    proc, _ = cli_nan_run
    assert proc.returncode == 0
    assert "FAILED" not in proc.stdout, proc.stdout


def test_cli_verify_model_that_cannot_run_one_stderr_line(tmp_path):
    """Only our line: ORT's own '[E:onnxruntime:...] Non-zero status code' log line must not precede it."""
    onnx.save(graphs.exporter_like(), tmp_path / "clamped.onnx")
    shutil.copyfile(FIXTURES / "gathernd_refused.onnx", tmp_path / "refused.onnx")
    proc = cli("verify", "clamped.onnx", "refused.onnx", "--val-range", "offset:[-50,50]", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("deform-surgeon: error: refused.onnx: fails to run")


def test_a_model_with_an_empty_input_passes_without_numpys_warnings(tmp_path):
    """The verdict is the one line and stderr stays empty: numpy's "Mean of empty slice" warnings (polygraphy's
    statistics of an empty output, six lines) are not printed before PASSED."""
    from onnx import TensorProto, helper

    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [0, 3]) for n in ("x", "y"))
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "zero.onnx")
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "verify", "zero.onnx", "zero.onnx"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (0, "") and proc.stdout.startswith("verify: PASSED"), proc.stderr
