"""`bisect()` and `bisect_with()`, the Python API: the model loaded and checked, its prefixes written and run on a
runtime (the real WebGPU ones: `webgpu_run`), the search (search.py) and the repro (repro.py)."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...base.errors import SurgeonError, api_call
from ...graph.subgraphs import Graph, save_model, sub_model
from ..placement.runner import BUNDLES, DEFAULT_TIMEOUT, RUNTIMES, SetupMissing, measure_placement, missing_setup
from .inputs import load_inputs
from .replay import Replay
from .repro import make_repro, typed_model
from .result import BisectResult, Progress, RunFn, RunOutcome, outcome_of
from .search import search

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np

# placement's bundles that load one model file (a transformers.js pipeline loads a folder: bisect runs its file on
# the webgpu bundle, which the pipeline runs)
MODEL_BUNDLES = tuple(b for b in BUNDLES if b != "transformers")


def webgpu_run(runtime: str, bundle: str, profile: Any, timeout: float) -> RunFn:
    """Runs a model on the real WebGPU runtime through placement's runner.

    JSEP runs with `ort.env.debug` off, as users' pages do: a shader that fails to compile then does not reject
    `session.run()`, the outputs come back wrong and can be compared, and the uncaught WebGPU errors the page
    collects make the run count as differing anyway (with debug on, the same run would fail with no outputs to
    compare)."""
    def run(model: Path, feeds: dict[str, np.ndarray]) -> RunOutcome:
        return outcome_of(measure_placement(model, runtime=runtime, bundle=bundle, run=True, feeds=feeds,
                                            timeout=timeout, profile=profile, jsep_debug=False))

    return run


def check_timeout(value: object, name: str) -> None:
    """A run's time limit is a positive, finite number of seconds (NaN compared false with 0 and was taken)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SurgeonError(None, f"{name} must be a positive number of seconds (got {value!r})")


@api_call
def bisect(model: str | Path, *, runtime: str = "node", bundle: str = "webgpu", device_profile: str | None = None,
           input_shapes: dict[str, Sequence[int]] | None = None, seed: int = 0,
           inputs: str | Path | Mapping[str, Any] | None = None, repro_dir: str | Path | None = None,
           timeout: float | None = None, progress: Progress = None, marked: bool = False,
           replay: str | Path | None = None) -> BisectResult:
    """Runs `model` on a WebGPU runtime and on ORT CPU and names the first node, in topological order, whose output
    differs beyond the GPU tolerance or whose prefix fails (the package's docstring); with `repro_dir`, writes the repro
    there and runs it. `runtime`/`bundle`/`device_profile`/`seed` are placement's; `inputs` an .npz file or a dict
    of arrays instead of seeded ones; `input_shapes` fixes symbolic input dims first; `marked` first runs the model
    with every tensor an output and checks the node it names on the prefixes (fewer runs when it holds);
    `replay` keeps the search's verdicts in a JSON file and goes on from them (`Replay`)."""
    from ...graph.device import resolve_profile
    if runtime not in RUNTIMES:
        raise SurgeonError(None, f"runtime must be one of {', '.join(RUNTIMES)} (got {runtime!r})")
    if runtime == "browser" and bundle not in MODEL_BUNDLES:
        raise SurgeonError(None, f"bundle must be one of {', '.join(MODEL_BUNDLES)} (got {bundle!r})")
    msg = missing_setup(runtime)
    if msg:
        raise SurgeonError(None, str(SetupMissing(msg)))
    if timeout is not None:
        check_timeout(timeout, "timeout")
    profile = resolve_profile(device_profile)
    where = runtime if runtime == "node" else f"browser/{bundle}"
    run = webgpu_run(runtime, bundle, profile, DEFAULT_TIMEOUT if timeout is None else timeout)
    return bisect_with(model, run, where, input_shapes=input_shapes, seed=seed, inputs=inputs, repro_dir=repro_dir,
                       progress=progress, marked=marked, replay=replay, profile=getattr(profile, "name", None),
                       timeout=DEFAULT_TIMEOUT if timeout is None else timeout)


def _file_sha256(path: Path) -> str:
    """The model file's content (a replay file of another model of the same size and node names was taken)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def bisect_with(model: str | Path, run: RunFn, where: str, *, input_shapes: Mapping[str, Sequence[int]] | None = None,
                seed: int = 0, inputs: str | Path | Mapping[str, Any] | None = None,
                repro_dir: str | Path | None = None, progress: Progress = None, marked: bool = False,
                replay: str | Path | None = None, profile: str | None = None, timeout: float | None = None
                ) -> BisectResult:
    """`bisect` on any runtime `run(model_path, feeds) -> RunOutcome` (the real ones: `webgpu_run`); `replay`: a
    JSON file of the search's verdicts, read where it exists and written after each run (`Replay`)."""
    import onnx

    from ...files import user_path
    from ...graph.input_shapes import check_input_shapes, fix_input_shapes

    path = user_path(model, "the model")
    shapes = check_input_shapes(dict(input_shapes) if input_shapes is not None else None)
    repro = Path(repro_dir) if repro_dir is not None else None
    if repro is not None and repro.exists() and (not repro.is_dir() or any(repro.iterdir())):
        raise SurgeonError(repro, "exists and is not an empty folder", "bisect writes its repro into a new folder")
    try:
        loaded = onnx.load(str(path))
    except Exception as e:  # protobuf's DecodeError and friends
        raise SurgeonError(path, f"is not a readable ONNX model ({e})") from None
    if shapes:
        fix_input_shapes(loaded, shapes, path)
    g = Graph.of(loaded, path)
    if not g.nodes:
        raise SurgeonError(path, "has no nodes to bisect")
    twice = sorted(m for m, c in Counter(n.name for n in g.nodes).items() if c > 1 and m)
    if twice:  # (onnx.checker passes such a model; ORT refuses it: every prefix and repro would fail the same)
        raise SurgeonError(path, f"names {len(twice)} node name(s) more than once ({', '.join(twice[:3])}), "
                                 "which onnxruntime refuses", "give each node its own name")
    feeds, notes = load_inputs(inputs, seed, loaded, path)
    log = None
    if replay is not None:
        import hashlib

        import numpy as np

        digest = hashlib.sha256(b"".join(np.ascontiguousarray(feeds[n]).tobytes() for n in sorted(feeds)))
        log = Replay.open(replay, {"model_sha256": _file_sha256(path), "nodes": len(g.nodes),
                                   "first": g.nodes[0].name, "last": g.nodes[-1].name, "runtime": where,
                                   "timeout": timeout,
                                   "device_profile": profile, "inputs_sha256": digest.hexdigest()[:16],
                                   "input_shapes": {k: list(v) for k, v in shapes.items()} if shapes else None})
    result = BisectResult(str(path), where, len(g.nodes), notes=notes)
    tmp = Path(tempfile.mkdtemp(prefix="ds-bisect-"))
    try:
        whole_path = path if not shapes else save_model(loaded, tmp / "whole.onnx")

        def run_prefix(k: int) -> RunOutcome:
            if k == len(g.nodes) - 1:
                return run(whole_path, feeds)
            prefix = typed_model(save_model(sub_model(g, range(k + 1), g.cut(k)), tmp / f"prefix_{k}.onnx"), feeds)
            try:
                return run(prefix, feeds)
            finally:
                prefix.unlink(missing_ok=True)

        def run_marked() -> RunOutcome:
            produced = [y for n in g.nodes for y in n.output if y and y not in g.constants]
            every = typed_model(save_model(sub_model(g, range(len(g.nodes)), produced), tmp / "marked.onnx"), feeds)
            return run(every, feeds)

        whole, finding, runs, steps, notes = search(g, run_prefix, progress, run_marked if marked else None, log)
        result.whole, result.finding, result.search_runs, result.steps = whole, finding, runs, steps
        result.notes += notes
        if finding is not None and repro is not None:
            result.repro = make_repro(g, finding.index, feeds, run, repro, tmp, progress, finding.errors)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
