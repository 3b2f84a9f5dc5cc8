"""`deform-surgeon setup`'s work: the npm packages pinned by this package installed into the per-user cache folder
(base/js_runtimes.py says where, and why a per-user cache).

npm runs with `--ignore-scripts`: onnxruntime-node's postinstall downloads CUDA binaries this tool does not need
(its Linux x64 binary with the WebGPU EP is inside the npm tarball). Nothing here downloads a browser: Chromium
comes from the system (`setup --browser` says how to install it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...base import js_runtimes as runtimes

# What `setup` downloads for this package-lock.json, said before it starts: the npm tarballs of the 49 packages it
# installs (sizes from npm's cache after `npm ci`) and the folder they unpack to (`du -sb` of the install);
# onnxruntime-node is most of it (114 MB download, 301 MB on disk), then transformers.js with its own
# onnxruntime-web. tests/base/test_runtimes.py checks the installed size against an install of this lock, so a new lock
# cannot leave these numbers stale.
DOWNLOAD_BYTES = 247_034_791
INSTALLED_BYTES = 784_283_499


def download_note(folder: Path) -> str:
    """What `setup` is about to download, and where to: said before it starts."""
    pins = json.loads((runtimes.PINS_DIR / "package.json").read_text())["dependencies"]
    return (f"setup: downloading {', '.join(f'{k} {v}' for k, v in pins.items())} and their dependencies from npm: "
            f"{DOWNLOAD_BYTES / 1e6:.0f} MB to download, {INSTALLED_BYTES / 1e6:.0f} MB on disk in {folder} "
            "(shared by every install with these pins; remove the folder to free the space)")


def chromium_version() -> str | None:
    try:
        out = subprocess.run([str(runtimes.CHROMIUM), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def install(log: Callable[[str], None] = print) -> Path:
    """Installs the pinned npm packages into `runtimes.cache_dir()` (idempotent; safe when run twice at once).

    npm works in a sibling folder that is renamed into place when complete, under a lock file, so a half-finished
    install (Ctrl-C, a full disk) is never taken for a complete one and never survives as the cache."""
    digest = runtimes.lock_hash()
    target = runtimes.cache_dir()
    if runtimes.installed(target, digest):
        log(f"setup: npm packages already installed in {target}")
        return target
    problem = runtimes.node_problem()
    if problem:
        raise RuntimeError(problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if runtimes.installed(target, digest):  # another setup finished while this one waited
            log(f"setup: npm packages already installed in {target}")
            return target
        work = target.parent / f".{target.name}.partial-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(runtimes.PINS_DIR / name, work / name)
            log(download_note(target))
            log("setup: npm ci --ignore-scripts")
            t0 = time.monotonic()
            npm = subprocess.Popen(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                                   cwd=work, stdout=sys.stderr, stderr=sys.stderr)
            try:
                rc = npm.wait()
            finally:  # interrupted: npm must not go on writing into the folder removed below
                if npm.poll() is None:
                    npm.terminate()
                    npm.wait()
            if rc != 0:
                raise RuntimeError(f"npm ci failed with exit code {rc} (see above)")
            missing = runtimes.missing_files(work)
            if missing:
                raise RuntimeError(f"npm ci finished but files are missing: {', '.join(missing)}")
            (work / "node_modules" / runtimes.STAMP).write_text(digest + "\n")
            shutil.rmtree(target, ignore_errors=True)  # an install of an unfinished older attempt
            os.rename(work, target)
            log(f"setup: npm ci done in {time.monotonic() - t0:.0f} s")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def versions(folder: Path) -> dict[str, str]:
    pins = json.loads((runtimes.PINS_DIR / "package.json").read_text())["dependencies"]
    out = {}
    for pkg in pins:
        try:
            out[pkg] = json.loads((folder / "node_modules" / pkg / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            out[pkg] = "missing"
    return out
