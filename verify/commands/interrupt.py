"""After Ctrl-C, `fuzz` and `sweep` still write the report of the cases that ran: the pool's ranks
are stopped first (no process left behind), and a second Ctrl-C, which people press while waiting,
does not cut that report off half written."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def finishing_after_interrupt() -> Iterator[None]:
    """Stop every rank pool now and ignore SIGINT until the block ends (the handler is restored
    after, so a caller in the same process, pytest included, keeps its own)."""
    from fsdp_verify.sharded.pool import close_all_pools

    on_main = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main else None
    try:
        close_all_pools()  # ranks still inside the interrupted case are killed after a 2 s grace
        yield
    finally:
        if on_main:
            signal.signal(signal.SIGINT, previous)


# Set by `noticing_interrupts`' handler: a Ctrl-C whose KeyboardInterrupt Python swallowed (raised
# inside a gc callback, Hypothesis's among them, or a `__del__`: "Exception ignored in ...").
_interrupted = threading.Event()


@contextmanager
def noticing_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt as Python's default handler does, and is remembered, so that
    one swallowed where it landed is raised again at the next `raise_if_interrupted()` (a sweep
    checks between cases). Only where SIGINT has Python's default handler: ignored (nohup) stays
    ignored, a caller's own handler (pytest's) stays its."""
    _interrupted.clear()
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def handler(signum, frame):
        _interrupted.set()
        raise KeyboardInterrupt

    printing = sys.unraisablehook

    def unraisable(info):
        # Swallowed, it is remembered and raised again: Python's "Exception ignored in ...
        # Traceback ... KeyboardInterrupt" on stderr would only alarm (CI met one in fuzz).
        if not (isinstance(info.exc_value, KeyboardInterrupt) and _interrupted.is_set()):
            printing(info)

    previous = signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = printing
        signal.signal(signal.SIGINT, previous)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that was swallowed where it landed."""
    if _interrupted.is_set():
        raise KeyboardInterrupt
