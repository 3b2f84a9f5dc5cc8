"""Where the pinned JS runtimes live, whether they are there (`missing_setup`), and how a harness runs on them;
`deform-surgeon setup` (webgpu/setup/) installs them.

Why a per-user cache: `placement` and `serve` drive onnxruntime-web/-node, playwright-core and dawn.node from npm
(the Python onnxruntime wheel has no WebGPU EP). A pip-installed package folder may be read-only and is replaced on
every upgrade, so the packages are installed once per user into `$XDG_CACHE_HOME/deform-surgeon/runtimes-<hash>`,
keyed by the sha256 of the package-lock.json shipped with this package: another pin gets another folder, and two
installs of the same version share one. A checkout that ran the older `make webgpu-setup` (packages inside
deform_surgeon/webgpu/placement/node_modules, stamped with the lock's hash) keeps working: `runtimes_dir()` is the one
lookup both use.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PINS_DIR = Path(__file__).resolve().parents[1] / "webgpu" / "placement"  # package.json + lock (package data)
IN_TREE = PINS_DIR  # a checkout's older install location: PINS_DIR/node_modules
STAMP = ".deform-surgeon-setup.sha256"
SETUP_COMMAND = "deform-surgeon setup"
CHROMIUM = Path("/usr/bin/chromium")
SWIFTSHADER_ICD = Path("/usr/lib/chromium/vk_swiftshader_icd.json")
CHROMIUM_LIBDIR = Path("/usr/lib/chromium")
HARNESS_DIR = PINS_DIR  # the JS harnesses (*.mjs) ship beside the pins
MIN_NODE_MAJOR = 20  # playwright-core 1.65 declares engines.node >= 20

# What the harnesses load, relative to the runtimes folder: a folder without one of them is not an install.
REQUIRED_FILES = (
    "node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs",
    "node_modules/onnxruntime-web/dist/ort.min.mjs",
    "node_modules/onnxruntime-web/dist/ort.all.min.mjs",
    "node_modules/onnxruntime-node/bin/napi-v6/linux/x64/onnxruntime_binding.node",
    "node_modules/playwright-core/package.json",
    "node_modules/@huggingface/transformers/dist/transformers.js",
    "node_modules/@huggingface/transformers/node_modules/onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.wasm",
    "node_modules/webgpu/package.json",
)


def lock_hash() -> str:
    return hashlib.sha256((PINS_DIR / "package-lock.json").read_bytes()).hexdigest()


def cache_dir() -> Path:
    """The per-user folder `deform-surgeon setup` installs the pinned packages into."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deform-surgeon" / f"runtimes-{lock_hash()[:16]}"


def installed(folder: Path, digest: str) -> bool:
    try:
        return (folder / "node_modules" / STAMP).read_text().strip() == digest
    except OSError:
        return False


def runtimes_dir() -> Path | None:
    """The folder whose node_modules holds the packages pinned by this package's lock, or None if not installed.

    The per-user cache first (what `deform-surgeon setup` writes), then a checkout's in-tree install."""
    digest = lock_hash()
    for folder in (cache_dir(), IN_TREE):
        if installed(folder, digest):
            return folder
    return None


def node_modules() -> Path:
    """node_modules of the installed runtimes (the cache's, where it would be, when nothing is installed)."""
    return (runtimes_dir() or cache_dir()) / "node_modules"


def missing_files(folder: Path) -> list[str]:
    return [f for f in REQUIRED_FILES if not (folder / f).is_file()]


def node_problem() -> str | None:
    """None when a usable node and npm are on PATH, else what is wrong and how to fix it on this OS."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return f"node and npm are needed ({install_hint('nodejs npm')})"
    try:
        out = subprocess.run(["node", "-p", "process.versions.node"], capture_output=True, text=True, timeout=30)
        major = int(out.stdout.strip().split(".")[0])
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return f"cannot run node ({e})"
    if major < MIN_NODE_MAJOR:
        return f"node {out.stdout.strip()} is too old; playwright-core needs node >= {MIN_NODE_MAJOR}"
    return None


def _os_release() -> dict[str, str]:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip().strip('"')
    return out


def _os_family() -> str:
    """debian (Debian, Ubuntu and their derivatives), fedora (Fedora, RHEL, CentOS), macos, or '' (another)."""
    if sys.platform == "darwin":
        return "macos"
    rel = _os_release()
    family = " ".join([rel.get("ID", ""), rel.get("ID_LIKE", "")])
    if "debian" in family or "ubuntu" in family:
        return "debian"
    if "fedora" in family or "rhel" in family or "centos" in family:
        return "fedora"
    return ""


# The same packages by OS family: (Debian name, Fedora name, Homebrew command).
_PACKAGES = {"nodejs npm": ("nodejs npm", "nodejs npm", "brew install node"),
             "chromium libvulkan1": ("chromium libvulkan1", "chromium vulkan-loader", "brew install --cask chromium")}


def install_hint(debian_packages: str) -> str:
    """How to install `debian_packages` (Debian names) on this OS, as one phrase."""
    debian, fedora, brew = _PACKAGES.get(debian_packages, (debian_packages, debian_packages, None))
    family = _os_family()
    if family == "debian":
        return f"install with: sudo apt-get install {debian}"
    if family == "fedora":
        return f"install with: sudo dnf install {fedora}"
    if family == "macos" and brew:
        return f"install with Homebrew: {brew}"
    name = _os_release().get("PRETTY_NAME") or sys.platform
    return (f"install the packages Debian calls '{debian}' (Fedora: '{fedora}') with {name}'s package manager")


def browser_problem() -> str | None:
    """None when the system Chromium (with its SwiftShader Vulkan ICD) is there, else how to get it."""
    missing = [str(p) for p in (CHROMIUM, SWIFTSHADER_ICD) if not p.exists()]
    if not missing:
        return None
    hint = install_hint("chromium libvulkan1")
    if _os_family() != "debian":  # the headless runs use Debian's layout; say so rather than let a user guess
        hint += (f"; the headless runs look for Debian's layout ({CHROMIUM} and {SWIFTSHADER_ICD}), so on this OS "
                 "`serve` without --headless, in your own browser, is the way to see the page")
    return f"Chromium not found ({', '.join(missing)}); {hint}"




def sigterm_raises_interrupt() -> None:
    """SIGTERM ends the command like Ctrl-C (KeyboardInterrupt), so that every `finally` removes its temp files."""
    import signal

    def _raise(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)




# ------------------------------------------------------------------------- the harnesses and their runtime
# Here, not in placement/runner.py: `device.resolve_profile('adapter')` probes the adapter, and the runner
# itself needs device profiles; both sit on top of this module.


def _pinned_versions() -> dict[str, str]:
    try:
        return json.loads((HARNESS_DIR / "package.json").read_text())["dependencies"]
    except (OSError, ValueError, KeyError):
        return {}


def missing_setup(runtime: str | None = None) -> str | None:
    """None when the runtimes are installed, else a one-line message naming ``deform-surgeon setup``.

    ``runtime`` ("node" or "browser") limits the check to what that runtime needs; None checks both. Versions
    are compared with the pins of package.json because a placement measured on another ORT build would not
    be comparable across commits.
    """
    missing: list[str] = []
    modules = node_modules()
    if shutil.which("node") is None:
        missing.append("node")
    need_node = runtime in (None, "node")
    need_browser = runtime in (None, "browser")
    files: list[Path] = [HARNESS_DIR / "harness_node.mjs"]
    if need_browser:
        files += [
            CHROMIUM,
            modules / "playwright-core" / "package.json",
            modules / "onnxruntime-web" / "dist" / "ort.webgpu.min.mjs",
            modules / "onnxruntime-web" / "dist" / "ort.min.mjs",
            modules / "onnxruntime-web" / "dist" / "ort.all.min.mjs",
        ]
    if need_node:
        files += [
            SWIFTSHADER_ICD,
            modules / "onnxruntime-node" / "bin" / "napi-v6" / "linux" / "x64" / "onnxruntime_binding.node",
            modules / "webgpu" / "package.json",
        ]
    if not modules.is_dir():
        missing.append(f"npm packages ({modules})")
        files = [f for f in files if not f.is_relative_to(modules)]
    for f in files:
        if not f.exists():
            missing.append(str(f.relative_to(HARNESS_DIR)) if f.is_relative_to(HARNESS_DIR) else str(f))
    pins = _pinned_versions()
    for pkg in ("onnxruntime-web", "onnxruntime-node", "playwright-core", "webgpu"):
        pj = modules / pkg / "package.json"
        if pkg in pins and pj.exists():
            try:
                got = json.loads(pj.read_text()).get("version")
            except (OSError, ValueError):
                got = None
            if got != pins[pkg]:
                missing.append(f"{pkg}@{pins[pkg]} (found {got})")
    if not missing:
        return None
    command = SETUP_COMMAND + (" --browser" if need_browser else "")
    return f"WebGPU runtimes not installed ({', '.join(missing)}); run `{command}`"


def harness_env(tmp: Path) -> dict[str, str]:
    """The environment a harness (node or Chromium) runs in: the runtimes folder, SwiftShader, a Vulkan loader."""
    env = dict(os.environ)
    xdg = tmp / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    env["XDG_RUNTIME_DIR"] = str(xdg)  # Dawn's Vulkan backend wants a writable one
    env["DEFORM_SURGEON_RUNTIMES"] = str(node_modules().parent)  # where the harnesses find the packages
    env["VK_ICD_FILENAMES"] = str(SWIFTSHADER_ICD)  # SwiftShader; Dawn rejects Mesa lavapipe
    if ctypes.util.find_library("vulkan") is None and CHROMIUM_LIBDIR.is_dir():
        # No system Vulkan loader (Debian libvulkan1): fall back to the one Chromium ships.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(CHROMIUM_LIBDIR), env.get("LD_LIBRARY_PATH", "")) if p
        )
    return env


def probe_adapter(timeout: float = 60.0) -> tuple[dict[str, Any] | None, str | None]:
    """(adapter description, None) of the WebGPU adapter a Dawn instance in Node gets here, or (None, error)."""
    msg = missing_setup("node")
    if msg:
        return None, msg
    tmp = Path(tempfile.mkdtemp(prefix="ds-probe-"))
    try:
        r = subprocess.run(["node", str(HARNESS_DIR / "adapter_probe_node.mjs")], capture_output=True, text=True,
                           env=harness_env(tmp), cwd=str(HARNESS_DIR), timeout=timeout)
        doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    except (subprocess.TimeoutExpired, ValueError, OSError) as e:
        return None, f"adapter probe failed: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return doc.get("adapter"), doc.get("error") or (None if doc.get("adapter") else "no adapter")
