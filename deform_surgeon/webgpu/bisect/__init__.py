"""`deform-surgeon bisect MODEL`: the first node whose output a WebGPU runtime gets wrong (or on which it fails),
found on prefixes of the unmodified graph, and a repro of it small enough to attach to an onnxruntime issue.

Why prefixes and not every tensor marked as an output (Polygraphy's `--onnx-outputs mark all`): a tensor made a
graph output can no longer be fused away or have its buffer reused, so the runtime computes another program, which
can hide the bug (or create one). A prefix keeps the original nodes, in the original order, and exposes only its
cut: the tensors its nodes made that later nodes read (or that are graph outputs), and the last node's own outputs.
Every verdict of the search is from a real run of such a prefix on the runtime, held against ORT CPU on the same
prefix and the same inputs (`placement.runner`: the one runner and the one reference), in the one vocabulary
(verdict.py: differs is beyond the GPU tolerance of the tensor's dtype; an uncaught WebGPU error during a run is a
failure even when `session.run()` resolved).

The search keeps two prefixes, `good` (every exposed tensor agrees) and `bad` (something differs, or the session or
the run fails), starting from the empty prefix (nothing computed, nothing can differ) and the whole model, and
halves the distance between them: about log2(nodes) runs. It ends at adjacent prefixes k-1 and k, and that is what
is reported, each half from its own run: node k's inputs agreed (in the prefix that ends before it) and its own
output differed (in the prefix that ends with it). The search assumes that a difference, once made, stays visible
in every longer prefix's cut; a difference that a later node masks (a Shape of it, a comparison that comes out the
same) before it reaches the cut may be passed over, and then the node found is still one whose inputs agreed and
whose output did not, but not the first such node in topological order (docs/bisect.md).

The repro is node k alone: its non-constant inputs as graph inputs, fed with ORT CPU's values of them; its
constants kept. It is run on the runtime again. When it does not differ on its own (the cause needs the nodes
before it: a fusion, a reused buffer), the window of nodes before k is doubled until it does, and then narrowed by
halving to the smallest window that still does.

The modules: `result` (a run's outcome and the result's types and text), `search` (the search, given a function
that runs prefix k), `replay` (`--replay`'s file), `repro`, `inputs` (seeded, or an `.npz`), `api` (`bisect`,
`bisect_with`: the prefixes written and run) and `command` (`BisectTool`).
"""

from __future__ import annotations

from ...graph.subgraphs import Graph, sub_model
from .api import MODEL_BUNDLES, bisect, bisect_with, webgpu_run
from .command import BisectTool
from .inputs import NPZ_LIMIT, load_inputs
from .replay import Replay
from .repro import make_repro, write_repro
from .result import AGREE, DIFFER, FAIL, BisectResult, Finding, Repro, RunFn, RunOutcome, outcome_of
from .search import search

__all__ = [
    "AGREE", "DIFFER", "FAIL", "MODEL_BUNDLES", "NPZ_LIMIT", "BisectResult", "BisectTool", "Finding", "Graph",
    "Replay", "Repro", "RunFn", "RunOutcome", "bisect", "bisect_with", "load_inputs", "make_repro", "outcome_of",
    "search", "sub_model", "webgpu_run", "write_repro",
]
