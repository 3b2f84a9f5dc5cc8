"""The command starts itself once more with glibc's huge pages where that helps (deform_surgeon/__main__.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import ENTRY_POINTS, copy_fixture

from deform_surgeon.__main__ import HUGE_PAGES, _glibc_version, _thp_mode, huge_pages_environ

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
