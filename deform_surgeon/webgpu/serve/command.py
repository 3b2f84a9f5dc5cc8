"""`deform-surgeon serve ORIGINAL [PATCHED]`: the page on 127.0.0.1, in the user's browser or (`--headless`) in
headless Chromium, which writes the page's result JSON and a screenshot and exits.

Exit codes: 0 when the server stopped cleanly (Ctrl-C / SIGTERM) or, with --headless, every model ran on WebGPU
without an error and agreed with ORT CPU within the tolerance, and the patched model's outputs equal the original's
byte for byte; 1 when a headless run did not; 2 for bad input
(missing or non-ONNX model, no single image input, bad device profile) and when the runtimes are not installed;
130 when a headless run is interrupted (its temporary browser profile is removed all the same).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import webbrowser
from pathlib import Path
from typing import Any

from ...base import js_runtimes as runtimes
from ...base.errors import SurgeonError
from ...base.streams import wrote
from ...base.tool import Tool
from ...checks.verdict import split_errors, summarize_errors
from ...commands.args import DEVICE_PROFILE
from ...files.io_check import require_regular_input
from .server import BUNDLES, DEFAULT_RUNS, TRANSFORMERS

HEADLESS_TIMEOUT = 600.0


class ServeTool(Tool):
    """a local page that runs the original and the patched model on your GPU, side by side

    Serves a page on 127.0.0.1 that runs ORIGINAL (and PATCHED) with onnxruntime-web on this browser's WebGPU adapter:
    session creation time, warm inference times, CPU nodes and Memcpy from ORT's log, WebGPU errors, the masks side by
    side, and the outputs' differences from each other and from ORT CPU. Needs `deform-surgeon setup` (and a browser
    with WebGPU).
    """

    name = "serve"

    def add_args(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("original", metavar="ORIGINAL", help="the model as exported (a .onnx file, or a transformers.js "
                       "model folder: config.json beside onnx/, whose onnx/model.onnx it runs)")
        p.add_argument("patched", metavar="PATCHED", nargs="?", default=None, help="its patched version (optional)")
        p.add_argument("--port", type=_port, default=0, help="port on 127.0.0.1 (default 0: a free port, printed)")
        DEVICE_PROFILE.add_to(
            p, help="limits the page requests its WebGPU device with: adapter (default: every limit the browser's "
                    "adapter offers), spec-default (what a page gets without asking), or a `placement "
                    "--device-limits-out` file. Why serve's default differs from every other command's "
                    "(spec-default): this page shows what THIS GPU does with the model, as your own page can when it "
                    "asks for the adapter's limits; patch, budget and placement check a model you ship to every "
                    "user's GPU, so they hold it to the limits any device has")
        p.add_argument("--runs", type=int, default=None,
                       help=f"warm inferences per model (default: {DEFAULT_RUNS['hardware']} on a hardware GPU, "
                            f"{DEFAULT_RUNS['software']} on a software adapter, whose timings are not GPU timings)")
        p.add_argument("--image", metavar="FILE", default=None,
                       help="the picture the page starts with (default: a bundled sample); the page has a picker")
        p.add_argument("--open", action="store_true", help="open the page in the default browser")
        p.add_argument("--bundle", choices=(*BUNDLES, TRANSFORMERS), default=None,
                       help="bundle the page starts with (the page has a picker): webgpu = "
                            "`import 'onnxruntime-web/webgpu'` (default; what transformers.js imports), jsep = "
                            "`import 'onnxruntime-web'`, where the original model's deformable convolutions fail: "
                            "the bug the patch fixes; wasm = `import 'onnxruntime-web/wasm'`, the CPU backend (where "
                            "a browser has no WebGPU the page runs on it whatever is chosen); transformers = "
                            "transformers.js's "
                            "pipeline('background-removal', MODEL, {device: 'webgpu', dtype}) on the model folders "
                            "(only when both models are in one: what `batch DIR OUTDIR` writes)")
        g = p.add_argument_group("headless (CI): run the page in headless Chromium on this machine and exit")
        g.add_argument("--headless", metavar="RESULT.json", help="write the page's result JSON here")
        g.add_argument("--screenshot", metavar="PAGE.png", help="with --headless: also save a screenshot of the page")
        g.add_argument("--no-webgpu", action="store_true",
                       help="with --headless: a Chromium without WebGPU, as many users' browsers are: the page runs "
                            "the models on the wasm backend and says so")
        g.add_argument("--timeout", type=float, default=HEADLESS_TIMEOUT, metavar="SEC",
                       help=f"with --headless: give up after SEC seconds (default {HEADLESS_TIMEOUT:g})")

    def run(self, args: argparse.Namespace) -> int:
        return run_serve(args)


def _port(text: str) -> int:
    """A TCP port: 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number from 0 to 65535")
    return port


def _err(msg: str) -> int:
    print(f"deform-surgeon serve: error: {msg}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from ...graph.device import ADAPTER, resolve_profile
    from .server import ServeApp, ServedModel, make_server

    runtimes.sigterm_raises_interrupt()
    try:
        models = [ServedModel.load("original", args.original)]
        if args.patched:
            models.append(ServedModel.load("patched", args.patched))
        for m in models:
            problem = m.image_input_problem()
            if problem:
                raise SurgeonError(m.path, problem)
        profile = None if args.device_profile in (None, ADAPTER) else resolve_profile(args.device_profile)
        image = Path(args.image).resolve() if args.image else None
        if image is not None:  # a FIFO or a device named as such (io_check), a folder as a folder: not "no such file"
            picture = "give a picture file (PNG, JPEG, ...)"
            require_regular_input(args.image, picture)
            if image.is_dir():
                raise SurgeonError(args.image, "is a folder, not a picture file", picture)
            if not image.is_file():
                raise SurgeonError(args.image, "no such file")
        for path in (args.headless, args.screenshot):
            if path and any(Path(path).resolve() == m.path for m in models):
                raise SurgeonError(path, "output path is one of the models", "choose another name")
            if path and not Path(path).resolve().parent.is_dir():
                raise SurgeonError(path, "folder does not exist")
    except SurgeonError as e:
        return _err(e.one_line())
    for flag, given in (("--screenshot", args.screenshot), ("--no-webgpu", args.no_webgpu)):
        if given and not args.headless:
            return _err(f"{flag} needs --headless RESULT.json")
    if args.runs is not None and args.runs < 1:
        return _err("--runs must be at least 1")
    try:
        app = ServeApp(models, profile, runs=args.runs, image=image)
    except RuntimeError as e:
        return _err(str(e))
    outside = [m for m in models if m.folder is None]
    if args.bundle == TRANSFORMERS and outside:
        return _err(f"{outside[0].path}: --bundle transformers runs model folders (config.json beside onnx/), and "
                    "this model is in none: give the folders, e.g. as `batch DIR OUTDIR` writes them")
    try:
        server = make_server(app, args.port)
    except OSError as e:
        return _err(f"cannot listen on 127.0.0.1:{args.port} ({e.strerror or e})")
    url = f"http://127.0.0.1:{server.server_address[1]}/" + (f"?bundle={args.bundle}" if args.bundle else "")
    try:
        if args.headless:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            return _headless(url, args)
        print(f"serving {url}  (open it in a browser with WebGPU: Chrome/Edge 113+; Ctrl-C stops)", flush=True)
        if args.open:
            webbrowser.open(url)
        server.serve_forever()
    except KeyboardInterrupt:
        print("deform-surgeon serve: stopped", file=sys.stderr)
        if args.headless:
            return 130  # interrupted before the page finished: no result
    finally:
        if args.headless:
            server.shutdown()  # serve_forever runs in its thread; in the foreground it has returned already
        server.server_close()
    return 0


def _headless(url: str, args: argparse.Namespace) -> int:
    """Opens the page in headless Chromium, lets it run both models, saves its result JSON (and screenshot)."""
    from ...base.js_runtimes import harness_env, missing_setup
    from ..placement.runner import run_harness

    msg = missing_setup("browser")
    if msg:
        return _err(msg)
    out = Path(args.headless)
    tmp = Path(tempfile.mkdtemp(prefix="ds-serve-"))
    try:
        query = f"?autorun=1&bundle={args.bundle or BUNDLES[0]}"
        cmd = ["node", str(Path(__file__).resolve().parent / "headless.mjs"), "--url", url.split("?")[0] + query,
               "--out", str(tmp / "result.json"), "--user-data-dir", str(tmp / "chromium-profile"),
               "--chromium", str(runtimes.CHROMIUM), "--timeout", str(args.timeout), "--watch-stdin"]
        if args.screenshot:
            cmd += ["--screenshot", str(tmp / "page.png")]
        if args.no_webgpu:
            cmd.append("--no-webgpu")

        def progress(text: str) -> None:
            print(f"[serve --headless] {text}", file=sys.stderr, flush=True)

        rc, fail, _ = run_harness(cmd, harness_env(tmp), tmp / "browser.log", args.timeout + 60, progress,
                                   marker=str(tmp))
        if not (tmp / "result.json").exists():
            tail = "\n".join((tmp / "browser.log").read_text("utf-8", "replace").strip().splitlines()[-5:]) \
                if (tmp / "browser.log").exists() else ""
            _err(fail or f"headless browser exited with code {rc} and wrote no result: {tail}")
            return 1
        result = json.loads((tmp / "result.json").read_text())
        shutil.move(tmp / "result.json", out)
        if args.screenshot and (tmp / "page.png").exists():
            shutil.move(tmp / "page.png", args.screenshot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wrote(out, args.screenshot if args.screenshot and Path(args.screenshot).exists() else None)
    print(format_result(result))
    print(f"result: {out}" + (f", screenshot: {args.screenshot}" if args.screenshot else ""))
    return 0 if result.get("ok") else 1


def format_result(r: dict[str, Any]) -> str:
    """The page's numbers as a table (one column per model)."""
    models = r.get("models") or []
    a = r.get("adapter") or {}
    lines = [f"adapter: {a.get('vendor')} / {a.get('architecture')} (fallback: {a.get('isFallbackAdapter')}); "
             f"bundle {r.get('bundle')}; device profile {(r.get('profile') or {}).get('name')}"]
    if r.get("no_webgpu"):
        lines.append("no WebGPU adapter: the models ran on onnxruntime-web's wasm backend (CPU), as a page does "
                     "without WebGPU")
    elif r.get("software_adapter"):
        lines.append("software adapter: the timings below are not GPU timings")
    if r.get("error"):
        lines.append(f"page: {r['error']}")

    def row(name: str, fn) -> None:
        lines.append(f"  {name:<26}" + "".join(f"{fn(m)!s:>16}" for m in models))

    def num(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    row("", lambda m: m.get("label"))
    row("ok", lambda m: "yes" if m.get("ok") else "NO")
    row("session creation (s)", lambda m: num(m.get("session_create_s")))
    row("inference min (ms)", lambda m: num(m.get("min_ms"), "{:.1f}"))
    row("inference median (ms)", lambda m: num(m.get("median_ms"), "{:.1f}"))
    row("CPU nodes", lambda m: (m.get("placement") or {}).get("cpu_nodes", "-"))
    row("Memcpy nodes", lambda m: (m.get("placement") or {}).get("memcpy", "-"))
    row("WebGPU errors", lambda m: len(m.get("gpu_errors") or []))
    for m in models:
        lines.append(f"  {m.get('label')} vs ORT CPU: {_verdict(m, 'verdict_vs_cpu')}")
        if m.get("verdict_vs_original"):
            lines.append(f"  {m.get('label')} vs the original: {_verdict(m, 'verdict_vs_original')}")
    for m in models:
        # as the page lists them: the run's error (unless it only repeats the first uncaptured one), then the rest
        own = m.get("error") or ""
        errors = summarize_errors([*([] if own.startswith("uncaptured WebGPU error") else split_errors(own)),
                                   *(m.get("gpu_errors") or [])])
        for e in errors:
            lines.append(f"  {m.get('label')}: {e}")
    for m in models:
        if m.get("ran", True) and not m.get("ok") and m.get("bisect_command"):
            lines.append(f"  {m.get('label')}: find where it goes wrong: {m['bisect_command']}")
    return "\n".join(lines)


def _verdict(m: dict[str, Any], key: str) -> str:
    v = m.get(key)
    return v["text"] if v else "-"
