"""The command starts itself once more with glibc's huge pages where that helps (deform_surgeon/__main__.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import ENTRY_POINTS, copy_fixture

from deform_surgeon.__main__ import HUGE_PAGES, _glibc_version, _thp_mode, huge_pages_environ, restarts_exactly

# what the command's last process saw: written when it ends (a process that starts itself again never ends)
_REPORT_ENV = """
import atexit, os
line = lambda: f"{os.getpid()} {os.environ.get('GLIBC_TUNABLES')}\\n"
atexit.register(lambda: open(os.environ["DS_ENV_OUT"], "a").write(line()))
"""


@pytest.mark.parametrize("environ, glibc, thp, expected", [
    ({}, (2, 36), "madvise", HUGE_PAGES),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 35), "madvise", f"glibc.malloc.arena_max=2:{HUGE_PAGES}"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise", None),  # the user's choice
    ({}, (2, 34), "madvise", None),  # glibc without the tunable
    ({}, None, "madvise", None),  # not glibc (musl, macOS)
    ({}, (2, 36), "always", None),  # every allocation has huge pages already
    ({}, (2, 36), "never", None),
    ({}, (2, 36), None, None),  # no transparent huge pages at all
])
def test_when_the_command_asks_for_huge_pages(environ, glibc, thp, expected):
    got = huge_pages_environ(environ, glibc, thp)
    assert (got if got is None else got["GLIBC_TUNABLES"]) == expected
    if got is not None:
        assert {k: v for k, v in got.items() if k != "GLIBC_TUNABLES"} == \
            {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}


@pytest.mark.parametrize("entry", ["module", "script"])
def test_the_command_runs_with_huge_pages_and_writes_the_same_bytes(tmp_path, entry):
    """On this machine: the process that does the work has the setting where `huge_pages_environ` asks for it, is
    the process that was started (same PID, nothing left behind), and writes what it writes without it."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_REPORT_ENV)
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "hook"), os.environ.get("PYTHONPATH")) if p)
    outputs = {}
    for label, extra in (("default", {}), ("off", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})):
        seen = tmp_path / f"{label}.env"
        env = {**base, **extra, "DS_ENV_OUT": str(seen)}
        proc = subprocess.Popen([*ENTRY_POINTS[entry], "patch", "m.onnx", f"{label}.onnx"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        assert err == ""
        pid, tunables = seen.read_text().split()
        assert int(pid) == proc.pid  # one process: it replaced itself
        wanted = huge_pages_environ({k: v for k, v in env.items() if k != "DS_ENV_OUT"}, _glibc_version(), _thp_mode())
        assert tunables == (wanted["GLIBC_TUNABLES"] if wanted else extra.get("GLIBC_TUNABLES", "None"))
        outputs[label] = (tmp_path / f"{label}.onnx").read_bytes()
    assert outputs["default"] == outputs["off"]


_CALLER = """
import os, sys
with open("calls.log", "a") as log:  # a side effect before main(): it must happen once
    log.write(f"{os.getpid()} {sys.argv[1:]}\\n")
sys.argv = ["deform-surgeon", "patch", "m.onnx", "out.onnx", "--verbose"]
from deform_surgeon.__main__ import main
sys.exit(main())
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_that_calls_main_runs_once(tmp_path, how):
    """A script that sets sys.argv and calls main(): the start-up restart with huge pages (`os.execve` of the
    interpreter's own command line) ran the script again from its first line (its side effects twice, the second
    time with its own argv), and `python - <<EOF` exited 0 with no output at all (stdin at its end the second
    time). Only `deform-surgeon` and `python -m deform_surgeon` start themselves again; here --verbose says why
    not."""
    import sys

    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if how == "file":
        (tmp_path / "caller.py").write_text(_CALLER)
        proc = subprocess.run([sys.executable, "caller.py", "first"], cwd=tmp_path, env=env, capture_output=True,
                              text=True)
    else:
        proc = subprocess.run([sys.executable, "-", "first"], cwd=tmp_path, env=env, input=_CALLER,
                              capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (call,) = (tmp_path / "calls.log").read_text().splitlines()  # one run of the caller, with its own argv
    assert call.endswith(" ['first']"), call
    assert "wrote out.onnx" in proc.stdout and (tmp_path / "out.onnx").is_file()
    if huge_pages_environ(env, _glibc_version(), _thp_mode()) is not None:
        assert "huge pages: not asked for: glibc reads GLIBC_TUNABLES only when a process starts" in proc.stdout


@pytest.mark.parametrize("orig_argv, argv, main, expected", [
    (["py", "-m", "deform_surgeon", "patch", "a"], ["x/__main__.py", "patch", "a"], "module", True),
    (["py", "-X", "importtime", "-mdeform_surgeon", "patch"], ["x/__main__.py", "patch"], "module", True),
    (["py", "/v/bin/deform-surgeon", "patch", "a"], ["/v/bin/deform-surgeon", "patch", "a"], "/v/bin/deform-surgeon",
     True),
    (["py", "caller.py", "first"], ["deform-surgeon", "patch", "a"], "caller.py", False),  # the caller set argv
    (["py", "-", "first"], ["deform-surgeon", "patch"], "<stdin>", False),
    (["py", "-c", "..."], ["-c"], None, False),
    (["py", "/v/bin/deform-surgeon", "patch", "a"], ["/v/bin/deform-surgeon", "patch", "b"], "/v/bin/deform-surgeon",
     False),  # the arguments changed since the start
    (["py", "-m", "tool", "patch"], ["x/__main__.py", "patch"], "tool", False),  # another package's __main__
])
def test_which_starts_restart_exactly(orig_argv, argv, main, expected):
    import types
    from importlib.machinery import ModuleSpec

    module = types.ModuleType("__main__")
    if main == "module":
        module.__spec__ = ModuleSpec("deform_surgeon.__main__", None)
    elif main == "tool":
        module.__spec__ = ModuleSpec("tool.__main__", None)
    else:
        module.__spec__ = None
        if main is not None:
            module.__file__ = main
    assert restarts_exactly(orig_argv, argv, module) is expected
