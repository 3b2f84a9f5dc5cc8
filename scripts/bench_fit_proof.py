#!/usr/bin/env python
"""Plain `patch` (fitted to spec-default, every rewrite that is not exact by construction shown exact before
writing) against one ORT CPU inference of the original model, in the same run.

    .venv/bin/python scripts/bench_fit_proof.py MODEL.onnx [--work DIR] [--keep OUT.onnx] [--patch-args ...]

Both are real subprocesses, timed with the wall clock, their peak resident set size and CPU time (user + system:
what a busy machine changes least) read from the kernel (`os.wait4`'s rusage of that one child), with the load
average at the start. The floor is one inference of the original on ORT CPU (default graph optimisation level,
seeded input in [0, 1)): what a user's machine must afford to run the model at all. Targets (issue 23, the real
BiRefNet-lite 1024): patch <= 30 s and <= 3 GB peak RSS. Prints both, the ratios, and the patch's report note.
A real 1024 model needs ~8 GB for the floor: run it alone. Measures; does not gate (exit 0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SURGEON = [str(BIN / "deform-surgeon")] if (BIN / "deform-surgeon").exists() else [sys.executable, "-m",
                                                                                     "deform_surgeon"]
INFER = """
import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
feeds = {i.name: np.random.default_rng(1).random([d if isinstance(d, int) else 1 for d in i.shape],
                                                  dtype=np.float32) for i in s.get_inputs()}
s.run(None, feeds)
"""


def measure(argv: list[str]) -> tuple[float, int, str, float]:
    """Wall seconds, peak RSS bytes, stdout and CPU seconds of one subprocess."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{out}")
    return wall, usage.ru_maxrss * 1024, out, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--work", default=None, help="where the patched model goes (default: a temporary folder)")
    ap.add_argument("--keep", default=None, metavar="OUT.onnx", help="keep the patched model there (to verify it)")
    ap.add_argument("--patch-args", nargs=argparse.REMAINDER, default=[], help="more `patch` options")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        out = Path(args.keep) if args.keep else Path(tmp) / "patched.onnx"
        load = os.getloadavg()[0]
        p_wall, p_rss, p_out, p_cpu = measure([*SURGEON, "patch", args.model, str(out), *args.patch_args])
        i_wall, i_rss, _, i_cpu = measure([sys.executable, "-c", INFER, args.model])
    gb = 1e9
    print(f"model: {args.model}")
    print(f"load average (1 min) at the start: {load:.2f} on {os.cpu_count()} CPUs")
    print(f"floor: one ORT CPU inference of the original   {i_wall:7.1f} s wall  {i_rss / gb:6.2f} GB peak RSS  "
          f"{i_cpu:7.1f} s CPU")
    print(f"deform-surgeon patch {' '.join(args.patch_args):<24} {p_wall:7.1f} s wall  {p_rss / gb:6.2f} GB peak RSS  "
          f"{p_cpu:7.1f} s CPU")
    print(f"ratio: time {p_wall / i_wall:.2f}x the inference, peak RSS {p_rss / i_rss:.2f}x the inference's")
    print(f"targets (real lite 1024): patch <= 30 s: {'MET' if p_wall <= 30 else 'NOT MET'}; "
          f"<= 3 GB: {'MET' if p_rss <= 3 * gb else 'NOT MET'}")
    notes = [line for line in p_out.splitlines() if "undone" in line or "max-memory" in line or "refused" in line]
    print("\n".join(notes[:5]))


if __name__ == "__main__":
    main()
