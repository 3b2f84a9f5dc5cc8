"""`deform-surgeon bisect`: the command (`BisectTool`), over the API (api.py), as Polygraphy's `debug reduce` tool
sits over its markers."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ...base.streams import wrote
from ...base.tool import Tool
from ..placement.runner import DEFAULT_TIMEOUT, RUNTIMES
from .api import MODEL_BUNDLES, bisect, check_timeout


class BisectTool(Tool):
    """find the first node whose output a WebGPU runtime gets wrong (or fails on), and write a repro

    Run MODEL on a real WebGPU runtime and on ORT CPU, bisect over prefixes of the unmodified graph and name the first
    node whose output differs beyond the GPU tolerance, or whose prefix fails, with its inputs' agreement and the
    runtime's error; write a minimal repro and run it (docs/bisect.md). Exit 0: nothing differs; 1: a node was found;
    2: bad input. Needs `deform-surgeon setup`.
    """

    name = "bisect"

    def add_args(self, p: argparse.ArgumentParser) -> None:
        from ...commands.args import DEVICE_PROFILE, INPUT_SHAPES, profile_help
        p.add_argument("model", metavar="MODEL", help="ONNX model to bisect")
        p.add_argument("--runtime", choices=RUNTIMES, default="node",
                       help="node: onnxruntime-node native WebGPU EP (default); browser: headless Chromium")
        p.add_argument("--bundle", choices=MODEL_BUNDLES, default="webgpu",
                       help="browser only: webgpu (native EP, transformers.js's), jsep (the default import), all")
        DEVICE_PROFILE.add_to(p, help=profile_help("the device the browser page requests"))
        INPUT_SHAPES.add_to(p)
        p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0, placement's)")
        p.add_argument("--inputs", metavar="FILE.npz", help="the inputs, one array per graph input, instead of seeded")
        p.add_argument("--repro", metavar="DIR",
                       help="write the repro into DIR, a new folder (default: <model name>.repro in this folder)")
        p.add_argument("--no-repro", action="store_true", help="name the node only; write and run no repro")
        p.add_argument("--marked", action="store_true",
                       help="first run the model with every tensor an output (Polygraphy's `mark all`) and check the "
                            "node it names on the unmodified prefixes: 4 runs when it holds; the prefixes decide")
        p.add_argument("--json", metavar="FILE", help="write the result (every step) as JSON")
        p.add_argument("--replay", metavar="FILE.json",
                       help="keep each run's verdict in FILE as it comes, and go on from the verdicts FILE holds "
                            "(an interrupted search of the same model, runtime, profile and inputs); "
                            "Polygraphy's debug replay")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SEC",
                       help=f"stop one run after SEC seconds (default {DEFAULT_TIMEOUT:g}); a run stopped so fails")

    def run(self, args: argparse.Namespace) -> int:
        from ...commands.args import INPUT_SHAPES
        from ...files.io_check import check_io

        check_timeout(args.timeout, "--timeout")
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)  # ORT CPU's warnings about a prefix's unused weights are noise
        repro = None if args.no_repro else (args.repro or f"{Path(args.model).stem}.repro")
        check_io([args.model], others=[("--json", args.json), ("--replay", args.replay)],
                 other_reads=[(f"the --inputs file {args.inputs}", args.inputs)] if args.inputs else [])
        t0 = time.monotonic()

        def progress(text: str) -> None:
            print(f"[bisect {time.monotonic() - t0:7.1f}s] {text}", file=sys.stderr, flush=True)

        result = bisect(args.model, runtime=args.runtime, bundle=args.bundle, device_profile=args.device_profile,
                        input_shapes=INPUT_SHAPES.value(args), seed=args.seed, inputs=args.inputs, repro_dir=repro,
                        timeout=args.timeout, progress=progress, marked=args.marked, replay=args.replay)
        if args.json:  # (before the report: a stdout that fails costs no file, base/streams.py)
            import json

            Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
            wrote(args.json)
        print(result.format())
        return 0 if result.finding is None else 1
