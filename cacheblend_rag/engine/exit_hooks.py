"""Worker threads stopped before the interpreter finalizes, for objects their owner never closed.

A daemon thread still running Python or torch when the interpreter finalizes is killed as soon as it
next takes the GIL; when that happens inside torch's C++ (a tensor freed as a frame returns), the
unwinding aborts the whole process: ``terminate called without an active exception``, exit status 134,
after the script itself has finished. Workers are daemons so that a forgotten object cannot keep a
process alive; this module stops them in time instead.

The hook runs from :mod:`atexit`: after the interpreter has joined the program's own (non-daemon)
threads, so no caller is left to wait for a request, and before finalization, while a worker can still
return normally."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class StopsAtExit(Protocol):
    def stop_at_exit(self) -> None:
        """Give up the work nobody can wait for any more and join the worker thread."""


# Weak: a registered object is kept alive by its own worker while that runs, never by this set.
_LIVE: weakref.WeakSet[StopsAtExit] = weakref.WeakSet()


def stop_at_exit(owner: StopsAtExit) -> None:
    """Call ``owner.stop_at_exit()`` at interpreter exit unless it has been collected by then."""
    _LIVE.add(owner)


def _stop_all() -> None:
    for owner in list(_LIVE):
        try:
            owner.stop_at_exit()
        except Exception:  # one failure must not leave the others' threads running into finalization
            log.exception("stopping %r at exit failed", owner)


atexit.register(_stop_all)
