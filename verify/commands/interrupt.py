"""After Ctrl-C, `fuzz` and `sweep` still write the report of the cases that ran: the pool's ranks
are stopped first (no process left behind), and a second Ctrl-C, which people press while waiting,
does not cut that report off half written."""

from __future__ import annotations

import signal
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
