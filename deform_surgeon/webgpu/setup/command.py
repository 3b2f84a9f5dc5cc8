"""`deform-surgeon setup`: the command (`SetupTool`) that installs the pinned WebGPU runtimes (npm.py) and checks
for the system Chromium."""

from __future__ import annotations

import argparse
import sys

from ...base import js_runtimes as runtimes
from ...base.tool import Tool
from .npm import chromium_version, download_note, install, versions


def run_setup(args: argparse.Namespace) -> int:
    """`deform-surgeon setup [--browser]`: exit 0 when everything asked for is there, 2 when something is not."""
    runtimes.sigterm_raises_interrupt()
    if args.check:
        folder = runtimes.runtimes_dir()
        problems = [] if folder else [f"npm packages not installed in {runtimes.cache_dir()}"]
        problems += [f"missing {f}" for f in (runtimes.missing_files(folder) if folder else [])]
        problems += [p for p in (runtimes.node_problem(), runtimes.browser_problem() if args.browser else None) if p]
        for p in problems:
            print(f"deform-surgeon setup: {p}", file=sys.stderr)
        if folder and not problems:
            print(f"runtimes: {folder}")
        elif not folder:
            print(download_note(runtimes.cache_dir()).replace("setup: downloading", "setup would download"),
                  file=sys.stderr)
        return 2 if problems else 0
    try:
        folder = install(log=lambda m: print(m, file=sys.stderr))
    except (RuntimeError, OSError) as e:
        print(f"deform-surgeon setup: error: {e}", file=sys.stderr)
        return 2
    vs = ", ".join(f"{k} {v}" for k, v in versions(folder).items())
    print(f"runtimes: {folder} ({vs})")
    status = 0
    if args.browser:
        problem = runtimes.browser_problem()
        if problem:
            print(f"deform-surgeon setup: error: {problem}", file=sys.stderr)
            status = 2
        else:
            print(f"browser: {runtimes.CHROMIUM} ({chromium_version() or 'version unknown'}), "
                  f"SwiftShader {runtimes.SWIFTSHADER_ICD}")
    return status


class SetupTool(Tool):
    """install the pinned WebGPU runtimes (npm) that `placement` and `serve` use

    Installs the npm packages pinned by this package (onnxruntime-web/-node, playwright-core, webgpu) into a per-user
    cache folder ($XDG_CACHE_HOME/deform-surgeon/runtimes-<hash>) with `npm ci --ignore-scripts`; idempotent. Needs
    node >= 20 and npm.
    """

    name = "setup"

    def add_args(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--browser", action="store_true",
                       help="also check for the system Chromium (headless browser for `placement --runtime browser` "
                            "and `serve --headless`) and say how to install it when it is missing")
        p.add_argument("--check", action="store_true",
                       help="install nothing: report what is missing (exit 2 if any)")

    def run(self, args: argparse.Namespace) -> int:
        return run_setup(args)
