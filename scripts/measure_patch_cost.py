#!/usr/bin/env python
"""What a plain `deform-surgeon patch IN OUT` costs against one ORT CPU inference of IN, measured in the same run.

    .venv/bin/python scripts/measure_patch_cost.py MODEL.onnx [MODEL.onnx ...] [--out DIR] [--time-ratio 1.5]
        [--max-rss 3.2GB] [--verify]

For each model, one after the other (never beside each other, so that each has the machine's cores to itself):
(1) one ORT CPU inference of the original in a subprocess (`onnxruntime.InferenceSession`, default level, CPU
    arena off, one seeded input in [0, 1) of the model's own input shape), timed from the start of the process
    (session creation included, as a page or a user's script pays it);
(2) `deform-surgeon patch MODEL OUT` with no option, in a subprocess.
Each subprocess's wall time and peak resident set size come from the kernel (`os.wait4`'s rusage of that child,
which counts the largest of the processes it started and waited for). The table gives both and their ratios, with
the patch's peak against `--max-rss` and its time against `--time-ratio` times the inference: `ok` or `OVER`.
With `--verify`, `deform-surgeon verify` then compares MODEL and OUT at levels `disable` and `all`.

The script measures; it exits 0 whether or not a target is met (1 when a command failed). The outputs are written
to --out (default: a temporary folder, removed afterwards), each named by the shortest tail of its model's path no
other model shares (`var1024_model_fp16.patched.onnx`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INFER = """
import sys, numpy as np, onnxruntime as ort
options = ort.SessionOptions()
options.enable_cpu_mem_arena = False
options.log_severity_level = 3
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
feeds = {}
for i in session.get_inputs():
    shape = [d if isinstance(d, int) else 1 for d in i.shape]
    dtype = np.float16 if "float16" in i.type else np.float32
    feeds[i.name] = rng.random(shape, dtype=np.float32).astype(dtype)
session.run(None, feeds)
"""


def measure(argv: list[str]) -> dict:
    """Wall time and peak RSS of one subprocess (its waited-for children included)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": time.perf_counter() - start, "rss": usage.ru_maxrss * 1024, "rc": proc.returncode,
            "output": out}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def parse_size(text: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from deform_surgeon.base.sizes import parse_size as parse

    return parse(text)


def labels(models: list[Path]) -> list[str]:
    """Each model's shortest tail of its path that no other model given shares (`var1024/model_fp16.onnx` beside
    `var512/model_fp16.onnx`, which transformers.js's folders all name so): it names the row, and the output file,
    which must not be another model's (a second `model_fp16` replaced the first's output under --out)."""
    parts = [model.resolve().parts for model in models]
    for depth in range(1, max(map(len, parts)) + 1):
        tails = ["/".join(p[-depth:]) for p in parts]
        if len(set(tails)) == len(tails):
            return tails
    return [f"{k}_{p[-1]}" for k, p in enumerate(parts, 1)]  # the same file given twice


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where the patched files go (default: a temp folder)")
    parser.add_argument("--time-ratio", type=float, default=1.5, help="the patch's time target, x one inference")
    parser.add_argument("--max-rss", default="3.2GB", help="the patch's peak RSS target")
    parser.add_argument("--verify", action="store_true", help="verify each output at levels disable and all")
    args = parser.parse_args()
    limit = parse_size(args.max_rss)
    command = str(Path(sys.executable).parent / "deform-surgeon")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="patch-cost-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    try:
        for model, label in zip(args.models, labels(args.models), strict=True):
            out = out_dir / (label.removesuffix(".onnx").replace("/", "_") + ".patched.onnx")
            infer = measure([sys.executable, "-c", INFER, str(model)])
            patch = measure([command, "patch", str(model), str(out)])
            line = f"{model}: inference {infer['seconds']:.1f} s, {gb(infer['rss'])} (rc {infer['rc']}); " \
                   f"patch {patch['seconds']:.1f} s, {gb(patch['rss'])} (rc {patch['rc']})"
            print(line, flush=True)
            stages = [x for x in patch["output"].splitlines() if x.startswith("stages")]
            print("  " + (stages[0] if stages else patch["output"].strip().splitlines()[-1]), flush=True)
            failed |= infer["rc"] != 0 or patch["rc"] not in (0, 3)
            verified = ""
            if args.verify and patch["rc"] in (0, 3):
                levels = []
                for level in ("disable", "all"):
                    v = measure([command, "verify", str(model), str(out), "--opt-level", level])
                    levels.append(f"{level} {'PASSED' if v['rc'] == 0 else 'FAILED'}")
                    failed |= v["rc"] != 0
                verified = ", ".join(levels)
            rows.append((label, infer, patch, verified))
    finally:
        if args.out is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    print()
    print(f"| file | one ORT CPU inference | plain patch | ratio (time, RSS) | targets (<= {args.time_ratio}x, "
          f"<= {gb(limit)}) |" + (" verify |" if args.verify else ""))
    print("| --- | --- | --- | --- | --- |" + (" --- |" if args.verify else ""))
    for name, infer, patch, verified in rows:
        t, r = patch["seconds"] / infer["seconds"], patch["rss"] / infer["rss"]
        ok_t = "ok" if t <= args.time_ratio else "OVER"
        ok_r = "ok" if patch["rss"] <= limit else "OVER"
        print(f"| {name} | {infer['seconds']:.1f} s, {gb(infer['rss'])} | {patch['seconds']:.1f} s, "
              f"{gb(patch['rss'])} | {t:.2f}x, {r:.2f}x | time {ok_t}, RSS {ok_r} |"
              + (f" {verified} |" if args.verify else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
