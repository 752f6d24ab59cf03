"""Ctrl-C (a notebook's Stop button) held back while a block must finish as a whole: the weight update with its
schedule and count (trainer.py), a checkpoint's or the final result's write (run_end.py)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_interrupts():
    """Hold Ctrl-C (a notebook's Stop button) until the block is done, then raise it.

    The weight update, the schedule and the step count change together inside this block, so
    an interrupt never leaves the model one step ahead of its optimizer or its history.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # handlers can only be set from the main thread; an ignored Ctrl-C (a background job) stays ignored
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt
