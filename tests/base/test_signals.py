"""base/signals.py: Ctrl-C and SIGTERM held while steps finish together, and every handler put back."""

from __future__ import annotations

import signal
import threading

import pytest

from deform_surgeon.base import signals


def _to_main(sig: int) -> None:
    signal.pthread_kill(threading.main_thread().ident, sig)


def test_a_ctrl_c_in_the_block_is_handled_after_it():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals.held():
            _to_main(signal.SIGINT)
            done.append("the rest of the block")
    assert done == ["the rest of the block"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_handlers_are_put_back_leaves_none_of_the_recorders(monkeypatch):
    """A Ctrl-C marked after SIGINT's handler is back but before SIGTERM's: `signal.signal` runs the restored
    SIGINT handler (KeyboardInterrupt) before it changes SIGTERM's, which would stay the block's recorder, so that
    every later SIGTERM of the process would do nothing. So each handler is put back first, then the KeyboardInterrupt
    raised."""
    sigterm = signal.getsignal(signal.SIGTERM)
    real = signal.signal

    def put_back_then_ctrl_c(sig, handler):
        old = real(sig, handler)
        if sig == signal.SIGINT and handler is signal.default_int_handler:
            _to_main(signal.SIGINT)  # marked now: the next signal.signal call runs it
        return old

    monkeypatch.setattr(signal, "signal", put_back_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with signals.held():
            pass
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is sigterm and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_ignored_stays_ignored_and_blocking_is_undone():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals.held(block_ctrl_c=True):
            assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
            _to_main(signal.SIGINT)
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_outside_the_main_thread_the_block_runs_as_it_is():
    seen = []

    def body():
        with signals.held():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
