"""Where the output's weights go (`--external-data`): a single file too large for a browser page is written with its
initializers in `<OUT>_data`, either form can be forced, the bytes and the outputs stay the same, the report says
where and why, and `batch DIR OUTDIR` makes the folder's config.json tell transformers.js to fetch the data file.

`BROWSER_SINGLE_FILE_LIMIT` is lowered in-process for the "auto" tests (the fixtures are small); the CLI tests use
"always" and "never", which do not depend on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import FIXTURES, assert_bytes_equal, one_error_line, run_ort

import deform_surgeon
from deform_surgeon import SurgeonError
from deform_surgeon.files import pair as pairs
from deform_surgeon.files import temporary, write

FIXTURE = FIXTURES / "decoder_gathernd.onnx"


def _locations(path: Path) -> set[str]:
    m = onnx.load(path, load_external_data=False)
    return {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}


def _same_outputs(a: Path, b: Path) -> None:
    model = onnx.load(a, load_external_data=False)
    feed = {i.name: np.random.default_rng(5).random([d.dim_value for d in i.type.tensor_type.shape.dim],
                                                     dtype=np.float32) for i in model.graph.input}
    assert_bytes_equal(run_ort(str(a), feed), run_ort(str(b), feed))


def _initializer_bytes(path: Path) -> dict[str, bytes]:
    m = onnx.load(path)  # external data read in
    return {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}


def test_always_moves_every_stored_initializer_to_out_data(tmp_path):
    out = tmp_path / "model.onnx"
    report = deform_surgeon.patch(FIXTURE, out, external_data="always", verify=True)
    assert report.written and report.verification.identical
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert _locations(out) == {"model.onnx_data"}  # relative to OUT's own folder: the folder can be moved
    assert report.weights == {"external_data": "model.onnx_data", "why": "--external-data always",
                              "browser_problem": None}
    assert any(line.startswith("weights: external data in model.onnx_data") for line in report.weights_lines())
    assert out.stat().st_size < FIXTURE.stat().st_size / 1.5  # the weights left the model file
    _same_outputs(FIXTURE, out)


def test_never_embeds_external_data_again_byte_for_byte(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(onnx.load(FIXTURE), src / "model.onnx", save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    out = tmp_path / "single.onnx"
    report = deform_surgeon.patch(src / "model.onnx", out, external_data="never", copy_unchanged=True)
    assert report.written and report.weights["external_data"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["single.onnx", "src"]
    assert _locations(out) == set()
    patched_in_place = tmp_path / "kept.onnx"
    deform_surgeon.patch(src / "model.onnx", patched_in_place)  # auto keeps the input's form
    assert _locations(patched_in_place) == {"kept.onnx.data"}
    assert _initializer_bytes(out) == _initializer_bytes(patched_in_place)
    _same_outputs(src / "model.onnx", out)


def test_auto_moves_a_single_file_over_the_limit_and_keeps_a_smaller_one(tmp_path, monkeypatch):
    small = tmp_path / "small.onnx"
    deform_surgeon.patch(FIXTURE, small)
    assert _locations(small) == set()  # under the limit: one file, as before
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", FIXTURE.stat().st_size // 2)
    big = tmp_path / "big.onnx"
    report = deform_surgeon.patch(FIXTURE, big)
    assert _locations(big) == {"big.onnx_data"}
    assert report.weights["why"].startswith("one file of")
    assert report.weights["why"].endswith("would not load in a browser page")
    _same_outputs(FIXTURE, big)


def test_a_single_file_forced_over_the_limit_is_warned_about(tmp_path, monkeypatch):
    plain = FIXTURES / "no_deform.onnx"
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", min(FIXTURE.stat().st_size, plain.stat().st_size) // 2)
    report = deform_surgeon.patch(FIXTURE, tmp_path / "one.onnx", external_data="never")
    assert report.written and "onnxruntime-web holds a single file twice" in report.weights["browser_problem"]
    assert report.format().count("WARNING: will not load in a browser page: one.onnx is one file of") == 1
    unchanged = deform_surgeon.patch(plain, tmp_path / "none.onnx", external_data="never")  # nothing to rewrite
    assert not unchanged.written
    assert ("WARNING: will not load in a browser page (the input, left as it is): no_deform.onnx is one file of"
            in unchanged.format())


def test_json_report_carries_the_form(tmp_path):
    report = json.loads(deform_surgeon.patch(FIXTURE, tmp_path / "m.onnx", external_data="always").to_json())
    assert report["weights"]["external_data"] == "m.onnx_data"


@pytest.mark.parametrize("value", ["sometimes", 1, True])
def test_a_bad_choice_is_refused_before_any_work(tmp_path, value):
    with pytest.raises(SurgeonError, match="external_data"):
        deform_surgeon.patch(FIXTURE, tmp_path / "x.onnx", external_data=value)
    assert list(tmp_path.iterdir()) == []


def test_cli_always_and_a_data_file_that_would_overwrite_the_input(tmp_path):
    cmd = [sys.executable, "-m", "deform_surgeon", "patch"]
    proc = subprocess.run([*cmd, FIXTURE, tmp_path / "o.onnx", "--external-data", "always"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "weights: external data in o.onnx_data (--external-data always)" in proc.stdout
    # OUT's data file would be the input itself: refused before any work, the input untouched
    victim = tmp_path / "m.onnx_data"
    victim.write_bytes(FIXTURE.read_bytes())
    before = victim.read_bytes()
    proc = subprocess.run([*cmd, victim, tmp_path / "m.onnx", "--external-data", "always"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"{tmp_path / 'm.onnx_data'}: ")
    assert victim.read_bytes() == before and not (tmp_path / "m.onnx").exists()
    bad = subprocess.run([*cmd, FIXTURE, tmp_path / "p.onnx", "--external-data", "maybe"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "invalid choice: 'maybe'" in bad.stderr


# ------------------------------------------------------------------------------------ batch DIR OUTDIR's config
def _folder(root: Path, config: dict, files=("model.onnx", "model_fp16.onnx")) -> Path:
    (root / "onnx").mkdir(parents=True)
    for name in files:
        source = FIXTURES / ("decoder_gathernd_fp16.onnx" if "fp16" in name else "decoder_gathernd.onnx")
        (root / "onnx" / name).write_bytes(source.read_bytes())
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root


def _batch(src: Path, out: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", "batch", src, out, "--no-progress", *args],
                          capture_output=True, text=True, timeout=900)


def test_batch_tells_transformers_js_to_fetch_the_data_files(tmp_path):
    config = {"model_type": "birefnet", "transformers.js_config": {"device": "webgpu"}, "id2label": {"0": "x"}}
    src = _folder(tmp_path / "in", config)
    proc = _batch(src, tmp_path / "out", "--external-data", "always")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["transformers.js_config"] == {"device": "webgpu", "use_external_data_format": {
        "model.onnx": 1, "model_fp16.onnx": 1}}
    assert {k: v for k, v in written.items() if k != "transformers.js_config"} == {
        k: v for k, v in config.items() if k != "transformers.js_config"}  # the rest of the config as it was
    assert "use_external_data_format set to the data files written (model.onnx: 1, model_fp16.onnx: 1)" in proc.stdout
    assert (tmp_path / "out" / "onnx" / "model_fp16.onnx_data").is_file()
    assert json.loads((src / "config.json").read_text()) == config  # the input folder untouched


def test_batch_leaves_a_config_that_already_says_the_right_thing_as_copied(tmp_path):
    src = _folder(tmp_path / "in", {"model_type": "birefnet"})
    proc = _batch(src, tmp_path / "out")  # small files: one file each, as the input
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert "use_external_data_format" not in proc.stdout


def test_batch_undoes_a_config_whose_data_files_are_gone(tmp_path):
    """A config saying every file has external data (`true`), for outputs written as one file each: transformers.js
    would fetch `model.onnx_data` that does not exist; the map says 0 for each."""
    src = _folder(tmp_path / "in", {"model_type": "birefnet",
                                    "transformers.js_config": {"use_external_data_format": True}}, ("model.onnx",))
    proc = _batch(src, tmp_path / "out", "--external-data", "never")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 0}


def test_the_report_names_a_data_file_only_where_one_was_written(tmp_path):
    """The report says what was written: with `--external-data always` on a model with no stored tensor, one file
    (no `externalData: [{path: 'out.onnx_data'}]` for a page to fetch, since no such file exists); the data file's
    own name where there is one."""
    import deform_surgeon as ds

    small = tmp_path / "small.onnx"  # every initializer under 4 KiB: none is a stored tensor
    small.write_bytes((FIXTURES / "gathernd_b2g2.onnx").read_bytes())
    report = ds.patch(small, tmp_path / "out.onnx", external_data="always")
    assert report.written and not (tmp_path / "out.onnx_data").exists() and not (tmp_path / "out.onnx.data").exists()
    assert report.weights["external_data"] is None and "no stored tensor" in report.weights["why"]
    assert "externalData" not in report.format()
    big = ds.patch(FIXTURES / "decoder_gathernd.onnx", tmp_path / "big.onnx", external_data="always")
    assert big.weights["external_data"] == "big.onnx_data" and (tmp_path / "big.onnx_data").is_file()
    assert "externalData: [{path: 'big.onnx_data'" in big.format()


# ----------------------------------------------------------------------------------------- the data file's name
def _linked_data(folder: Path, name: str = "model.onnx") -> Path:
    """A model whose data file `<name>_data`, as the model names it, is a link to `blob.bin` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(onnx.load(FIXTURE), folder / name, save_as_external_data=True, location=f"{name}_data",
              size_threshold=0)
    (folder / f"{name}_data").rename(folder / "blob.bin")
    (folder / f"{name}_data").symlink_to("blob.bin")
    return folder / name


def _patch_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", "patch", *args], capture_output=True, text=True,
                          timeout=600)


def test_a_data_file_reached_through_a_link_is_written_under_the_name_checked(tmp_path):
    """The planner and the writer both take the data file's name the model gives (`model.onnx_data`: `<OUT>_data`),
    not where its link leads (`blob.bin` would give `<OUT>.data`): were they to differ, `--report a/out.onnx.data`
    would overwrite the weights just written (exit 0, the output out of bounds in ORT)."""
    model = _linked_data(tmp_path / "a")
    out = tmp_path / "a" / "out.onnx"
    proc = _patch_cli(model, out, "--report", tmp_path / "a" / "out.onnx.data")
    assert proc.returncode == 0, proc.stderr
    assert _locations(out) == {"out.onnx_data"} and (tmp_path / "a" / "out.onnx_data").is_file()
    assert json.loads((tmp_path / "a" / "out.onnx.data").read_text())["output"] == str(out)  # the report, apart
    _same_outputs(model, out)
    # the name written is the name checked: a report there is refused before any work
    proc = _patch_cli(model, tmp_path / "a" / "new.onnx", "--report", tmp_path / "a" / "new.onnx_data")
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"{tmp_path / 'a' / 'new.onnx_data'}: --report is also OUT's external")
    assert not (tmp_path / "a" / "new.onnx").exists() and not (tmp_path / "a" / "new.onnx_data").exists()


def test_batch_of_a_transformers_js_folder_keeps_its_data_files_name(tmp_path):
    """A transformers.js folder's outputs keep `<name>.onnx_data`, the name it fetches, and the config says so:
    for a `model.onnx_data` that is a link (not `onnx/model.onnx.data` with config.json `{"model.onnx": 0}`, a
    folder that would not load), and for data in `model.onnx.data` with `--external-data always`."""
    config = {"model_type": "birefnet", "transformers.js_config": {"use_external_data_format": {"model.onnx": 1}}}
    src = _folder(tmp_path / "in", config, ())
    _linked_data(src / "onnx")
    proc = _batch(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out" / "onnx"
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert _locations(out / "model.onnx") == {"model.onnx_data"}
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    _same_outputs(src / "onnx" / "model.onnx", out / "model.onnx")

    dotted = _folder(tmp_path / "in2", {"model_type": "birefnet"}, ())
    onnx.save(onnx.load(FIXTURE), dotted / "onnx" / "model.onnx", save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    proc = _batch(dotted, tmp_path / "out2", "--external-data", "always")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out2" / "onnx"
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert _locations(out / "model.onnx") == {"model.onnx_data"}
    written = json.loads((tmp_path / "out2" / "config.json").read_text())
    assert written["transformers.js_config"] == {"use_external_data_format": {"model.onnx": 1}}
    assert "use_external_data_format set to the data files written (model.onnx: 1)" in proc.stdout
    _same_outputs(dotted / "onnx" / "model.onnx", out / "model.onnx")


# ----------------------------------------------------------------------------------- the output's own size decides
def test_the_512_mib_rule_reads_the_outputs_own_size(tmp_path, monkeypatch):
    """The 512 MiB rule and its warning read the output's size, as serialized, not the input's: an output over
    the limit from a smaller input is not written as one file without a word, and `never` on a model with an unused
    2.4 GB initializer does not warn of "one file of 2,289 MiB" for a 510 KB output (here with the limit lowered
    between the input's and the patched model's sizes)."""
    patched_size = 510_231  # decoder_gathernd.onnx (488,140 bytes) patched, as one file
    assert FIXTURE.stat().st_size < 500_000 < patched_size
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", 500_000)
    grown = tmp_path / "grown.onnx"
    report = deform_surgeon.patch(FIXTURE, grown)
    assert _locations(grown) == {"grown.onnx_data"} and grown.stat().st_size < 500_000
    assert report.weights == {"external_data": "grown.onnx_data", "browser_problem": None,
                              "why": f"one file of {patched_size / 2**20:,.0f} MiB would not load in a browser page"}
    _same_outputs(FIXTURE, grown)

    unused = onnx.load(FIXTURE)  # an initializer no node reads: 2 MiB the patched model does not keep
    unused.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1 << 19, np.float32), "unused"))
    onnx.save(unused, tmp_path / "unused.onnx")
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", 1_000_000)
    small = tmp_path / "small.onnx"
    report = deform_surgeon.patch(tmp_path / "unused.onnx", small, external_data="never")
    assert report.written and small.stat().st_size < 1_000_000 < (tmp_path / "unused.onnx").stat().st_size
    assert report.weights["browser_problem"] is None and "WARNING" not in report.format()
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", 400_000)  # now the output itself is over: warned of
    report = deform_surgeon.patch(tmp_path / "unused.onnx", small, external_data="never")
    assert f"small.onnx is one file of {small.stat().st_size / 2**20:,.0f} MiB" in report.weights["browser_problem"]


# ------------------------------------------------------------------------------ replacing an existing OUT and its data
def _old_pair(out: Path) -> dict[str, bytes]:
    """An existing OUT with its data file (another model's: a new data file under an old OUT would be out of
    bounds), as the files' bytes."""
    deform_surgeon.patch(FIXTURES / "decoder_gathernd_fp16.onnx", out, external_data="always")
    return {p.name: p.read_bytes() for p in sorted(out.parent.iterdir())}


def _a_consistent_pair(out: Path) -> None:
    """OUT loads with its data file on ORT CPU and gives what one of the two models gives."""
    model = onnx.load(out, load_external_data=False)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    source = FIXTURES / ("decoder_gathernd_fp16.onnx" if model.graph.input[0].type.tensor_type.elem_type
                         == onnx.TensorProto.FLOAT16 else "decoder_gathernd.onnx")
    feed = {model.graph.input[0].name: np.random.default_rng(5).random(shape).astype(
        np.float16 if "fp16" in source.name else np.float32)}
    assert_bytes_equal(run_ort(str(source), feed), run_ort(str(out), feed))


def _ctrl_c_after_the_data_rename(monkeypatch, send) -> None:
    """`os.replace` sends Ctrl-C by `send()` right after the data file takes its name (before OUT takes its own)."""
    import os

    rename = os.replace

    def replace_then_ctrl_c(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if Path(dst).name == "out.onnx_data":
            send()

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)


def test_ctrl_c_between_the_pairs_renames_leaves_a_pair(tmp_path, monkeypatch):
    """SIGINT right after the data file's rename waits for the pair's few renames: OUT and its data file are one
    pair (the old OUT naming the new data file would be out of bounds in ORT).
    The signal is sent to the main thread (`pthread_kill`), where a terminal's Ctrl-C lands when the main thread
    takes it: sent to the process (`os.kill`) the kernel may give it to any of pytest's threads, and the test would
    depend on which; the next test sends it to another thread on purpose."""
    import signal
    import threading

    out = tmp_path / "out.onnx"
    _old_pair(out)
    _ctrl_c_after_the_data_rename(monkeypatch, lambda: signal.pthread_kill(threading.main_thread().ident,
                                                                           signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        deform_surgeon.patch(FIXTURE, out, external_data="always")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx_data"]  # no temporary left
    _a_consistent_pair(out)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler put back


def test_a_ctrl_c_another_thread_takes_is_held_too(tmp_path, monkeypatch):
    """Ctrl-C reaches the whole process group, and the kernel gives it to any thread that does not block it: here
    a thread of the process's own takes it (`pthread_kill` to it), and the write goes on only once CPython's C
    handler there has marked it (the wakeup fd says so): its Python handler then runs in the main thread, within
    the renames, and is held as one the main thread took."""
    import os
    import signal
    import socket
    import threading

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old_fd = signal.set_wakeup_fd(writer.fileno())
    other_done = threading.Event()
    other = threading.Thread(target=other_done.wait, daemon=True)
    other.start()

    def to_the_other_thread():
        signal.pthread_kill(other.ident, signal.SIGINT)
        assert reader.recv(1) == bytes([signal.SIGINT])  # marked by the C handler, on the other thread

    out = tmp_path / "out.onnx"
    _old_pair(out)
    _ctrl_c_after_the_data_rename(monkeypatch, to_the_other_thread)
    try:
        with pytest.raises(KeyboardInterrupt):
            deform_surgeon.patch(FIXTURE, out, external_data="always")
    finally:
        signal.set_wakeup_fd(old_fd)
        other_done.set()
        reader.close()
        writer.close()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx_data"]
    _a_consistent_pair(out)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and os.getpid()


def test_an_out_that_cannot_be_replaced_leaves_its_data_file_as_it_was(tmp_path):
    """With OUT immutable (`chattr +i`), "could not be written" and `<OUT>_data` is not replaced either: the
    existing pair leaves together or not at all."""
    import shutil

    out = tmp_path / "out.onnx"
    before = _old_pair(out)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", out], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system that has it)")
    try:
        proc = _patch_cli(FIXTURE, out, "--external-data", "always")
    finally:
        subprocess.run(["chattr", "-i", out], check=True)
    assert proc.returncode != 0 and "could not be written" in one_error_line(proc)
    assert {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir())} == before
    _a_consistent_pair(out)


def test_a_data_file_of_the_users_own_is_not_replaced(tmp_path, monkeypatch):
    """A user's existing `<OUT>_data` is never replaced without a word. A file there that the existing
    OUT does not name is refused in one line (before any work where the form is known, else when it would be
    written); the data file of the OUT being replaced is replaced with it."""
    own = tmp_path / "out.onnx_data"
    own.write_bytes(b"the user's own notes")
    proc = _patch_cli(FIXTURE, tmp_path / "out.onnx", "--external-data", "always")
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"{own}: exists and is not the external data file of out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx_data"] and own.read_bytes().startswith(b"the")
    deform_surgeon.patch(FIXTURES / "sum_only.onnx", tmp_path / "out.onnx")  # an OUT that names no data file
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", 100_000)  # "auto" moves the weights: the size decides
    with pytest.raises(SurgeonError, match="exists and is not the external data file of out.onnx"):
        deform_surgeon.patch(FIXTURE, tmp_path / "out.onnx")
    assert own.read_bytes() == b"the user's own notes"
    own.unlink()
    for _ in range(2):  # OUT's own data file is replaced with it
        deform_surgeon.patch(FIXTURE, tmp_path / "out.onnx")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx_data"]
        _a_consistent_pair(tmp_path / "out.onnx")
    monkeypatch.setattr(write, "BROWSER_SINGLE_FILE_LIMIT", 1 << 30)  # one file now: OUT's data file leaves with it
    deform_surgeon.patch(FIXTURE, tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"] and _locations(tmp_path / "out.onnx") == set()


def test_a_pair_a_killed_writer_moved_aside_is_put_back(tmp_path):
    """A writer killed between moving the old pair aside and putting the new one in place (SIGKILL cannot wait:
    batch's workers) leaves backups; batch then puts the old pair back (`recover_pair`), or, once the new OUT is
    in place, removes them."""
    out, data = tmp_path / "out.onnx", tmp_path / "out.onnx_data"
    before = _old_pair(out)
    pairs._move_aside([out, data])  # ... killed here, with the new data file placed:
    data.write_bytes(b"the new pair's data")
    pairs.recover_pair(out, data)
    assert {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir())} == before
    pair = {p: p.read_bytes() for p in (out, data)}
    pairs._move_aside([out, data])
    for path, content in pair.items():  # ... killed here, the new pair in place, the backups still there
        path.write_bytes(content)
    assert len(list(tmp_path.iterdir())) == 4
    pairs.recover_pair(out, data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx_data"]
    _a_consistent_pair(out)


def test_the_next_patch_of_an_out_settles_what_a_killed_patch_moved_aside(tmp_path):
    """A plain `patch` killed (SIGKILL) between moving the old pair aside and putting the new one in place left the
    old pair under hidden backup names for good (only batch looked for them). The next write of that OUT settles
    them first: with OUT missing they are put back and then replaced as any old pair is; with the new OUT in place
    they are removed. No hidden file is left either way, and a backup of another OUT is not touched."""
    out, data = tmp_path / "out.onnx", tmp_path / "out.onnx_data"
    deform_surgeon.patch(FIXTURE, out, external_data="always")
    other = tmp_path / "other.onnx"
    other.write_bytes(b"another model")
    (other_backup, _), = pairs._move_aside([other])
    for killed_with_out_in_place in (False, True):
        pair = {p: p.read_bytes() for p in (out, data)}
        pairs._move_aside([out, data])  # ... killed here (the old pair aside, OUT missing)
        if killed_with_out_in_place:  # ... or here, the new pair in place
            for path, content in pair.items():
                path.write_bytes(content)
        assert len([p for p in tmp_path.iterdir() if p.name.endswith(".old")]) == 3
        deform_surgeon.patch(FIXTURE, out, external_data="always")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.onnx", "out.onnx_data", other_backup.name])
        _a_consistent_pair(out)
    assert other_backup.read_bytes() == b"another model"


def test_replacing_an_out_never_removes_an_input_named_as_its_data(tmp_path):
    """An input is never moved or removed when OUT is replaced: an old OUT that names the input's own data file (a
    copied model), or an input that bears OUT's data file name, would otherwise be moved aside with the old OUT and
    removed once the new one is in place (the input's weights, or the input itself, gone, exit 0). What the old
    OUT named of the input's stays where it is."""
    model = onnx.load(str(FIXTURE))
    onnx.save(model, tmp_path / "in.onnx", save_as_external_data=True, location="out.onnx_data", size_threshold=0)
    (tmp_path / "out.onnx").write_bytes((tmp_path / "in.onnx").read_bytes())  # an old OUT naming the same data
    weights = (tmp_path / "out.onnx_data").read_bytes()
    proc = _patch_cli(tmp_path / "in.onnx", tmp_path / "out.onnx", "--external-data", "never")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.onnx_data").read_bytes() == weights and _locations(tmp_path / "out.onnx") == set()
    _same_outputs(tmp_path / "in.onnx", tmp_path / "out.onnx")  # the input still loads, and agrees with OUT
    other = tmp_path / "b"
    other.mkdir()
    assert _patch_cli(FIXTURE, other / "out.onnx", "--external-data", "always").returncode == 0
    (other / "out.onnx_data").write_bytes(FIXTURE.read_bytes())  # now a model file: the input of the next patch
    proc = _patch_cli(other / "out.onnx_data", other / "out.onnx")
    assert proc.returncode == 0, proc.stderr
    assert (other / "out.onnx_data").read_bytes() == FIXTURE.read_bytes()
    _same_outputs(other / "out.onnx_data", other / "out.onnx")


def test_an_old_outs_data_file_leaves_with_it_whatever_the_new_forms_name(tmp_path):
    """An OUT written with `<OUT>.data` (the input's form), then with `<OUT>_data`: the old OUT's own data files
    leave with it, whatever the new form's name, so none is left behind for the next run to refuse as a user's own;
    a rerun of the first command works."""
    onnx.save(onnx.load(str(FIXTURE)), tmp_path / "dotted.onnx", save_as_external_data=True,
              location="dotted.onnx.data", size_threshold=0)
    out = tmp_path / "o" / "out.onnx"
    out.parent.mkdir()
    for args in ((tmp_path / "dotted.onnx",), (FIXTURE, "--external-data", "always"), (tmp_path / "dotted.onnx",)):
        proc = _patch_cli(args[0], out, *args[1:])
        assert proc.returncode == 0, proc.stderr
        names = sorted(p.name for p in out.parent.iterdir())
        assert names == ["out.onnx", *(f"out.onnx{s}" for s in {Path(x).name[len("out.onnx"):]
                                                               for x in _locations(out)})], names
        _a_consistent_pair(out)


def _fetched(out: Path) -> dict[str, int]:
    """The data files transformers.js fetches for each model of OUTDIR/onnx/, from OUTDIR's config.json
    (`batch.data_files_read`, the port of its resolveExternalDataFormat that test_batch.py holds to the real one)."""
    from deform_surgeon.commands.batch import base_names, data_files_read

    value = json.loads((out / "config.json").read_text()).get("transformers.js_config", {}).get(
        "use_external_data_format")
    return {p.name: data_files_read(value, p.name, min(base_names(p.name), key=len))
            for p in sorted((out / "onnx").glob("*.onnx"))}


def test_batch_config_says_what_onnx_holds_after_an_entry_fails_or_the_run_stops(tmp_path, monkeypatch):
    """The config counts the data files each model file in onnx/ names, after a rerun whose entry failed or that
    was stopped too: DIR's copy of config.json beside the earlier run's pair in onnx/ would make transformers.js
    fetch no data file for a model that names one."""
    from deform_surgeon.commands.batch import command as batch_command

    src, out = _folder(tmp_path / "in", {"model_type": "birefnet"}), tmp_path / "out"
    assert _batch(src, out, "--external-data", "always").returncode == 0
    assert _fetched(out) == {"model.onnx": 1, "model_fp16.onnx": 1}
    (src / "onnx" / "model.onnx").write_bytes(FIXTURE.read_bytes()[:1000])  # now not a model: its entry fails
    proc = _batch(src, out, "--external-data", "never")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = src / "onnx" / "model.onnx"  # (its row names it once: "src/...: src/...: not a readable" before)
    assert f"  {bad}: not a readable ONNX model" in proc.stdout and f"{bad}: {bad}" not in proc.stdout
    assert _locations(out / "onnx" / "model.onnx") == {"model.onnx_data"}  # the earlier pair, kept
    assert _fetched(out) == {"model.onnx": 1, "model_fp16.onnx": 0}
    _same_outputs(FIXTURE, out / "onnx" / "model.onnx")  # (it loads, its data file fetched)

    def stopped(*args, **kwargs):  # Ctrl-C once DIR's files (its config.json) are copied, before any model
        raise KeyboardInterrupt

    (src / "onnx" / "model.onnx").write_bytes(FIXTURE.read_bytes())
    monkeypatch.setattr(batch_command, "run", stopped)
    with pytest.raises(KeyboardInterrupt):
        batch_command.main(str(src), [], {"external_data": "always"}, 1, None, show_progress=False,
                           out_folder=str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "birefnet"
    assert _fetched(out) == {"model.onnx": 1, "model_fp16.onnx": 0}  # what onnx/ holds, not DIR's config


def test_an_unchanged_copy_over_a_pair_takes_the_old_data_file_with_it(tmp_path):
    """`--copy-unchanged` of a model with nothing to rewrite over an existing OUT pair left the old `<OUT>_data`
    behind (the next run refused it as a user's own): the copy takes OUT's place as a written model does."""
    out = tmp_path / "out.onnx"
    assert _patch_cli(FIXTURE, out, "--external-data", "always").returncode == 0
    assert (tmp_path / "out.onnx_data").is_file()
    proc = _patch_cli(FIXTURES / "no_deform.onnx", out, "--copy-unchanged")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == (FIXTURES / "no_deform.onnx").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]
    assert _patch_cli(FIXTURE, out, "--external-data", "always").returncode == 0  # and a rerun writes the pair


def test_an_unreadable_model_beside_its_data_file_fails_alone_in_a_batch(tmp_path):
    """A half-downloaded `onnx/model.onnx` beside its `model.onnx_data` fails alone, as docs/batch.md says a model
    that cannot be read does: the other variant is patched, exit 1 (the data file, not recognized as the model's,
    must not refuse the whole folder as one to be copied over the output's data file)."""
    src, out = _folder(tmp_path / "in", {"model_type": "birefnet"}), tmp_path / "out"
    onnx.save(onnx.load(str(FIXTURE)), src / "onnx" / "model.onnx", save_as_external_data=True,
              location="model.onnx_data", size_threshold=1024)
    (src / "onnx" / "model.onnx").write_bytes(b"garbage")
    proc = _batch(src, out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{src / 'onnx' / 'model.onnx'}: not a readable ONNX model" in proc.stdout
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model_fp16.onnx"]
    assert deform_surgeon.verify(FIXTURES / "decoder_gathernd_fp16.onnx", out / "onnx" / "model_fp16.onnx",
                                 iterations=1).identical


def test_two_write_targets_that_are_hard_links_of_one_file_are_named_so(tmp_path):
    """A --report that is a hard link of OUT's data file is refused as two names of one file, not as "rep.json
    and out.onnx_data are both .../rep.json" (the real path of a hard link is itself)."""
    from deform_surgeon.files.io_check import FilePlan

    (tmp_path / "out.onnx_data").write_bytes(b"")
    (tmp_path / "rep.json").hardlink_to(tmp_path / "out.onnx_data")
    plan = FilePlan()
    plan.write("OUT's external data file", tmp_path / "out.onnx_data")
    with pytest.raises(SurgeonError, match=r"rep.json and .*out.onnx_data are two names of one file"):
        plan.write("--report", tmp_path / "rep.json")


# ------------------------------------------------------------------------------- two writers, killed writers
# A writer run in a process of its own, made to stop before each rename whose target is one of `names` until told to
# go on, and to say so, and to say when it waits for the folder's lock: the test decides how two writers interleave
# by answering them, without a clock.
_WRITER = r"""
import os, sys
messages, go, names, argv = int(sys.argv[1]), int(sys.argv[2]), set(sys.argv[3].split(",")), sys.argv[4:]

def say(text):
    os.write(messages, (text + "\n").encode())

def stopping(rename):
    def call(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(dst))
        if name in names:
            say("rename " + name)
            if not os.read(go, 1):
                os._exit(99)
        return rename(src, dst, *args, **kwargs)
    return call

os.replace, os.rename = stopping(os.replace), stopping(os.rename)
from deform_surgeon.files import temporary
if hasattr(temporary, "_wait"):
    wait = temporary._wait
    def waiting(fd):
        say("waiting")
        wait(fd)
    temporary._wait = waiting
from deform_surgeon.commands.cli import main
sys.exit(main(argv))
"""


class _Writer:
    """A `deform-surgeon` command (`argv`) run by `_WRITER`, stopping before each rename to one of `names`."""

    def __init__(self, argv: list, names: list[str], cwd: Path) -> None:
        import os

        self._messages, messages = os.pipe()
        go, self._go = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(messages), str(go), ",".join(names),
                                      *map(str, argv)], cwd=cwd, pass_fds=(messages, go), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        os.close(messages)
        os.close(go)
        self.said = open(self._messages, "rb", buffering=0)  # noqa: SIM115 (closed in finish)
        self.stopped = False

    def next(self) -> str:
        """What the writer says next ("rename NAME": it stopped there; "waiting"), or "" once it has ended."""
        import select

        if not select.select([self.said], [], [], 600)[0]:  # (only so that a writer stuck for good fails the test)
            raise AssertionError("the writer said nothing for 10 minutes")
        said = self.said.readline().decode().strip()
        self.stopped = said.startswith("rename ")
        return said

    def expect(self, what: str) -> None:
        said = self.next()
        assert said == what, (said, self.finish())

    def go(self) -> None:
        import os

        os.write(self._go, b"g")
        self.stopped = False

    def as_far_as_it_can(self) -> str:
        """Let every rename go until the writer waits for the lock ("waiting") or ends ("")."""
        if self.stopped:
            self.go()
        while (said := self.next()).startswith("rename "):
            self.go()
        return said

    def finish(self) -> subprocess.CompletedProcess:
        """Let it go on to its end; its exit code and output."""
        import os

        self.as_far_as_it_can()
        while self.next():  # (it waited for the lock: it goes on once it has it)
            self.as_far_as_it_can()
        out, err = self.proc.communicate(timeout=600)
        self.said.close()
        os.close(self._go)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


def _which(out: Path) -> str:
    """The fixture OUT is the patch of, checked as a pair: OUT with its data file gives that model's outputs."""
    _a_consistent_pair(out)
    return "fp16" if onnx.load(out, load_external_data=False).graph.input[0].type.tensor_type.elem_type == \
        onnx.TensorProto.FLOAT16 else "fp32"


@pytest.mark.parametrize("second, interleaved", [("patch", True), ("patch", False), ("batch", False)],
                         ids=["patch-interleaved", "patch-after-its-data", "batch-after-its-data"])
def test_two_writers_of_one_out_leave_the_last_ones_pair_whole(tmp_path, second, interleaved):
    """Two `patch` runs to one OUT at once (`--external-data always`, other weights) leave one writer's pair
    whole: with their renames interleaved (A's data file, B's data file, B's model, A's model) A's model would sit
    beside B's data file, both exit 0. Here the first writer stops before its data file's rename, the second (a
    `patch`, or a `batch DIR OUTDIR` whose output is that OUT) goes as far as it can (`interleaved`: past its
    checks, to its own first rename), the first puts its data file in place, the second goes on, then the first.
    Or the second starts only once the first's data file is in place, which without its OUT looks like a file of
    the user's own. Either way the second waits for the folder's lock, then replaces the first's pair whole."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "model.onnx").write_bytes((FIXTURES / "decoder_gathernd_fp16.onnx").read_bytes())
    names = ["model.onnx", "model.onnx_data"]
    first = _Writer(["patch", FIXTURE, out / "model.onnx", "--external-data", "always"], names, tmp_path)
    first.expect("rename model.onnx_data")
    if not interleaved:
        first.go()
        first.expect("rename model.onnx")
    argv = (["patch", src / "model.onnx", out / "model.onnx"] if second == "patch" else
            ["batch", src, out, "--no-progress", "-j", "1"])
    last = _Writer([*argv, "--external-data", "always"], names, tmp_path)
    said = last.next()  # it waits for the lock, or it stops at its first rename
    if interleaved:
        first.go()  # the first's data file
        first.expect("rename model.onnx")
        if said.startswith("rename"):
            last.as_far_as_it_can()
    done = first.finish()
    assert done.returncode == 0, done.stderr
    done = last.finish()
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == names
    assert _which(out / "model.onnx") == "fp16"


# A writer that kills itself (SIGKILL: nothing of it runs after) just before its n-th rename into OUT's folder, or
# before its first removal of a file there once all its renames are done ("unlink").
_KILLED = r"""
import os, signal, sys
point, folder, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
seen = {"rename": 0, "unlink": 0}

def killing(kind, call):
    def wrapped(path, *args, **kwargs):
        target = args[0] if kind == "rename" else path
        if os.path.dirname(os.path.abspath(os.fspath(target))) == folder and (kind == "rename" or seen["rename"] >= 4):
            seen[kind] += 1
            if f"{kind}{seen[kind]}" == point:
                os.kill(os.getpid(), signal.SIGKILL)
        return call(path, *args, **kwargs)
    return wrapped

os.replace, os.rename = killing("rename", os.replace), killing("rename", os.rename)
os.unlink = killing("unlink", os.unlink)
from deform_surgeon.commands.cli import main
sys.exit(main(argv))
"""


def _killed_at(point: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _KILLED, point, str(out.parent), "patch", FIXTURE, out,
                           "--external-data", "always"], capture_output=True, text=True, timeout=600)


# (kill point, an old pair there, what the folder holds after the kill besides the writer's hidden files)
_KILL_POINTS = [
    ("rename1", True, ["model.onnx", "model.onnx_data"]),  # nothing moved yet
    ("rename2", True, ["model.onnx_data"]),  # the old OUT moved aside, its data file still in place
    ("rename3", True, []),  # the old pair aside
    ("rename4", True, ["model.onnx_data"]),  # the old pair aside, the new data file in place
    ("unlink1", True, ["model.onnx", "model.onnx_data"]),  # the new pair in place, the old one still aside
    ("rename2", False, ["model.onnx_data"]),  # a new OUT: its data file in place, the OUT not yet
]


@pytest.mark.parametrize("point, old, left", _KILL_POINTS,
                         ids=["before-rename-1", "before-rename-2", "before-rename-3", "before-rename-4",
                              "after-the-renames", "new-out-before-its-rename"])
def test_the_next_patch_settles_every_point_a_killed_writer_stopped_at(tmp_path, point, old, left):
    """A `patch` replacing an OUT pair, killed (SIGKILL) just before its 2nd rename (the old OUT moved aside, its
    data file in place) or its 4th (the old pair aside, the new data file in place): the next write settles what
    the killed writer left before it judges the data file: the old pair put back (then replaced) or removed, the
    temporaries removed, and at a new OUT's point the data file the killed writer had put in place. Judged
    unsettled, the data file would read "model.onnx_data: exists and is not the external data file of model.onnx
    ... remove it" (exit 2), the old OUT would stay hidden under its `.old` name and the temporaries for good."""
    out = tmp_path / "model.onnx"
    if old:
        _old_pair(out)
    killed = _killed_at(point, out)
    assert killed.returncode == -9, killed.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith(".")] == left and any(n.startswith(".") for n in names)
    proc = _patch_cli(FIXTURE, out, "--external-data", "always")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert _which(out) == "fp32"


@pytest.mark.parametrize("point", ["rename2", "rename4"])
def test_batch_settles_what_a_killed_patch_of_its_output_left(tmp_path, point):
    """`batch DIR OUTDIR` settles an output a killed `patch` left halfway before it judges it, as `patch` does,
    and writes it instead of refusing it."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "model.onnx").write_bytes((FIXTURES / "decoder_gathernd_fp16.onnx").read_bytes())
    _old_pair(out / "model.onnx")
    assert _killed_at(point, out / "model.onnx").returncode == -9
    proc = _batch(src, out, "--external-data", "always")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert _which(out / "model.onnx") == "fp16"


def test_a_temporary_is_removed_only_once_its_writer_is_gone(tmp_path):
    """What proves a temporary a dead writer's is its lock: one whose writer lives (here, this process) stays, one
    no process holds (a writer killed) is removed by the next write of its OUT."""
    out = tmp_path / "model.onnx"
    dead = tmp_path / f"{temporary.temp_prefix(out)}0badc0de.tmp.onnx"
    dead.write_bytes(b"what a killed writer wrote")
    with temporary.temp_path(out) as live:
        live.write_bytes(b"what a living writer writes")
        pairs.settle_out(out)
        assert live.read_bytes() == b"what a living writer writes" and not dead.exists()
    assert list(tmp_path.iterdir()) == []
