"""The worker's end of the IPC connection: a QLocalSocket that speaks runtime.protocol frames.

The only runtime module that touches Qt (QtCore/QtNetwork): QLocalSocket is a Unix socket on Linux
and macOS and a named pipe on Windows, the same object on every platform. The socket lives on the
thread that runs the Qt event loop (the worker's main thread); `send` may be called from any thread
(the engine service thread streams tokens through it): it hops onto the socket's thread through a
queued signal, so frames are written whole and in order.
"""
from __future__ import annotations

import logging

from PySide6.QtCore import QCoreApplication, QObject, Qt, Signal, Slot
from PySide6.QtNetwork import QLocalSocket

from runtime.protocol import FrameDecoder, ProtocolError, encode_frame

log = logging.getLogger(__name__)


class EventLoop:
    """The worker's Qt event loop (the socket needs one), so that worker.py itself stays Qt-free."""

    def __init__(self):
        self.app = QCoreApplication.instance() or QCoreApplication([])

    def run(self) -> int:
        return self.app.exec()

    def exit(self, code: int) -> None:
        self.app.exit(code)


class WorkerTransport(QObject):
    received = Signal(dict)       # a message from the UI (on the socket's thread)
    broken = Signal(str)          # the connection ended or carried garbage; the reason
    _outgoing = Signal(bytes)     # any thread -> socket thread

    def __init__(self, name: str, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name
        self._decoder = FrameDecoder()
        self._closed = False
        self.socket = QLocalSocket(self)
        self.socket.readyRead.connect(self._on_ready_read)
        self.socket.disconnected.connect(lambda: self._break("the app closed the connection"))
        self._outgoing.connect(self._write, Qt.ConnectionType.QueuedConnection)

    def connect_to_server(self, timeout_ms: int = 10_000) -> bool:
        self.socket.connectToServer(self.name)
        if not self.socket.waitForConnected(timeout_ms):
            log.error("cannot connect to IPC server %r: %s", self.name, self.socket.errorString())
            return False
        return True

    def send(self, message: dict) -> None:
        """Queue `message` for the socket (thread-safe). A message that cannot be encoded is logged and
        dropped: it is our bug, and the UI must not get half a frame."""
        try:
            frame = encode_frame(message)
        except ProtocolError:
            log.exception("dropping an IPC message that cannot be sent")
            return
        self._outgoing.emit(frame)

    def flush(self, timeout_ms: int = 2000) -> None:
        """Write out what is queued (before exiting)."""
        QCoreApplication.processEvents()
        if self.socket.state() == QLocalSocket.LocalSocketState.ConnectedState:
            self.socket.flush()
            while self.socket.bytesToWrite() > 0 and self.socket.waitForBytesWritten(timeout_ms):
                pass

    @Slot(bytes)
    def _write(self, frame: bytes) -> None:
        if self.socket.state() == QLocalSocket.LocalSocketState.ConnectedState:
            self.socket.write(frame)

    @Slot()
    def _on_ready_read(self) -> None:
        try:
            messages = self._decoder.feed(bytes(self.socket.readAll().data()))
        except ProtocolError as exc:
            self._break(f"the app sent a bad frame: {exc}")
            return
        for message in messages:
            self.received.emit(message)

    def _break(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            self.broken.emit(reason)

    def close(self) -> None:
        self._closed = True
        self.socket.disconnectFromServer()
