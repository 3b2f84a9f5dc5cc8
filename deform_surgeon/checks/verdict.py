"""One verdict vocabulary for every comparison this tool prints (`verify`, `placement --run`, `placement --compare`,
`serve`), and one way to show repeated runtime errors.

Why one vocabulary: the same 8.9e-7 difference of a WebGPU run from ORT CPU must read alike in `placement` and on
the `serve` page, not "DIFFERENT" in one and "agrees" in the other. There are exactly three verdicts, and each shows
its number:

- **byte-identical**: every output has the reference's bytes (max |diff| 0). The only verdict that passes when both
  sides ran on the same runtime (`verify`: ORT CPU against ORT CPU; `serve`: patched against original on the same
  page), because the patched model must compute the same operations in the same order.
- **agrees with ORT CPU within the GPU tolerance (max |diff| X, tolerance T)**: a WebGPU run against ORT CPU. GPU
  kernels add in another order (Conv) and may fuse multiply-adds, so the last bits differ: measured at most 8.9e-7
  on the float32 fixtures (docs/serve.md). The tolerance is per dtype (`GPU_TOLERANCE`).
- **differs (max |diff| X > T)**: beyond the tolerance (T is 0 on the same runtime), or not comparable (an output
  missing, another dtype or shape, non-finite values in other places, or equal values with other bytes: -0.0 vs
  +0.0, NaN payloads).

The page of `serve` shows the verdicts the server computes with this module; the only JS copy is of
`summarize_errors` (`placement/harness_node_and_page.mjs`, `summarizeErrors`), because the page collects its WebGPU
errors before any server round trip; tests/checks/test_verdict.py runs both on the same text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# How far a WebGPU run may differ from ORT CPU on the same input, per output dtype (see the module docstring).
GPU_TOLERANCE: dict[str, float] = {"float32": 1e-3, "float16": 1e-2}

BYTE_IDENTICAL = "byte-identical"
AGREES = "agrees"
DIFFERS = "differs"
_RANK = {BYTE_IDENTICAL: 0, AGREES: 1, DIFFERS: 2}


def _num(x: float) -> str:
    return f"{x:.3g}"


@dataclass(frozen=True)
class Verdict:
    """The verdict on one output (or, from `combine`, on all of a model's outputs)."""

    kind: str  # BYTE_IDENTICAL, AGREES or DIFFERS
    max_abs_diff: float | None  # over the positions where both sides are finite; None: not comparable
    tolerance: float  # 0 on the same runtime
    reason: str = ""  # for DIFFERS without a number, or with more than the number to say
    reference: str = "ORT CPU"

    @property
    def passed(self) -> bool:
        return self.kind != DIFFERS

    @property
    def text(self) -> str:
        """The full sentence, as `placement --run` and `verify` print it."""
        if self.kind == BYTE_IDENTICAL:
            return "byte-identical (max |diff| 0)"
        if self.kind == AGREES:
            return (f"agrees with {self.reference} within the GPU tolerance (max |diff| {_num(self.max_abs_diff)}, "
                    f"tolerance {_num(self.tolerance)})")
        return f"differs ({self._why()})"

    @property
    def short(self) -> str:
        """For a table cell: the verdict and its number."""
        if self.kind == BYTE_IDENTICAL:
            return "byte-identical"
        if self.kind == AGREES:
            return f"agrees ({_num(self.max_abs_diff)} <= {_num(self.tolerance)})"
        return f"differs ({self._why()})"

    def _why(self) -> str:
        if self.max_abs_diff is None:
            return self.reason or "not comparable"
        if self.max_abs_diff > self.tolerance:
            base = f"max |diff| {_num(self.max_abs_diff)} > {_num(self.tolerance)}"
        else:
            base = f"max |diff| {_num(self.max_abs_diff)}"
        return f"{base}; {self.reason}" if self.reason else base

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "passed": self.passed, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance, "text": self.text, "short": self.short}


def judge(entry: Mapping[str, Any], *, same_runtime: bool, reference: str = "ORT CPU") -> Verdict:
    """The verdict on one output from its `placement.runner.compare_outputs` entry ({identical, max_abs_diff,
    dtype, nonfinite_mismatch, missing, reference_dtype, reference_shape}).

    `same_runtime`: both sides ran on the same runtime, where only identical bytes pass (tolerance 0)."""
    tol = 0.0 if same_runtime else GPU_TOLERANCE.get(str(entry.get("dtype")), 0.0)
    diff = entry.get("max_abs_diff")
    if entry.get("identical"):
        return Verdict(BYTE_IDENTICAL, 0.0, tol, reference=reference)
    if entry.get("missing"):
        return Verdict(DIFFERS, None, tol, "output missing", reference)
    if diff is None:
        return Verdict(DIFFERS, None, tol, f"{entry.get('dtype')} {entry.get('shape')} vs {reference}'s "
                                           f"{entry.get('reference_dtype')} {entry.get('reference_shape')}", reference)
    if entry.get("nonfinite_mismatch"):
        return Verdict(DIFFERS, diff, tol, f"{entry['nonfinite_mismatch']} non-finite value(s) differ", reference)
    if diff > tol:
        return Verdict(DIFFERS, diff, tol, reference=reference)
    if same_runtime:  # equal values, other bytes
        return Verdict(DIFFERS, diff, tol, "equal values with other bytes (-0.0 vs +0.0 or NaN payloads)", reference)
    return Verdict(AGREES, diff, tol, reference=reference)


def combine(verdicts: Iterable[Verdict]) -> Verdict | None:
    """One verdict for several outputs: the worst kind, with the largest difference (None without outputs)."""
    vs = list(verdicts)
    if not vs:
        return None
    worst = max(vs, key=lambda v: (_RANK[v.kind], v.max_abs_diff is None, v.max_abs_diff or 0.0))
    return worst


def judge_outputs(entries: Mapping[str, Mapping[str, Any]], *, same_runtime: bool,
                  reference: str = "ORT CPU") -> dict[str, Verdict]:
    return {name: judge(e, same_runtime=same_runtime, reference=reference) for name, e in entries.items()}


# --------------------------------------------------------------------------------------------- runtime errors

# One error of a run: JSEP joins its kernels' errors into one message, one paragraph per kernel.
_ERROR_START = re.compile(r"^(?=GPU validation error for kernel |GPUValidationError: |GPUOutOfMemoryError: "
                          r"|GPUInternalError: |device lost )", re.M)
# What differs between repeats of one error: the kernel's node name ("[GatherND] GatherND_723").
_KERNEL_NAME = re.compile(r'kernel "\[([^\]"]+)\] [^"]*"')


def split_errors(text: str) -> list[str]:
    """The errors of one runtime error text (one item when it is not a list of kernel errors)."""
    parts = [p.strip() for p in _ERROR_START.split(text)]
    return [p for p in parts if p] or ([text.strip()] if text.strip() else [])


def summarize_errors(errors: Iterable[str], width: int = 240) -> list[str]:
    """Each distinct error once, in order of first appearance: its first line (cut at `width`) and, when it came
    more than once, "(xN)". Errors that differ only in the kernel's node name are one error."""
    counts: dict[str, list[Any]] = {}
    for e in errors:
        key = _KERNEL_NAME.sub(r'kernel "[\1] *"', e.strip())
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [e.strip(), 1]
    out = []
    for first, n in counts.values():
        line = first.splitlines()[0] if first else ""
        line = line if len(line) <= width else line[:width] + "…"
        out.append(f"{line} (x{n})" if n > 1 else line)
    return out


# --------------------------------------------------------------------------------------------- what to run next


def bisect_hint(model: str, runtime: str, bundle: str | None, *, seed: int | None = None,
                inputs: str | None = None, device_profile: str | None = None) -> str:
    """The `deform-surgeon bisect` command line that finds where a run that differs or fails goes wrong, with the
    arguments of the run that did (`placement --run`, `serve`): the same runtime, bundle, device and inputs."""
    import shlex

    parts = ["deform-surgeon", "bisect", shlex.quote(str(model)), "--runtime", runtime]
    if bundle == "transformers":  # transformers.js's pipeline runs onnxruntime-web's webgpu bundle on the file
        bundle = "webgpu"
    if runtime == "browser" and bundle:
        parts += ["--bundle", bundle]
    if device_profile and device_profile != "spec-default":
        parts += ["--device-profile", shlex.quote(str(device_profile))]
    if inputs:
        parts += ["--inputs", shlex.quote(str(inputs))]
    elif seed is not None:
        parts += ["--seed", str(seed)]
    return " ".join(parts)
