"""The batch's worker processes: a process per model, forked from a server that has imported the package (so one
starts in milliseconds), `jobs` at a time, each reporting its stages and its result on one queue; Ctrl-C and SIGTERM
stop them all and leave no temporary behind."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import time
from pathlib import Path

from ...base.signals import held
from ...files.pair import settle_out
from ..args import val_ranges_for
from .entry import FAILED, Entry
from .progress import Progress


def _stop_in_a_finalizer(unraisable) -> None:
    """A worker's SIGTERM that Python handled inside a finalizer (a weakref callback): its SystemExit cannot
    unwind from there, and Python would print it as "Exception ignored" and go on. The worker ends at once,
    quietly, by the signal itself, as the batch that sent it asked (what it leaves is settled as a killed
    worker's)."""
    if isinstance(unraisable.exc_value, SystemExit):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    sys.__unraisablehook__(unraisable)


def _work(number: int, entry: dict, messages) -> None:
    """Worker process: patch one model, reporting stages and the result on `messages`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so temporary files are removed on the way out
    sys.unraisablehook = _stop_in_a_finalizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the batch stops its workers
    from ...base.errors import SurgeonError as Error
    from ..patch import patch

    options = dict(entry["options"])
    try:  # `--val-range [lo,hi]`: every input of this model
        val_range = val_ranges_for(options.pop("val_range", None), entry["input"])
    except Exception:  # an unreadable model: patch() below names the problem
        val_range = None
    verify_options = {k: options.pop(k, None) for k in ("iterations", "seed", "opt_level")}
    verify_options["val_range"] = val_range
    verify_options["threads"] = options.pop("threads", None) or entry.get("threads")  # (the entry's, else its share)
    messages.put(("stage", number, "start"))
    try:
        report = patch(entry["input"], entry["output"], progress=lambda s: messages.put(("stage", number, s)),
                       verify_options=verify_options, **options)
        messages.put(("done", number, report.to_dict(), None))
    except Error as exc:
        messages.put(("done", number, None, exc.one_line()))
    except MemoryError:
        messages.put(("done", number, None, f"{entry['input']}: out of memory"))
    except Exception as exc:  # a bug, not bad input: still only this entry fails
        messages.put(("done", number, None, f"{entry['input']}: internal error: {type(exc).__name__}: {exc}"))


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # every worker is forked from a server that has imported the patch and verify stacks once
        # (and its workers are born ignoring Ctrl-C: ctrl_c_ignored says why)
        ctx.set_forkserver_preload(["deform_surgeon.commands.patch", "deform_surgeon.checks.verify", "onnxruntime",
                                    "polygraphy.backend.onnxrt", "polygraphy.comparator",
                                    "deform_surgeon.commands.ctrl_c_ignored"])
        return ctx
    return multiprocessing.get_context("spawn")


def run(entries: list[Entry], jobs: int, progress: Progress | None = None) -> float:
    """Run the entries that have no error yet, `jobs` at a time; fill in their status. Returns the wall time."""
    start = time.perf_counter()
    todo = [e for e in entries if e.error is None]
    for e in entries:
        if e.error is not None:
            e.status = FAILED
    ctx = _context()
    with held(block_ctrl_c=True):  # (the queue's lock may start multiprocessing's resource tracker)
        messages = ctx.Queue()
    running: dict[int, tuple[Entry, object, float]] = {}
    by_number = {e.number: e for e in entries}
    if progress:
        progress.start(entries)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                e = todo.pop(0)
                threads = None if jobs == 1 else max(1, (os.cpu_count() or 1) // jobs)  # no oversubscription
                proc = ctx.Process(target=_work, args=(e.number, {"input": e.input, "output": e.output,
                                                                   "options": e.options, "threads": threads},
                                                       messages), daemon=True)
                with held(block_ctrl_c=True):
                    proc.start()
                    e.stage, e.status, e.ran = "start", "running", True
                    running[e.number] = (e, proc, time.perf_counter())
            try:
                msg = messages.get(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg is not None:
                _handle(msg, by_number, running, progress)
            for number, (e, proc, t0) in list(running.items()):
                if proc.exitcode is not None and number in running:
                    while True:  # its last messages may still be in the pipe
                        try:
                            _handle(messages.get(timeout=0.5), by_number, running, progress)
                        except queue.Empty:
                            break
                    if number in running:
                        code = proc.exitcode
                        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                        _finish(e, None, f"{e.input}: worker process died ({why}; out of memory?)", t0)
                        _remove_temporaries(e)
                        del running[number]
                        if progress:
                            progress.finished(e)
            if progress:
                progress.tick()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (the CLI raises `Terminated`): stop every worker, leave nothing
        for _e, proc, _ in running.values():
            proc.terminate()
        for e, proc, _ in running.values():
            proc.join(10)
            if proc.exitcode is None:  # stuck in native code: it must not go on to write its output
                proc.kill()
                proc.join()
            _remove_temporaries(e)
        raise
    finally:
        if progress:
            progress.close()
    return time.perf_counter() - start


def _handle(msg, by_number: dict[int, Entry], running: dict, progress: Progress | None) -> None:
    kind, number = msg[0], msg[1]
    e = by_number[number]
    if kind == "stage":
        e.stage = msg[2]
        if progress:
            progress.stage(e)
        return
    if number not in running:
        return
    _, proc, t0 = running.pop(number)
    _finish(e, msg[2], msg[3], t0)
    proc.join()
    if progress:
        progress.finished(e)


def _finish(e: Entry, result: dict | None, error: str | None, t0: float) -> None:
    e.seconds = time.perf_counter() - t0
    e.result, e.error = result, error
    # the report's own word (PatchReport.status), the one `patch` exits by; unchanged: with copy_unchanged, an
    # exact copy was written
    e.status = FAILED if error is not None else result["status"]
    e.stage = "done"


def _remove_temporaries(e: Entry) -> None:
    """What a killed worker may have left: its temporaries (never the output itself), and an old output pair it had
    moved aside to put the new one in place (put back, or removed): `settle_out`, which touches only what is proven
    a dead writer's (another writer of that output may be at work)."""
    if e.output:
        settle_out(Path(e.output))
