"""What a comparison found: the first mismatch, the result with its one-line summary, and the exact byte comparison
that decides it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .verdict import BYTE_IDENTICAL, Verdict, judge

if TYPE_CHECKING:  # (numpy is imported where it is used: `import deform_surgeon` stays light, see __init__)
    import numpy as np


@dataclass(frozen=True)
class Mismatch:
    iteration: int
    output: str
    problem: str
    index: tuple[int, ...] | None = None
    original: str | None = None
    patched: str | None = None
    threads: int | None = None  # the intra-op thread count of the runs that differed (None: ORT's default)

    def text(self) -> str:
        if not self.output:  # not about one output (the models' inputs differ)
            return self.problem
        at = "" if self.threads is None else f", {self.threads} intra-op thread(s)"
        where = f"output '{self.output}' (iteration {self.iteration}{at})"
        if self.index is None:
            return f"{where}: {self.problem}"
        return f"{where}: {self.problem} at index {list(self.index)}: original {self.original}, patched {self.patched}"


@dataclass
class VerifyResult:
    original: str
    patched: str
    iterations: int
    seed: int
    opt_level: str
    val_range: dict[str, tuple[float, float]]
    identical: bool = False
    polygraphy_passed: bool = False
    outputs_compared: list[str] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    # peak RSS in bytes of each model's run ("original", "patched": each in its own process where it can fork, else
    # this process's peak so far) and of the calling process, the comparison done ("caller")
    peak_rss: dict[str, int] = field(default_factory=dict)
    # `segment_memory`: each model was run in segments of at most this many bytes of tensors
    # (checks/run_in_segments.py); how many
    # and the most bytes the tensors between its segments held on disk at once
    segment_memory: int | None = None
    segments: dict[str, int] = field(default_factory=dict)
    segment_disk: dict[str, int] = field(default_factory=dict)
    # the ORT intra-op thread counts both models were run and compared at, in order (None: ORT's default, one
    # per physical core of this machine): a Conv's or GEMM's bytes depend on it (docs/runtime-facts.md)
    threads: list[int] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["val_range"] = {k: list(v) for k, v in self.val_range.items()}
        return d

    def summary(self) -> str:
        if self.identical:
            return (f"verify: PASSED: {len(self.outputs_compared)} output(s) {Verdict(BYTE_IDENTICAL, 0.0, 0.0).text} "
                    f"on {self.iterations} "
                    f"seeded input(s) (seed {self.seed}, ORT CPU, opt level '{self.opt_level}'{self.segment_text()}, "
                    f"{self.threads_text()}; "
                    f"polygraphy atol=0 rtol=0: {'passed' if self.polygraphy_passed else 'failed (NaNs)'})"
                    f"{self.peak_text()}")
        return f"verify: FAILED: {self.mismatch.text() if self.mismatch else 'outputs differ'}{self.peak_text()}"

    def threads_text(self) -> str:
        """"intra-op threads 1, 4, 8" or "ORT's default intra-op threads": the thread counts compared."""
        if not self.threads:
            return "ORT's default intra-op threads"
        return f"intra-op thread{'s' if len(self.threads) > 1 else ''} {', '.join(map(str, self.threads))}"

    def segment_text(self) -> str:
        """", in segments of at most 6.00 GB (5.59 GiB) of tensors: the original in 41 (at most 17.65 GB (16.44 GiB)
        on disk between them), the patched in 35 (...)"."""
        if self.segment_memory is None:
            return ""
        from ..base.sizes import human

        counts = ", ".join(f"the {k} in {n} (at most {human(self.segment_disk.get(k, 0))} on disk between them)"
                           for k, n in self.segments.items())
        return f", in segments of at most {human(self.segment_memory)} of tensors: {counts}"

    def peak_text(self) -> str:
        """"; peak RSS 7.90 GB (the original's run; the patched's 2.41 GB, the caller's 0.31 GB)": what the machine
        needed, the models run one after the other (the caller's: the process that compared them, a `patch` that
        asked for the comparison included)."""
        if not self.peak_rss:
            return ""
        top = max(self.peak_rss, key=self.peak_rss.get)
        rest = ", ".join(f"the {k}'s {self.peak_rss[k] / 1e9:.2f} GB" for k in self.peak_rss if k != top)
        what = "the caller" if top == "caller" else f"the {top}'s run"
        return f"; peak RSS {self.peak_rss[top] / 1e9:.2f} GB ({what}{'; ' + rest if rest else ''})"


def compare_bytes(orig_iters, patch_iters, result: VerifyResult) -> Mismatch | None:
    """Exact comparison of every output of every iteration: names, dtypes, shapes, then bytes."""
    import numpy as np

    first: Mismatch | None = None
    for it, (a_out, b_out) in enumerate(zip(orig_iters, patch_iters, strict=True)):
        a_names, b_names = set(a_out.keys()), set(b_out.keys())
        if a_names != b_names:
            return Mismatch(it, ", ".join(sorted(a_names ^ b_names)), "output present in only one model")
        for name in sorted(a_names):
            a, b = np.asarray(a_out[name]), np.asarray(b_out[name])
            if name not in result.outputs_compared:
                result.outputs_compared.append(name)
            if a.dtype != b.dtype:
                return Mismatch(it, name, f"dtype differs: {a.dtype} vs {b.dtype}")
            if a.shape != b.shape:
                return Mismatch(it, name, f"shape differs: {list(a.shape)} vs {list(b.shape)}")
            diff = _max_abs_diff(a, b)
            result.max_abs_diff[name] = max(result.max_abs_diff.get(name, 0.0), diff)
            if a.tobytes() != b.tobytes() and first is None:
                av = a.reshape(-1).view(np.uint8).reshape(a.size, -1) if a.size else a
                bv = b.reshape(-1).view(np.uint8).reshape(b.size, -1) if b.size else b
                flat = int(np.nonzero((av != bv).any(axis=1))[0][0])
                idx = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.shape else ()
                verdict = judge({"max_abs_diff": diff, "dtype": str(a.dtype)}, same_runtime=True)
                first = Mismatch(it, name, verdict.text, idx,
                                 repr(a.reshape(-1)[flat].item()), repr(b.reshape(-1)[flat].item()))
    return first


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    import numpy as np

    if a.size == 0 or a.dtype == np.bool_:
        return 0.0 if a.size == 0 else float(np.count_nonzero(a != b))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[~np.isnan(d)]
    return float(d.max()) if d.size else (0.0 if np.array_equal(a, b, equal_nan=True) else math.inf)
