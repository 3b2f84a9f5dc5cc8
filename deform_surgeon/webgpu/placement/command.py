"""The ``placement`` subcommand: ``deform-surgeon placement MODEL ...`` and ``placement --compare A B``.

Exit codes: 0 when every session (and run, with ``--run``) succeeded; 1 when a session creation or a run
failed (including a run that "succeeded" with an uncaptured WebGPU error); 2 for bad input (missing or
unreadable model file, bad arguments) and when the runtimes are not installed (the message names ``deform-surgeon
setup``). Non-identical outputs are printed prominently but do not change the exit code: they are a
finding about the model, while 1 means the measurement itself could not be completed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import onnx

from ...base.sizes import human
from ...base.streams import wrote
from ...base.tool import Tool
from ...checks.verdict import bisect_hint, combine, judge_outputs, split_errors, summarize_errors
from ...commands.args import DEVICE_PROFILE
from ...graph.blocks import OUTSIDE, count_per_block
from ...graph.device import DeviceProfile
from .result import Placement
from .runner import BUNDLES, DEFAULT_TIMEOUT, RUNTIMES, ModelFolder, SetupMissing, measure_placement


class PlacementTool(Tool):
    """show which nodes a WebGPU EP leaves on the CPU (real onnxruntime-node / onnxruntime-web)

    Create a session on a real WebGPU execution provider and report node placement from ORT's verbose log: CPU
    nodes, Memcpy nodes, CPU op histogram, ops without a WebGPU kernel. Needs `deform-surgeon setup` (--browser for
    --runtime browser).
    """

    name = "placement"

    def add_args(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("model", nargs="?", metavar="MODEL", help="ONNX model to measure")
        p.add_argument(
            "--compare",
            nargs=2,
            metavar=("ORIGINAL", "PATCHED"),
            help="measure two models and print them side by side",
        )
        p.add_argument(
            "--runtime",
            choices=RUNTIMES,
            default="node",
            help="node: onnxruntime-node native WebGPU EP (default); browser: headless Chromium",
        )
        p.add_argument(
            "--bundle",
            choices=BUNDLES,
            default="webgpu",
            help="browser only: webgpu = ort.webgpu.min.mjs (native EP), jsep = ort.min.mjs, "
            "all = ort.all.min.mjs, transformers = transformers.js's pipeline('background-removal') on a model "
            "folder (MODEL: the folder, or a file in its onnx/), wasm = ort.wasm.min.mjs, the CPU backend a page "
            "has without WebGPU (its run and its wasm heap, whose limit is 4 GiB; default: webgpu)",
        )
        p.add_argument("--json", metavar="FILE", help="write the Placement JSON (with --compare: both) to FILE")
        p.add_argument(
            "--run",
            action="store_true",
            help="also run seeded inputs and compare every output byte for byte with ORT CPU",
        )
        p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
        DEVICE_PROFILE.add_to(
            p,
            help="the device the model must fit: spec-default (default: the WebGPU spec's limits, what a page gets "
            "unless it asks for more), adapter (this machine's adapter), or a --device-limits-out file; nodes and "
            "tensors beyond it are reported, and the browser page requests its device with these limits",
        )
        p.add_argument(
            "--device-limits-out",
            metavar="FILE.json",
            help="write the WebGPU adapter info and limits to FILE.json",
        )
        p.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            metavar="SEC",
            help=f"stop the runtime after SEC seconds (default {DEFAULT_TIMEOUT:g})",
        )
        p.add_argument("--log", metavar="FILE", help="keep the raw ORT verbose log in FILE")

    def run(self, args: argparse.Namespace) -> int:
        return run_placement_command(args)


class _Progress:
    """Progress on stderr: one line per step with the elapsed time, so a slow browser start is visible."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        print(
            f"[placement {self.label} {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True
        )


def _err(msg: str) -> None:
    print(f"deform-surgeon: error: {msg}", file=sys.stderr)


class _Stop(Exception):
    """The command stops before it has results: one line on stderr, and the exit code (2: bad input or runtimes not
    set up; 130: interrupted)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def run_placement_command(args: argparse.Namespace) -> int:
    """Checks the arguments, measures each model, prints the report and writes the files asked for; the exit code
    says whether every measurement completed (the module's docstring)."""
    try:
        models = _models_to_measure(args)
        _check_runtime_options(args)
        profile = _checked_files_and_profile(args, models)
        results = _measure_all(args, models, profile)
    except _Stop as e:
        _err(str(e))
        return e.code
    _write_files(args, results)  # (before the report: a stdout that fails costs no file, base/streams.py)
    _print_results(args, models, results)
    return 0 if all(r.ok for r in results) else 1


def _models_to_measure(args: argparse.Namespace) -> list[str]:
    """MODEL or --compare's two, each an existing file; with --bundle transformers the file of each model folder
    that its pipeline loads."""
    if args.compare and args.model:
        raise _Stop("give either MODEL or --compare ORIGINAL PATCHED, not both")
    if not args.compare and not args.model:
        raise _Stop("missing MODEL (or --compare ORIGINAL PATCHED)")
    models = list(args.compare) if args.compare else [args.model]
    if args.runtime == "browser" and args.bundle == "transformers":  # a model folder: the file its pipeline loads
        try:
            models = [str(ModelFolder.of(m).model) for m in models]
        except (FileNotFoundError, ValueError) as e:
            raise _Stop(str(e)) from e
    for m in models:
        if not Path(m).is_file():
            raise _Stop(f"model file not found: {m}")
    return models


def _check_runtime_options(args: argparse.Namespace) -> None:
    """A --bundle other than webgpu with --runtime node is noted, not refused (node's native EP takes no bundle);
    the timeout must be positive."""
    if args.runtime == "node" and args.bundle != "webgpu":
        print(f"note: --bundle {args.bundle} is ignored with --runtime node", file=sys.stderr)
    if args.timeout <= 0:
        raise _Stop("--timeout must be positive")


def _checked_files_and_profile(args: argparse.Namespace, models: list[str]) -> DeviceProfile:
    """The device profile, once no file the command writes is one it reads (checked before any runtime starts,
    which takes seconds to minutes)."""
    from ...base.errors import SurgeonError
    from ...files.io_check import check_io
    from ...graph.device import PROFILE_NAMES, resolve_profile

    try:
        check_io(models, others=[("--json", args.json), ("--device-limits-out", args.device_limits_out),
                                 ("--log", args.log)],
                 other_reads=[(f"the --device-profile file {args.device_profile}", args.device_profile)]
                 if args.device_profile and args.device_profile not in PROFILE_NAMES else [])
        return resolve_profile(args.device_profile)
    except SurgeonError as e:
        raise _Stop(e.one_line()) from e


def _measure_all(args: argparse.Namespace, models: list[str], profile: DeviceProfile) -> list[Placement]:
    """One measurement per model, in turn; with --compare each one's progress and --log file are labelled original
    / patched. A measurement's bad input (unreadable model, runtimes not set up) or Ctrl-C stops the command."""
    results: list[Placement] = []
    for i, m in enumerate(models):
        label = ("original" if i == 0 else "patched") if args.compare else Path(m).name
        log_out = None if not args.log else (args.log if len(models) == 1 else f"{args.log}.{label}")
        try:
            results.append(measure_placement(
                m, runtime=args.runtime, bundle=args.bundle, run=args.run, seed=args.seed, timeout=args.timeout,
                progress=_Progress(label), profile=profile, log_out=log_out))
        except (FileNotFoundError, ValueError, SetupMissing) as e:
            raise _Stop(str(e)) from e
        except KeyboardInterrupt:  # measure_placement has already stopped its processes
            raise _Stop("interrupted", code=130) from None
    return results


def _print_results(args: argparse.Namespace, models: list[str], results: list[Placement]) -> None:
    """The report (one placement, or two side by side), then for each run that went wrong the `bisect` command
    that finds the first node where it does."""
    if args.compare:
        print(format_comparison(results[0], results[1]))
    else:
        print(format_placement(results[0]))
    for m, r in zip(models, results, strict=True):
        if r.run is not None and not run_passed(r):
            hint = bisect_hint(m, args.runtime, args.bundle, seed=args.seed, device_profile=args.device_profile)
            print(f"find where it goes wrong: {hint}")


def _write_files(args: argparse.Namespace, results: list[Placement]) -> None:
    """--json: the Placement (both, with --compare); --device-limits-out: the first runtime's adapter and limits,
    a file --device-profile reads back."""
    if args.json:
        doc: Any = (
            {"original": results[0].to_dict(), "patched": results[1].to_dict()}
            if args.compare
            else results[0].to_dict()
        )
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        wrote(args.json)
    if args.device_limits_out:
        adapter = results[0].adapter
        Path(args.device_limits_out).write_text(
            json.dumps(
                {
                    "runtime": results[0].runtime,
                    "bundle": results[0].bundle,
                    "adapter": adapter,
                    "limits": (adapter or {}).get("limits"),
                },
                indent=2,
            )
            + "\n"
        )
        wrote(args.device_limits_out)


# --------------------------------------------------------------------------------------------------- output


def run_passed(p: Placement) -> bool:
    """The run succeeded and every output agrees with ORT CPU (else `bisect` is suggested, with its arguments)."""
    v = combine(judge_outputs((p.run or {}).get("outputs") or {}, same_runtime=False).values())
    return bool(p.run and p.run.get("ok") and v is not None and v.passed)


def _adapter_line(a: dict[str, Any] | None) -> str:
    if not a:
        return "adapter: unknown"
    lim = a.get("limits") or {}
    fb = " (fallback adapter)" if a.get("isFallbackAdapter") else ""
    return (
        f"adapter: {a.get('vendor') or '?'} {a.get('architecture') or '?'}{fb}; "
        f"maxBufferSize {lim.get('maxBufferSize')}, maxStorageBufferBindingSize "
        f"{lim.get('maxStorageBufferBindingSize')}, maxComputeWorkgroupStorageSize "
        f"{lim.get('maxComputeWorkgroupStorageSize')}"
    )


def _profile_lines(p: Placement) -> list[str]:
    """Which device profile was applied, and every node or tensor beyond it."""
    if not p.device_profile:
        return []
    lim = p.device_profile["limits"]
    how = "requested by the page" if p.applied_limits else "checked statically"
    lines = [f"profile: {p.device_profile['name']} ({how}): maxStorageBuffersPerShaderStage "
             f"{lim['maxStorageBuffersPerShaderStage']}, maxBufferSize {lim['maxBufferSize']}, "
             f"maxStorageBufferBindingSize {lim['maxStorageBufferBindingSize']}"]
    v = p.limit_violations
    if not v:
        lines.append("over device limits: none")
        return lines
    lines.append(f"OVER DEVICE LIMITS: {len(v)} (the model cannot run on a device with this profile; "
                 "`deform-surgeon patch` fits the storage buffers, `--max-buffer` splits deform blocks over a size)")
    for x in v[:10]:
        if x["kind"] == "storage_buffers":
            lines.append(f"  {x['op']} '{x['node']}' binds {x['count']} storage buffers > {x['limit']}")
        else:
            lines.append(f"  tensor '{x['tensor']}' ({x['producer']}) is {x['bytes']} bytes > {x['limit']}")
    if len(v) > 10:
        lines.append(f"  ... {len(v) - 10} more (--json FILE lists all)")
    return lines


def heap_text(heap: dict[str, Any]) -> str:
    """The wasm heap's sizes, against the 4 GiB a 32-bit wasm heap can reach, and the grows the engine refused:
    an allocation that finds no room there is the run's `std::bad_alloc`."""
    steps = [f"{human(h['bytes'])} after the {step}" for step, h in
             (("session", heap.get("after_session")), ("run", heap.get("after_run"))) if h]
    last = heap.get("after_run") or heap.get("after_session") or {}
    text = ", ".join(steps) + (f" (the limit {human(last['limit'])})" if last.get("limit") else "")
    refused = last.get("failed_grows") or []
    if refused:
        text += f"; refused {len(refused)} grow(s), the smallest to {human(min(f['asked'] for f in refused))}"
    return text


def _where(p: Placement) -> str:
    return p.runtime if p.runtime == "node" else f"browser/{p.bundle}"


def format_placement(p: Placement) -> str:
    """Readable report of one Placement (the JSON has everything; this is what a person scans)."""
    lines = [f"model:   {p.model}", f"runtime: {_where(p)} -> {p.gpu_provider or '?'}"]
    t = p.timings.get("session_create_s")
    lines.append(
        f"session: {'ok' if p.session_ok else 'FAILED'}" + (f" in {t:.2f} s" if t is not None else "")
    )
    if p.error:
        lines += _error_lines("error:  ", p.error)
    lines.append(_adapter_line(p.adapter))
    if p.peak_rss_mib:  # the renderer holds the page's JS and wasm heaps; the GPU process what WebGPU uploads
        lines.append("memory:  peak RSS " + ", ".join(f"{k} {v:,.0f} MiB" for k, v in sorted(p.peak_rss_mib.items())))
    lines += [] if p.bundle == "wasm" else _profile_lines(p)
    if p.wasm_heap:
        lines.append(f"wasm heap: {heap_text(p.wasm_heap)}")
    if p.placement_logged:
        per = ", ".join(f"{ep} {n}" for ep, n in p.nodes_by_provider.items())
        lines.append(f"nodes:   {p.total_nodes} ({per})")
        kinds = ", ".join(f"{k} {v}" for k, v in p.memcpy_by_kind.items())
        lines.append(
            f"CPU nodes: {p.cpu_nodes}    Memcpy nodes: {p.memcpy}" + (f" ({kinds})" if kinds else "")
        )
        if p.cpu_ops:
            lines.append("CPU ops:")
            w = max(len(op) for op in p.cpu_ops)
            lines += [f"  {op:<{w}}  {n}" for op, n in p.cpu_ops.items()]
        if p.kernel_not_found:
            shown = ", ".join(f"{k['op']} ({k['node']})" for k in p.kernel_not_found[:10])
            more = f" and {len(p.kernel_not_found) - 10} more" if len(p.kernel_not_found) > 10 else ""
            lines.append(f"no WebGPU kernel: {shown}{more}")
    else:
        lines.append("placement: not in the log")
    if p.run is not None:
        r = p.run
        lines.append(
            f"run:     {'ok' if r.get('ok') else 'FAILED'}"
            + (f" in {p.timings['run_s']:.2f} s" if "run_s" in p.timings else "")
        )
        if r.get("error"):
            lines += _error_lines("run error:", r["error"])
        for name, v in judge_outputs(r.get("outputs") or {}, same_runtime=False).items():
            o = r["outputs"][name]
            lines.append(f"  {name} ({o.get('dtype')} {o.get('shape')}): {v.text}")
        if r.get("mask"):
            m = r["mask"]
            said = ("not compared (the picture's size is not the output's)" if m["max_level_diff"] is None else
                    f"at most {m['max_level_diff']} level(s) of 255 from the mask of ORT CPU's output "
                    f"({m['differing_pixels']} pixel(s) differ)")
            lines.append(f"  pipeline's mask (alpha, {m['shape']}): {said}")
    for n in p.notes:
        lines.append(f"note:    {n}")
    return "\n".join(lines)


def per_block(p: Placement) -> dict[str, tuple[int, int]]:
    """CPU nodes and Memcpy nodes of a placement, per deform block of its model (`blocks.count_per_block`)."""
    model = onnx.load(p.model, load_external_data=False)
    return count_per_block(model, p.cpu_node_names, p.memcpy_tensors)


def _block_rows(a: Placement, b: Placement) -> list[tuple[str, str, str]]:
    if not (a.model and b.model and Path(a.model).is_file() and Path(b.model).is_file()):
        return []
    pa, pb = per_block(a), per_block(b)
    labels = sorted(set(pa) | set(pb), key=lambda k: (k == OUTSIDE, [int(t) if t.isdigit() else t
                                                                    for t in re.split(r"(\d+)", k)]))
    rows = [("per deform block (CPU nodes / Memcpy):", "", "")]
    for k in labels:
        ca, ma = pa.get(k, (0, 0))
        cb, mb = pb.get(k, (0, 0))
        rows.append((f"  {k}", f"{ca} / {ma}", f"{cb} / {mb}"))
    return rows


def format_comparison(a: Placement, b: Placement) -> str:
    """Side-by-side table of two placements: the patched model should have no CPU nodes and no Memcpy."""
    rows: list[tuple[str, str, str]] = [
        ("runtime", _where(a), _where(b)),
        ("session", "ok" if a.session_ok else "FAILED", "ok" if b.session_ok else "FAILED"),
        ("nodes", str(a.total_nodes), str(b.total_nodes)),
        ("CPU nodes", str(a.cpu_nodes), str(b.cpu_nodes)),
        ("Memcpy nodes", str(a.memcpy), str(b.memcpy)),
        ("no WebGPU kernel", str(len(a.kernel_not_found)), str(len(b.kernel_not_found))),
        ("over device limits", str(len(a.limit_violations)), str(len(b.limit_violations))),
    ]
    for step in ("session", "run") if a.wasm_heap or b.wasm_heap else ():  # the heap's peak after each step
        rows.append((f"wasm heap after the {step}", *(human(((p.wasm_heap or {}).get(f"after_{step}") or {})
                                                            .get("bytes")) for p in (a, b))))
    if a.run is not None or b.run is not None:

        def rv(p: Placement) -> str:
            if p.run is None:
                return "-"
            if not p.run.get("ok"):
                return "FAILED"
            v = combine(judge_outputs(p.run.get("outputs") or {}, same_runtime=False).values())
            return v.short if v else "-"

        rows.append(("run vs ORT CPU", rv(a), rv(b)))
    ops = list(dict.fromkeys([*a.cpu_ops, *b.cpu_ops]))
    if ops:
        rows.append(("CPU ops:", "", ""))
        rows += [(f"  {op}", str(a.cpu_ops.get(op, 0)), str(b.cpu_ops.get(op, 0))) for op in ops]
    rows += _block_rows(a, b)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("original"), *(len(r[1]) for r in rows))
    out = [f"{'':<{w0}}  {'original':>{w1}}  patched"]
    out += [f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}" for r in rows]
    for label, p in (("original", a), ("patched", b)):
        if p.error:
            out += _error_lines(f"{label} error:", p.error)
        if p.run and p.run.get("error"):
            out += _error_lines(f"{label} run error:", p.run["error"])
    return "\n".join(out)


def _error_lines(head: str, text: str) -> list[str]:
    """A runtime error as `head` and its errors, each distinct one once with its count (the whole text is in the
    --json file): JSEP's error for one failed shader repeats it for every kernel that used it."""
    errors = split_errors(text)
    lines = summarize_errors(errors)
    if len(errors) <= 1:
        return [f"{head} {text.strip()}"]
    return [f"{head} {len(errors)} errors, {len(lines)} distinct (full text: --json FILE)"] + [f"  {x}" for x in lines]
