"""The session's view of app.worker_client.WorkerClient: requests may be sent before the handshake.

EngineSession wants a client with `event(dict)`, `exited(str)`, `start()`, `stop()` and
`request(kind, **fields) -> id`. WorkerClient is that, except that it refuses requests until the
worker has said hello; the adapter queues them (with their ids already chosen, so the session can
track them) and sends them in order on `ready`, where it also hands the session a hello event.
"""
from __future__ import annotations

import importlib.metadata  # noqa: F401  (the client reads our version at the worker's hello: import it now,
                          # at startup, not in the middle of a session where an import stalls the loop)
import itertools
from typing import Any

from PySide6.QtCore import QObject, Signal

from runtime import protocol


class QueuedWorker(QObject):
    event = Signal(dict)
    exited = Signal(str)

    def __init__(self, client, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        client.setParent(self)          # the client (and its QProcess) lives as long as this adapter
        self._queue: list[tuple[str, dict[str, Any]]] = []
        self._ids = itertools.count(1)
        client.ready.connect(self._on_ready)
        client.event.connect(self.event)
        client.crashed.connect(self.exited)

    def start(self) -> None:
        self.client.start()

    def stop(self, *, wait_ms: int = 0) -> None:
        """A clean shutdown (the worker frees the model and exits); no `exited` follows. With `wait_ms`
        (quitting the app) wait that long for the process to end, then kill it."""
        self._queue.clear()
        try:
            self.client.crashed.disconnect(self.exited)
        except (RuntimeError, TypeError):
            pass   # already disconnected
        process = self.client.process
        if process is None:
            self.deleteLater()
            return
        self.client.stopped.connect(self.deleteLater)
        self.client.shutdown()
        if wait_ms:
            if self.client.socket is not None:
                self.client.socket.flush()
            if not process.waitForFinished(wait_ms):
                process.kill()
                process.waitForFinished(wait_ms)

    def kill(self) -> None:
        self.client.kill()

    def request(self, kind: str, **fields) -> str:
        request_id = f"u{next(self._ids)}"
        if self.client.is_ready:
            self.client.request(kind, id=request_id, **fields)
        else:
            protocol.request(kind, id=request_id, **fields)   # a malformed request fails here, not later
            self._queue.append((kind, {"id": request_id, **fields}))
        return request_id

    def _on_ready(self) -> None:
        self.event.emit(protocol.hello(version=None, pid=self.client.worker_pid))
        queued, self._queue = self._queue, []
        for kind, fields in queued:
            self.client.request(kind, **fields)


def make_worker_factory(module):
    """A callable returning a fresh QueuedWorker over module.WorkerClient (one per worker start). The
    worker inherits this process's environment, so it finds the same FreeToken home and settings."""

    def factory() -> QueuedWorker:
        return QueuedWorker(module.WorkerClient())

    return factory
