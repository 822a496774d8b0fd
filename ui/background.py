"""Run one blocking call (a hub request, a folder scan) off the UI thread and get its result back on it."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


class _Relay(QObject):
    """Lives on the UI thread; signals emitted from the worker thread are queued to it."""

    done = Signal(object)
    failed = Signal(object)


_running: set[_Relay] = set()   # keeps each relay alive until its call has answered


def run_in_thread(fn: Callable[[], Any], *, on_done: Callable[[Any], None],
                  on_error: Callable[[BaseException], None], name: str = "ui-background") -> threading.Thread:
    relay = _Relay()
    _running.add(relay)

    def finish(handler, value) -> None:
        _running.discard(relay)
        handler(value)

    relay.done.connect(lambda value: finish(on_done, value))
    relay.failed.connect(lambda exc: finish(on_error, exc))

    def work() -> None:
        try:
            result = fn()
        except Exception as exc:   # handed to on_error on the UI thread, which shows it to the user
            log.debug("background call failed: %s", exc)
            relay.failed.emit(exc)
        else:
            relay.done.emit(result)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    return thread
