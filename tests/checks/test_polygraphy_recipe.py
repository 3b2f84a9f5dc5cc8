"""docs/verify.md's polygraphy recipe, run verbatim (by bash, from the folder holding the models).

Both runs feed the same inputs: polygraphy's data loader is seeded (default seed 1) and the value range is given
explicitly; the second run compares its outputs with the saved ones at zero tolerance. The `--val-range` value is
quoted because `[0,1]` is a glob pattern to the shell (zsh refuses an unmatched one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from deform_surgeon import patch

FIXTURES = Path(__file__).parents[1] / "fixtures"
BIN = Path(sys.executable).parent

RECIPE = (
    "polygraphy run model.onnx --onnxrt --val-range 'image:[0,1]' --iterations 3 --save-outputs model.outputs.json",
    "polygraphy run model.patched.onnx --onnxrt --val-range 'image:[0,1]' --iterations 3 "
    "--load-outputs model.outputs.json --atol 0 --rtol 0",
)


def shell(line: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    assert shutil.which("polygraphy", path=env["PATH"]) == str(BIN / "polygraphy")
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A folder with model.onnx (an exporter fixture), its patch, and the first recipe line's saved outputs."""
    folder = tmp_path_factory.mktemp("recipe")
    shutil.copyfile(FIXTURES / "decoder_gathernd.onnx", folder / "model.onnx")
    report = patch(folder / "model.onnx", folder / "model.patched.onnx")
    assert report.written and report.ops_after.get("GatherND", 0) == 0
    proc = shell(RECIPE[0], folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (folder / "model.outputs.json").is_file()
    return folder


def test_recipe_passes_on_patched_model(saved):
    proc = shell(RECIPE[1], saved)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert "Passed: 3/3 iterations" in log  # three iterations really compared, not zero
    assert "FAILED" not in log


def perturbed(model: onnx.ModelProto, eps: float = 2.0**-20) -> onnx.ModelProto:
    """The same model with `output + eps` as its output (same name, dtype and shape)."""
    graph = gs.import_onnx(model)
    old = graph.outputs[0]
    new = gs.Variable(old.name, dtype=old.dtype, shape=old.shape)
    old.name = f"{old.name}_before_perturbation"
    graph.nodes.append(gs.Node("Add", "perturb", inputs=[old, gs.Constant("eps", np.array(eps, np.float32))],
                               outputs=[new]))
    graph.outputs = [new]
    out = gs.export_onnx(graph.cleanup().toposort())
    onnx.checker.check_model(out, full_check=True)
    return out


def test_recipe_fails_on_perturbed_model(saved, tmp_path):
    shutil.copyfile(saved / "model.outputs.json", tmp_path / "model.outputs.json")
    onnx.save(perturbed(onnx.load(saved / "model.patched.onnx")), tmp_path / "model.patched.onnx")
    proc = shell(RECIPE[1], tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "FAILED | Output: 'mask'" in proc.stdout + proc.stderr  # failed on the comparison, not on loading


def test_the_docs_show_exactly_this_recipe():
    readme = (Path(__file__).parents[2] / "docs" / "verify.md").read_text()
    assert all(f"    {line}\n" in readme for line in RECIPE)
