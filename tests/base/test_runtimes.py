"""`deform-surgeon setup` and the one lookup of the pinned JS runtimes (deform_surgeon/base/js_runtimes.py).

The runtimes are found in the per-user cache keyed by the lock's hash (or a checkout's in-tree install), only when
stamped with that hash; without node, or without Chromium for --browser, setup says how to install them on this
OS and exits 2. Installing for real is exercised by `make webgpu-setup` and by tests/test_wheel.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deform_surgeon.base import js_runtimes as runtimes
from deform_surgeon.webgpu import setup


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(runtimes, "IN_TREE", tmp_path / "no-checkout")
    return tmp_path / "cache"


def test_cache_folder_is_keyed_by_the_lock(empty_cache: Path) -> None:
    digest = hashlib.sha256((runtimes.PINS_DIR / "package-lock.json").read_bytes()).hexdigest()
    assert runtimes.cache_dir() == empty_cache / "deform-surgeon" / f"runtimes-{digest[:16]}"
    assert runtimes.runtimes_dir() is None
    assert runtimes.node_modules() == runtimes.cache_dir() / "node_modules"


def test_only_a_folder_stamped_with_this_lock_counts(empty_cache: Path) -> None:
    stamp = runtimes.cache_dir() / "node_modules" / runtimes.STAMP
    stamp.parent.mkdir(parents=True)
    stamp.write_text("0" * 64 + "\n")  # an install for another package-lock.json (or an unfinished one)
    assert runtimes.runtimes_dir() is None
    stamp.write_text(runtimes.lock_hash() + "\n")
    assert runtimes.runtimes_dir() == runtimes.cache_dir()


def test_in_tree_install_of_a_checkout_still_counts(empty_cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "node_modules").mkdir(parents=True)
    (checkout / "node_modules" / runtimes.STAMP).write_text(runtimes.lock_hash())
    monkeypatch.setattr(runtimes, "IN_TREE", checkout)
    assert runtimes.runtimes_dir() == checkout


def _setup(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", "setup", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_setup_without_node_says_how_to_install_it(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = _setup([], env)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("deform-surgeon setup: error: node and npm are needed")
    assert "install" in line and "nodejs npm" in line
    assert not any((tmp_path / "cache").rglob("*.partial-*")), "no half-finished install left behind"


def test_setup_check_reports_what_is_missing(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = _setup(["--check"], env)
    assert r.returncode == 2
    assert "npm packages not installed in" in r.stderr and str(tmp_path / "cache") in r.stderr
    assert not (tmp_path / "cache").exists(), "--check installs nothing"


def test_browser_hint_names_the_package_for_this_os(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(runtimes, "CHROMIUM", tmp_path / "chromium")
    problem = runtimes.browser_problem()
    assert problem is not None and str(tmp_path / "chromium") in problem
    if Path("/etc/debian_version").exists():
        assert "sudo apt-get install chromium" in problem


@pytest.mark.webgpu  # needs node and npm (and starts a real `npm ci`, stopped at once)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_setup_leaves_no_partial_install(sig: signal.Signals, tmp_path: Path) -> None:
    if runtimes.node_problem():
        pytest.skip(runtimes.node_problem())
    cache = tmp_path / "cache"
    # SIGINT as a terminal delivers it, even when pytest itself runs in the background (where it is ignored)
    proc = subprocess.Popen([sys.executable, "-m", "deform_surgeon", "setup"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not list(cache.glob("deform-surgeon/.runtimes-*.partial-*/package-lock.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "setup never started its install"
            time.sleep(0.05)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    left = sorted(p.name for p in (cache / "deform-surgeon").iterdir())
    assert left == [f".{runtimes.cache_dir().name}.lock"], left  # the lock file only: no partial, no install
    assert "interrupted" in proc.stderr.read()


def test_setup_says_what_it_will_download_before_it_does(tmp_path: Path) -> None:
    """Size and folder, before npm starts (--check says the same without installing anything)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = _setup(["--check"], env)
    folder = tmp_path / "cache" / "deform-surgeon" / runtimes.cache_dir().name
    assert "setup would download onnxruntime-node 1.30.0, onnxruntime-web 1.30.0" in r.stderr
    assert f"{setup.DOWNLOAD_BYTES / 1e6:.0f} MB to download, {setup.INSTALLED_BYTES / 1e6:.0f} MB on disk " \
           f"in {folder}" in r.stderr
    bare = tmp_path / "bin"  # a real install without node stops before downloading: no size promised then
    bare.mkdir()
    r = _setup([], {**env, "PATH": str(bare)})
    assert r.returncode == 2 and "MB to download" not in r.stderr


@pytest.mark.skipif(runtimes.runtimes_dir() is None or runtimes.runtimes_dir() == runtimes.IN_TREE,
                    reason="no `deform-surgeon setup` install of this lock")
def test_the_size_setup_announces_is_the_size_it_installs() -> None:
    folder = runtimes.runtimes_dir()
    size = sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    assert abs(size - setup.INSTALLED_BYTES) < 0.05 * setup.INSTALLED_BYTES, size


@pytest.mark.parametrize("os_release, platform, want", [
    ('ID=debian\n', "linux", "sudo apt-get install chromium libvulkan1"),
    ('ID=ubuntu\nID_LIKE=debian\n', "linux", "sudo apt-get install chromium libvulkan1"),
    ('ID=fedora\n', "linux", "sudo dnf install chromium vulkan-loader"),
    ('', "darwin", "brew install --cask chromium"),
    ('ID=arch\nPRETTY_NAME="Arch Linux"\n', "linux", "with Arch Linux's package manager"),
])
def test_setup_browser_says_how_to_get_chromium_on_each_os(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           os_release: str, platform: str, want: str) -> None:
    release = tmp_path / "os-release"
    release.write_text(os_release)
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: real(release if str(self) == "/etc/os-release"
                                                                      else self, *a, **k))
    monkeypatch.setattr(runtimes.sys, "platform", platform)
    monkeypatch.setattr(runtimes, "CHROMIUM", tmp_path / "chromium")
    problem = runtimes.browser_problem()
    assert problem.startswith(f"Chromium not found ({tmp_path / 'chromium'}") and want in problem, problem
    assert ("Debian's layout" in problem) == ("apt-get" not in want)
