"""The repro of a node found: the smallest window of nodes ending with it that still goes wrong on its own, fed with
ORT CPU's values of its inputs, written as onnxruntime's and ONNX's test runners read it."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...checks.verdict import summarize_errors
from ...graph.subgraphs import Graph, save_model, sub_model, window_inputs
from ..placement.runner import reference_outputs
from .result import AGREE, FAIL, Progress, Repro, RunFn, RunOutcome, error_text

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np
    import onnx

def _type_outputs(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> bool:
    """Gives the model's untyped graph outputs the dtypes and shapes of `values` (ORT CPU's arrays of them), in
    place; whether any was untyped."""
    from onnx import helper

    untyped = [vi for vi in model.graph.output if not vi.type.HasField("tensor_type")]
    for vi in untyped:
        a = values[vi.name]
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape))
    return bool(untyped)


def typed_model(path: Path, feeds: Mapping[str, np.ndarray]) -> Path:
    """A written model whose untyped graph outputs are typed as ORT CPU computes them (one ORT CPU run, only when
    some output is untyped)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if any(not vi.type.HasField("tensor_type") for vi in model.graph.output):
        _type_outputs(model, reference_outputs(path, dict(feeds)))
        onnx.save_model(model, str(path))
    return path


def _cpu_values(g: Graph, names: Sequence[str], feeds: Mapping[str, np.ndarray], before: int, tmp: Path
                ) -> dict[str, np.ndarray]:
    """ORT CPU's values of `names` (graph inputs or tensors made by nodes before `before`): a prefix run on ORT
    CPU exposing them, the reference the runtime's run of the prefix was held against."""
    made = [n for n in names if n not in feeds]
    values = {n: feeds[n] for n in names if n in feeds}
    if made:
        path = save_model(sub_model(g, range(before), made), tmp / f"cpu_values_{before}.onnx")
        values.update(reference_outputs(path, dict(feeds)))
    return {n: values[n] for n in names}


def write_repro(g: Graph, first: int, last: int, values: Mapping[str, np.ndarray], directory: Path) -> Path:
    """The window's model, its inputs as `inputs.npz` and as ONNX TensorProto files with ORT CPU's outputs
    (`test_data_set_0/`, the layout onnxruntime's and ONNX's test runners read); returns the model's path."""
    import numpy as np
    from onnx import numpy_helper

    directory.mkdir(parents=True, exist_ok=True)
    outputs = [y for y in g.nodes[last].output if y]
    model = sub_model(g, range(first, last + 1), outputs, values)
    model_path = save_model(model, directory / "model.onnx")
    expected = reference_outputs(model_path, dict(values))
    if _type_outputs(model, expected):  # typed as ORT CPU makes them, so that onnx.checker passes the repro
        save_model(model, model_path)
    np.savez(directory / "inputs.npz", **values)
    data = directory / "test_data_set_0"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir()
    for i, (name, a) in enumerate(values.items()):
        (data / f"input_{i}.pb").write_bytes(numpy_helper.from_array(np.asarray(a), name).SerializeToString())
    for i, (name, a) in enumerate(expected.items()):
        (data / f"output_{i}.pb").write_bytes(numpy_helper.from_array(np.asarray(a), name).SerializeToString())
    return model_path


def make_repro(g: Graph, k: int, feeds: Mapping[str, np.ndarray], run: RunFn, directory: Path, tmp: Path,
               progress: Progress = None, errors: Sequence[str] = ()) -> Repro:
    """Node k alone, then wider windows before it (doubling, then halving back) until one goes wrong on its own.

    Whether a window goes wrong is asked of node k's own outputs only, the window's only outputs."""
    runs = 0
    tried: dict[int, RunOutcome] = {}

    def attempt(first: int) -> RunOutcome:
        nonlocal runs
        if first in tried:
            return tried[first]
        names = window_inputs(g, first, k)
        values = _cpu_values(g, names, feeds, first, tmp)
        window_dir = tmp / f"window_{first}"
        path = write_repro(g, first, k, values, window_dir)
        o = run(path, dict(values))
        runs += 1
        if progress:
            progress(f"repro run {runs}: nodes {first + 1}..{k + 1} ({k - first + 1} node(s)): {o.status}")
        tried[first] = o
        return o

    width, good = 1, 0  # good: the widest window known not to reproduce
    while True:
        first = max(k - width + 1, 0)
        if attempt(first).bad:
            break
        good = width
        if first == 0:
            first = None
            break
        width *= 2
    if first is not None:  # narrow: the smallest width in (good, width] that reproduces
        lo, hi = good, k - first + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(k - mid + 1).bad:
                hi = mid
            else:
                lo = mid
        first = k - hi + 1
        o = tried[first]
        shutil.copytree(tmp / f"window_{first}", directory, dirs_exist_ok=True)
        n = k - first + 1
        what = "node alone" if n == 1 else f"{n} nodes ({g.describe(first)} .. {g.describe(k)})"
        if o.status == FAIL:
            same = summarize_errors(o.errors) == summarize_errors(errors)
            detail = f"the {what} fails on its own" + (" with the same error" if same else ": " + error_text(o.errors))
        else:
            worst = [o.verdicts[y] for y in o.differing()]
            detail = f"the {what} differs on its own " + (worst[0].text.removeprefix("differs ") if worst else
                                                             f"({len(o.errors)} uncaught WebGPU error(s))")
            if n > 1:
                detail += f" (node {g.describe(k)} alone does not: the cause needs the nodes before it)"
        return Repro(str(directory), str(directory / "model.onnx"), str(directory / "inputs.npz"), (first, k),
                     True, o.status, detail, runs)
    shutil.copytree(tmp / f"window_{max(k - width + 1, 0)}", directory, dirs_exist_ok=True)
    return Repro(str(directory), str(directory / "model.onnx"), str(directory / "inputs.npz"), (0, k), False,
                 AGREE, "does not go wrong on its own, not even as the whole prefix fed from its inputs with only the "
                        "node's outputs exposed: the cause needs the rest of the prefix's cut (the prefix models "
                        "the search ran go wrong; see the steps in --json)", runs)
