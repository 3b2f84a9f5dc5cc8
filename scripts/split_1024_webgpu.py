#!/usr/bin/env python
"""End to end at 1024x1024 with BiRefNet's tensor sizes: budget, split, verify, and real WebGPU runs.

    .venv/bin/python scripts/split_1024_webgpu.py                       # birefnet64_1024, 256MiB, all runtimes
    .venv/bin/python scripts/split_1024_webgpu.py --preset birefnet4_1024_small --max-buffer 1MiB   # CI's size

Steps (each printed, and all of it written to OUT/summary.json):
 1. build the fixture with tests/helpers/exporter_replica.py (the exporter's graph, byte-identical to real exporter
    output at the committed fixtures' sizes; see tests/passes/test_split.py), deterministically;
 2. `deform-surgeon budget` before;
 3. `deform-surgeon patch --max-buffer` with `--verify` (byte comparison on ORT CPU);
 4. `deform-surgeon budget` after: what remains over the limit (the Conv inputs, which the split keeps whole);
 5. `measure_placement(run=True)` on each runtime: placement from ORT's log, one seeded run, output compared with
    ORT CPU (byte identity and max abs diff); the adapter's limits;
 6. optionally (`--unsplit`) the patched model without the split on the same runtimes, and the GPU outputs of the
    two compared byte for byte (the split is data movement + elementwise work, so on one runtime they must match);
 7. optionally (`--original`) the model as exported, to show how it fails (or falls back to the CPU) there.

Slow on a software adapter: the 64-channel model runs for a long time on SwiftShader (see the timings it
prints); run it in the background. Only one 64-channel ORT CPU inference runs at a time (the steps are
sequential; the reference for each GPU run is computed after the runtime has exited).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.exporter_replica import SPECS, build  # noqa: E402

from deform_surgeon import patch  # noqa: E402
from deform_surgeon.graph.budget import analyze, parse_size  # noqa: E402
from deform_surgeon.webgpu.placement import measure_placement  # noqa: E402
from deform_surgeon.webgpu.placement import runner as runner_mod  # noqa: E402

RUNTIMES = {"browser/webgpu": ("browser", "webgpu"), "browser/jsep": ("browser", "jsep"), "node": ("node", None)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(model: Path, runtime: str, timeout: float, seed: int,
            profile: str = "adapter") -> tuple[dict, dict[str, np.ndarray] | None]:
    """One real run; returns the Placement as a dict and the raw GPU outputs (captured from the comparison)."""
    rt, bundle = RUNTIMES[runtime]
    captured: dict = {}
    original = runner_mod.compare_outputs

    def capture(got, ref):
        captured.update({k: None if v is None else np.array(v) for k, v in got.items()})
        return original(got, ref)

    runner_mod.compare_outputs = capture
    try:
        p = measure_placement(model, runtime=rt, bundle=bundle or "webgpu", run=True, seed=seed, timeout=timeout,
                              progress=lambda text: log(f"  {runtime}: {text}"), profile=profile)
    finally:
        runner_mod.compare_outputs = original
    return p.to_dict(), (captured or None)


def brief(p: dict) -> dict:
    run = p.get("run") or {}
    outs = run.get("outputs") or {}
    return {
        "session_ok": p["session_ok"], "error": p["error"], "cpu_nodes": p["cpu_nodes"], "memcpy": p["memcpy"],
        "cpu_ops": p["cpu_ops"], "gpu_provider": p["gpu_provider"], "run_ok": run.get("ok"),
        "run_error": run.get("error"), "gpu_errors": (run.get("gpu_errors") or [])[:3],
        "identical_to_ort_cpu": run.get("identical"),
        "max_abs_diff": {k: v.get("max_abs_diff") for k, v in outs.items()},
        "timings": p["timings"], "adapter_limits": (p.get("adapter") or {}).get("limits"),
    }


def budget_summary(path: Path, limit: int) -> dict:
    r = analyze(path, max_buffer=limit)
    return {"over_limit": [[t.name, t.nbytes, t.shape, t.producer] for t in r.over_buffer],
            "largest": [[t.name, t.nbytes, t.shape, t.producer] for t in r.largest[:3]],
            "peak_bytes": r.peak_bytes, "peak_node": r.peak_node}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="birefnet64_1024", choices=sorted(SPECS))
    ap.add_argument("--max-buffer", default="256MiB", help="split limit (default 256MiB, the WebGPU spec default)")
    ap.add_argument("--runtimes", default="browser/webgpu,browser/jsep,node",
                    help=f"comma-separated, from {', '.join(RUNTIMES)}")
    ap.add_argument("--unsplit", action="store_true", help="also run the patched model without the split")
    ap.add_argument("--original", action="store_true", help="also run the model as exported (browser/webgpu)")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per runtime (default 6 h)")
    ap.add_argument("--verify-iterations", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-profile", default="adapter",
                    help="device profile of the runs (default adapter: docs/buffer-budget.md's numbers were measured on"
                         " the adapter's own limits; with --max-buffer 128MiB the model also fits spec-default)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "split_1024")
    args = ap.parse_args(argv)
    limit = parse_size(args.max_buffer)
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    for r in runtimes:
        if r not in RUNTIMES:
            ap.error(f"unknown runtime {r}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"preset": args.preset, "spec": vars(SPECS[args.preset]), "max_buffer": limit, "runs": {}}
    summary_path = args.out / "summary.json"

    def save() -> None:
        summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")

    src = args.out / f"{args.preset}.onnx"
    split = args.out / f"{args.preset}.split.onnx"
    log(f"building {args.preset}")
    onnx.save_model(build(SPECS[args.preset]), str(src))
    summary["budget_before"] = budget_summary(src, limit)
    log(f"budget before: {len(summary['budget_before']['over_limit'])} tensor(s) over {args.max_buffer}, largest "
        f"{summary['budget_before']['largest'][0]}")
    t0 = time.monotonic()
    report = patch(src, split, max_buffer=limit, verify=True,
                   verify_options={"iterations": args.verify_iterations})
    summary["patch"] = {"seconds_with_verify": round(time.monotonic() - t0, 1),
                        "verification": report.verification.summary(),
                        "split": [a.reason for a in report.actions if a.pass_name == "split"]}
    log(f"patched + verified in {summary['patch']['seconds_with_verify']} s: {report.verification.summary()}")
    for line in summary["patch"]["split"]:
        log(f"  split: {line}")
    summary["budget_after"] = budget_summary(split, limit)
    log(f"budget after: {summary['budget_after']['over_limit']}")
    save()

    models = [("split", split)]
    if args.unsplit:
        unsplit = args.out / f"{args.preset}.patched.onnx"
        patch(src, unsplit)
        models.append(("unsplit", unsplit))
    outputs: dict[tuple[str, str], dict] = {}
    for runtime in runtimes:
        for label, path in models:
            log(f"{runtime}: {label} model")
            p, got = measure(path, runtime, args.timeout, args.seed, args.device_profile)
            summary["runs"][f"{runtime} {label}"] = brief(p)
            log(f"{runtime} {label}: {json.dumps(brief(p), default=str)}")
            if got:
                outputs[(runtime, label)] = got
            save()
        if ("split" in [m[0] for m in models] and (runtime, "split") in outputs and (runtime, "unsplit") in outputs):
            a, b = outputs[(runtime, "split")], outputs[(runtime, "unsplit")]
            same = all(a[k] is not None and b.get(k) is not None and a[k].tobytes() == b[k].tobytes() for k in a)
            summary["runs"][f"{runtime} split==unsplit bytes"] = same
            log(f"{runtime}: split vs unsplit GPU outputs byte-identical: {same}")
            save()
    if args.original:
        log("browser/webgpu: the model as exported")
        p, _ = measure(src, "browser/webgpu", min(args.timeout, 3600.0), args.seed, args.device_profile)
        summary["runs"]["browser/webgpu original"] = brief(p)
        log(f"original: {json.dumps(brief(p), default=str)}")
        save()
    log(f"summary: {summary_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
