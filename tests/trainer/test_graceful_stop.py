"""SIGINT/SIGTERM: the first asks the loop to stop at a step boundary, the second stops now."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from clew.trainer.stopping import GracefulStop


def test_first_signal_requests_a_stop_and_the_second_interrupts():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_outside_the_main_thread_signals_keep_their_handlers():
    # Whatever the process had (a job started in the background has SIGINT ignored).
    before = signal.getsignal(signal.SIGINT)
    seen = {}

    def body():
        with GracefulStop() as stop:
            seen["handler"] = signal.getsignal(signal.SIGINT)
            seen["requested"] = stop.requested

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"handler": before, "requested": False}
