"""Ctrl-C and SIGTERM to a running command, to its background child, during start-up and to `batch` and its
workers: one line, exit 130 / 143, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from helpers import FIXTURES, copy_fixture
from helpers.bad_input import DS, external, state


# --------------------------------------------------------------------------------------------------- signals
def _signal_during(tmp_path: Path, argv: list, wait_for: str, sig: int = signal.SIGTERM
                   ) -> subprocess.CompletedProcess:
    """Start a command, send `sig` as soon as a file whose name starts with `wait_for` appears, wait for the end."""
    proc = subprocess.Popen([*DS, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(wait_for) for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_during_patch_leaves_no_temporary_file(tmp_path):
    """SIGTERM is handled like Ctrl-C: the temporary model and data files are removed, exit 143, one line."""
    onnx.save(onnx.load(FIXTURES / "decoder_gathernd.onnx"), tmp_path / "model.onnx", save_as_external_data=True,
              location="w.data", size_threshold=4096)  # conv weights external, shape constants embedded
    before = state(tmp_path)
    for _ in range(3):
        proc = _signal_during(tmp_path, ["patch", "model.onnx", "out.onnx", "--verify"], ".out.onnx")
        assert proc.returncode in (143, 0), proc.stderr  # 0: it finished before the signal landed
        assert "Traceback" not in proc.stderr
        left = {k for k in state(tmp_path) if k not in before}
        assert left <= {"out.onnx", "out.onnx.data"}, left  # a finished output, never a temporary
        if proc.returncode == 143:
            assert not left and proc.stderr.strip() == "deform-surgeon: terminated", proc.stderr
        for name in left:
            (tmp_path / name).unlink()


def test_sigterm_stops_a_batch_and_its_workers(tmp_path):
    for k in range(4):
        external(tmp_path, f"m{k}.onnx", f"m{k}.data")
    before = state(tmp_path)
    proc = _signal_during(tmp_path, ["batch", "--glob", "m*.onnx", "--jobs", "2", "--verify", "--no-progress"],
                          ".m0.patched")
    assert proc.returncode == 143, proc.stdout + proc.stderr
    time.sleep(3)  # a worker that went on would write its output now
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
    assert not {n for n in left if n.endswith(".report.json")}, left  # stopped before the reports
    for name in left:  # what a worker finished before the signal is complete: a model and its data
        assert name.endswith((".patched.onnx", ".patched.onnx.data")), left


# ------------------------------------------------------------------------------------------ the background child
_STOP_THE_PARENT_WHILE_THE_CHILD_REPORTS = """
import os, signal, sys
from deform_surgeon.commands import cli
from deform_surgeon.commands.patching import lift
from deform_surgeon.base.errors import SurgeonError

def checker_that_fails(model, path, weights):  # runs in the background child (background.py)
    os.kill(os.getppid(), signal.SIGTERM)  # the parent is stopped now...
    raise SurgeonError(path, "fails onnx.checker: " + "x" * (1 << 20))  # ...while this (1 MB) is being sent

lift.checked_types = checker_that_fails
sys.exit(cli.main(["inspect", sys.argv[1]]))
"""


def test_stopping_the_parent_while_the_background_child_reports_an_error(tmp_path):
    """SIGTERM reaches the CLI while its background checker child sends its error (an answer too long for the pipe:
    the child is blocked sending it; the parent may be reading it, or not). The parent leaves with exit 143 and its
    one line; the child is stopped quietly, not through the CLI's handler it inherited (which would raise
    `Terminated` in the child and print two tracebacks), and nothing hangs. Eight at once on two cores: under
    load, each ordering of the two processes' steps is met."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    (tmp_path / "stop.py").write_text(_STOP_THE_PARENT_WHILE_THE_CHILD_REPORTS)
    before = state(tmp_path)
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "stop.py", "m.onnx"], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 143 and err == "deform-surgeon: terminated\n", err[-3000:]
    assert state(tmp_path) == before


# ------------------------------------------------------------------------------------- signals during start-up
_HOLD_IMPORT = """
import os, sys, time

class _Hold:
    '''The first import of $DS_HOLD_IMPORT (by the first process to reach it) waits there for a signal: the signal
    lands during that import, as a Ctrl-C a second into start-up does. DS_HOLD_AS=ImportError: the import then
    fails as onnxruntime's does when interrupted ("ImportError: initialization failed").'''

    def find_spec(self, name, path=None, target=None):
        if name != os.environ.get("DS_HOLD_IMPORT"):
            return None
        try:
            os.close(os.open(os.environ["DS_HOLD_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt as exc:
            if os.environ.get("DS_HOLD_AS") == "ImportError":
                raise ImportError("initialization failed") from exc
            raise

sys.meta_path.insert(0, _Hold())
"""


def _signal_at_import(tmp_path: Path, argv: list, module: str, sig: int, as_import_error: bool = False,
                      entry: str = "module") -> subprocess.CompletedProcess:
    """Run a command whose first import of `module` waits (see _HOLD_IMPORT); once it waits, send `sig` to the
    command's whole process group (what a terminal's Ctrl-C does); wait for the end."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOLD_IMPORT)
    mark = tmp_path / "hook" / "holding"
    mark.unlink(missing_ok=True)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DS_HOLD_IMPORT": module, "DS_HOLD_MARK": str(mark),
           "DS_HOLD_AS": "ImportError" if as_import_error else ""}
    command = [*DS] if entry == "module" else [str(Path(sys.executable).parent / "deform-surgeon")]
    proc = subprocess.Popen([*command, *argv], cwd=tmp_path / "work", env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mark.exists(), f"the import of {module} was never reached"
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("argv, module, sig, as_import_error, entry", [
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGINT, False, "script"),
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGTERM, False, "module"),
    (["inspect", "m.onnx"], "onnx_graphsurgeon", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx", "--verify"], "onnxruntime", signal.SIGINT, True, "module"),
    (["patch", "m.onnx", "o.onnx", "--verify"], "onnxruntime", signal.SIGTERM, True, "module"),
    (["verify", "m.onnx", "m.onnx"], "polygraphy", signal.SIGINT, False, "module"),
    (["batch", "--glob", "m.onnx", "--no-progress"], "onnx", signal.SIGINT, False, "module"),
    # ctypes: were the package's __init__ to import device -> runtimes -> ctypes, 0.18 s before the handlers
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGINT, False, "script"),
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGTERM, False, "module"),
], ids=["patch-onnx-int", "script-onnx-int", "patch-onnx-term", "inspect-gs-int", "verify-ort-int", "verify-ort-term",
        "verify-polygraphy-int", "batch-onnx-int", "patch-ctypes-int", "script-ctypes-int", "patch-ctypes-term"])
def test_a_signal_during_start_up_is_one_line(tmp_path, argv, module, sig, as_import_error, entry):
    """Ctrl-C or SIGTERM while the command imports its libraries: exit 130 / 143 and one line, like at any other
    moment (not a KeyboardInterrupt traceback and exit -2, nor, in onnxruntime's import, an ImportError and
    exit 1)."""
    work = tmp_path / "work"
    work.mkdir()
    copy_fixture("decoder_gathernd.onnx", work, "m.onnx")
    before = state(work)
    proc = _signal_at_import(tmp_path, argv, module, sig, as_import_error, entry)
    expected = {signal.SIGINT: (130, "deform-surgeon: interrupted\n"), signal.SIGTERM: (143, "deform-surgeon: "
                                                                                        "terminated\n")}[sig]
    assert (proc.returncode, proc.stderr) == expected, proc.stderr
    assert state(work) == before


def test_ctrl_c_stops_a_batch_and_its_workers_quietly(tmp_path):
    """Ctrl-C reaches the whole process group, the workers too: they leave it to the batch, which stops them
    (no worker prints a KeyboardInterrupt or FileNotFoundError traceback)."""
    for k in range(4):
        copy_fixture("decoder_gathernd.onnx", tmp_path, f"m{k}.onnx")
    before = state(tmp_path)
    proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "2", "--verify", "--no-progress"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(".m0.patched") for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), out + err
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
    for name in left:  # what a worker finished before the signal is complete: a model and its data
        assert name.endswith((".patched.onnx", ".patched.onnx.data")), left


def _grandchildren(pid: int) -> int:
    """How many children the children of `pid` have, read from /proc: batch's workers (the fork server's)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or one that ended meanwhile
            continue
    children = {p for p, parent in parents.items() if parent == pid}
    return sum(parent in children for parent in parents.values())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers in /proc")
def test_ctrl_c_while_batch_workers_start_is_one_line(tmp_path):
    """A Ctrl-C inside `Process.start()` must not leave a worker the batch does not know of, so does not stop: it
    would read its start-up data after the batch had exited and removed the queue's semaphore, and print a
    multiprocessing traceback (FileNotFoundError) after "interrupted" (measured: about 1 Ctrl-C in 15 while the
    workers start). Ctrl-C the moment the first, then the second worker exists, a few times over: one line, exit
    130, every time."""
    for k in range(4):
        copy_fixture("decoder_gathernd.onnx", tmp_path, f"m{k}.onnx")
    before = state(tmp_path)
    for attempt in range(8):
        proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "2", "--no-progress"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        while proc.poll() is None and _grandchildren(proc.pid) < 1 + attempt % 2:
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), f"attempt {attempt}: {out}{err}"
        left = {k for k in state(tmp_path) if k not in before}
        assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
        for name in left:  # a worker that finished before the signal: its output is complete
            assert name.endswith(".patched.onnx"), left
            (tmp_path / name).unlink()


def _fork_server_of(pid: int) -> bool:
    """Whether a child of `pid` is multiprocessing's fork server (read from /proc)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the fork server in /proc")
@pytest.mark.parametrize("wait", [0.0, 0.05, 0.1, 0.2, 0.3])
def test_ctrl_c_while_the_fork_server_loads_is_one_line(tmp_path, wait):
    """A Ctrl-C reaches the whole process group, and the fork server batch starts spends about half a second
    importing the patch stack: a Ctrl-C then must print no KeyboardInterrupt traceback before "interrupted", and
    one the batch takes while a worker is being forked must not leave that worker reading its start-up data after
    the batch has gone (FileNotFoundError). Ctrl-C `wait` seconds after the fork server exists (the signal lands
    in its start-up): one line, exit 130, no temporary file."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m0.onnx")
    before = state(tmp_path)
    proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "1", "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while proc.poll() is None and not _fork_server_of(proc.pid):
        time.sleep(0.001)
    time.sleep(wait)  # (where in the fork server's start-up the signal lands; no time is asserted)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    if "1 ok, 0 unchanged, 0 refused, 0 failed" in out:  # done first: exit 0, or the signal ended Python's own
        assert (proc.returncode, err) in ((0, ""), (-signal.SIGINT, "")), out + err  # shutdown (robustness.md)
    else:
        assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), out + err
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left
