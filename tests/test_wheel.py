"""A wheel that works: `pip install <wheel>` (not editable) into a fresh venv gives a working `deform-surgeon`.

The wheel is built from a copy of the source tree (the checkout is never written to) and installed without its
dependencies into a fresh venv that reads them from this venv's site-packages through a .pth line (quick, and no
registry needed; the package itself comes only from the wheel: the test checks where it is imported from). Then
every subcommand that needs package data runs from the venv's own files: `patch`, `serve --help`, `setup` (the
per-user runtimes; idempotent when `make webgpu-setup` ran), `placement` on a fixture, and `serve` serving its page,
its sample picture, the shared browser modules and onnxruntime-web's files.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "decoder_gathernd.onnx"
pytestmark = pytest.mark.webgpu  # `setup` and `placement` need the npm runtimes (and node)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv, the wheel it was installed from)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "out",
                                                            "*.egg-info", "__pycache__", ".pytest_cache", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(work / "dist"),
                    str(src)], check=True, timeout=600)
    (wheel,) = (work / "dist").glob("deform_surgeon-*.whl")
    env_dir = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                    "--quiet", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    site = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_deps_of_the_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir, wheel


def _run(env_dir: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(env_dir / "bin" / "deform-surgeon"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def test_wheel_carries_the_package_data(venv: tuple[Path, Path]) -> None:
    names = set(zipfile.ZipFile(venv[1]).namelist())
    for f in ("placement/package.json", "placement/package-lock.json", "placement/browser_harness.mjs",
              "placement/browser_device.mjs", "placement/harness_node.mjs", "placement/page.html",
              "serve/page.html", "serve/serve_page.mjs", "serve/headless.mjs", "serve/sample.png"):
        assert f"deform_surgeon/webgpu/{f}" in names, f
    assert not any("node_modules" in n for n in names)


def test_package_comes_from_the_wheel(venv: tuple[Path, Path], tmp_path: Path) -> None:
    r = subprocess.run([str(venv[0] / "bin" / "python"), "-c", "import deform_surgeon; print(deform_surgeon.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path, check=True)
    assert Path(r.stdout.strip()).is_relative_to(venv[0])


def test_patch_and_serve_help(venv: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "patched.onnx"
    r = _run(venv[0], "patch", str(FIXTURE), str(out), cwd=tmp_path)
    assert r.returncode == 0 and out.is_file(), r.stderr
    r = _run(venv[0], "serve", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "ORIGINAL [PATCHED]" in r.stdout


def test_setup_then_placement(venv: tuple[Path, Path], tmp_path: Path) -> None:
    r = _run(venv[0], "setup", cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("runtimes: ") and "onnxruntime-web 1.30.0" in r.stdout
    r = _run(venv[0], "placement", str(FIXTURE), cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CPU nodes" in r.stdout


def test_serve_serves_from_the_installed_package(venv: tuple[Path, Path], tmp_path: Path) -> None:
    proc = subprocess.Popen([str(venv[0] / "bin" / "deform-surgeon"), "serve", str(FIXTURE)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + proc.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        for path in ("/", "/serve_page.mjs", "/browser_device.mjs", "/harness_node_and_page.mjs", "/sample.png",
                     "/config.json", "/model/original.onnx", "/ort/ort.min.mjs", "/ort/ort.webgpu.min.mjs"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path)
            assert conn.getresponse().status == 200, path
            conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
