"""The UI's side of the runtime worker: start it, talk to it, notice when it dies.

    client = WorkerClient()
    client.ready.connect(...)            # handshake done: requests may be sent
    client.event.connect(...)            # every event the worker sends (dict, see docs/ipc.md)
    client.crashed.connect(...)          # (reason) the worker died or broke the protocol
    client.start()
    client.load("/path/to/package", device="auto", context_length=8192)
    job = client.generate(messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 64})
    job.delta.connect(lambda kind, text: ...); job.finished.connect(lambda: print(job.outcome, job.text))

`WorkerClient` owns a QLocalServer with a unique name and a QProcess running `freetoken worker --ipc
NAME`; the worker connects back and both sides say hello with the protocol version. QtCore and
QtNetwork only (this is app/, not ui/): everything is signals on the caller's thread, nothing blocks.

`GenerationJob` is the small job object of the style guide: it keeps the output, emits `finished`
exactly once — on done, on error, on cancel, and also when the worker dies or never started — and
exposes `outcome` ("done" | "cancelled" | "error").
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import uuid

from PySide6.QtCore import QObject, QProcess, QTimer, Signal, Slot
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from runtime import protocol
from runtime.protocol import FrameDecoder, ProtocolError, encode_frame

log = logging.getLogger(__name__)

DISCONNECT_GRACE_MS = 3000         # a worker that dropped its connection has this long to exit by itself


def worker_command(ipc_name: str, extra_args: list[str] | None = None) -> tuple[str, list[str]]:
    """Program and arguments that run `freetoken worker --ipc NAME` with this very installation."""
    args = ["worker", "--ipc", ipc_name, *(extra_args or [])]
    if getattr(sys, "frozen", False):            # the PyInstaller bundle: the executable is `freetoken`
        return sys.executable, args
    return sys.executable, ["-c", "import sys; from app.cli import main; sys.exit(main())", *args]


class GenerationJob(QObject):
    delta = Signal(str, str)              # kind ("text" | "reasoning"), text
    tool_call = Signal(dict)              # a tool-call delta: index, call_id/name (first), arguments
    prefill = Signal(int, int)            # done, total prompt tokens
    finished = Signal()                   # exactly once

    def __init__(self, request_id: str, parent: QObject | None = None):
        super().__init__(parent)
        self.request_id = request_id
        self.text = ""
        self.reasoning = ""
        self.tool_calls: dict[int, dict] = {}
        self.outcome: str | None = None   # "done" | "cancelled" | "error"
        self.finish_reason: str | None = None
        self.usage: dict = {}
        self.timings: dict = {}
        self.error_code: str | None = None
        self.error: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.outcome is not None

    def _on_event(self, message: dict) -> None:
        kind = message["type"]
        if kind == "delta":
            if message["kind"] == "tool_call":
                call = self.tool_calls.setdefault(message.get("index", 0), {"id": None, "name": None, "arguments": ""})
                if message.get("name") is not None:
                    call.update(id=message.get("call_id"), name=message["name"])
                call["arguments"] += message.get("arguments", "")
                self.tool_call.emit(message)
            else:
                text = message.get("text", "")
                if message["kind"] == "reasoning":
                    self.reasoning += text
                else:
                    self.text += text
                self.delta.emit(message["kind"], text)
        elif kind == "prefill_progress":
            self.prefill.emit(int(message["done"]), int(message["total"]))
        elif kind == "done":
            self.finish_reason = message["finish_reason"]
            self.usage, self.timings = message["usage"], message["timings"]
            self._finish("cancelled" if self.finish_reason == "cancelled" else "done")
        elif kind == "error":
            self.error_code, self.error = message["code"], message["message"]
            self._finish("error")

    def _finish(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.finished.emit()


class WorkerClient(QObject):
    ready = Signal()                      # handshake done
    event = Signal(dict)                  # every event from the worker
    crashed = Signal(str)                 # the worker died unasked, or broke the protocol: the reason
    stopped = Signal(int)                 # the worker process ended (exit code); once per start

    def __init__(self, parent: QObject | None = None, *, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        super().__init__(parent)
        self.extra_args = extra_args or []
        self.env = env
        self.server: QLocalServer | None = None
        self.process: QProcess | None = None
        self.socket: QLocalSocket | None = None
        self.decoder = FrameDecoder()
        self.is_ready = False
        self.worker_pid: int | None = None
        self.jobs: dict[str, GenerationJob] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._crash_reported = False
        self.stderr_tail = ""

    # ---- lifecycle ----

    def start(self) -> None:
        """Listen on a fresh name and start the worker process; `ready` follows the handshake."""
        if self.process is not None:
            raise RuntimeError("the worker is already started; stop it first")
        self._stopping = self._crash_reported = False
        self.is_ready = False
        self.decoder = FrameDecoder()
        name = f"freetoken-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)   # only this user may connect
        if not self.server.listen(name):
            self._report_crash(f"cannot listen on IPC name {name}: {self.server.errorString()}")
            return
        self.server.newConnection.connect(self._on_connection)
        self.process = QProcess(self)
        if self.env:
            from PySide6.QtCore import QProcessEnvironment

            penv = QProcessEnvironment.systemEnvironment()
            for key, value in self.env.items():
                penv.insert(key, value)
            self.process.setProcessEnvironment(penv)
        self.process.readyReadStandardError.connect(self._on_stderr)
        self.process.errorOccurred.connect(self._on_process_error)
        self.process.finished.connect(self._on_process_finished)
        program, args = worker_command(self.server.fullServerName(), self.extra_args)
        self.process.start(program, args)

    def shutdown(self) -> None:
        """Ask the worker to exit cleanly (it answers, frees the model, ends)."""
        self._stopping = True
        if self.socket is not None and self.is_ready:
            self.request("shutdown")
        elif self.process is not None:
            self.process.kill()

    def kill(self) -> None:
        """End the worker at once (a crash from the worker's point of view; for tests and a stuck worker)."""
        if self.process is not None:
            self.process.kill()

    # ---- requests ----

    def request(self, message_type: str, /, **fields) -> str:
        """Send a request; returns its id. Raises ProtocolError on a malformed request (our bug)."""
        request_id = fields.pop("id", None) or f"r{next(self._ids)}"
        message = protocol.request(message_type, id=request_id, **fields)
        self._send(message)
        return request_id

    def load(self, model_path: str, **options) -> str:
        return self.request("load", model=str(model_path), options=options)

    def generate(self, *, messages: list[dict] | None = None, prompt: str | None = None, tools: list | None = None,
                 sampling: dict | None = None, template_kwargs: dict | None = None) -> GenerationJob:
        request_id = f"g{next(self._ids)}"
        job = GenerationJob(request_id, self)
        self.jobs[request_id] = job
        job.finished.connect(lambda: self.jobs.pop(request_id, None))
        if not self.is_ready:
            # finished on the next turn of the event loop, so the caller has connected to `finished` by then
            failure = protocol.error(request_id, "worker_crashed", "the worker is not running")
            QTimer.singleShot(0, job, lambda: job._on_event(failure))
            return job
        fields = {k: v for k, v in dict(messages=messages, prompt=prompt, tools=tools, sampling=sampling,
                                        template_kwargs=template_kwargs).items() if v is not None}
        self.request("generate", id=request_id, **fields)
        return job

    def cancel(self, job: GenerationJob) -> None:
        if not job.is_finished and self.is_ready:
            self.request("cancel", target=job.request_id)

    # ---- internals ----

    def _send(self, message: dict) -> None:
        if self.socket is None:
            raise ProtocolError("the worker is not connected")
        self.socket.write(encode_frame(message))

    @Slot()
    def _on_connection(self) -> None:
        socket = self.server.nextPendingConnection()
        if self.socket is not None:        # one worker per client: a second connection is refused
            socket.abort()
            return
        self.socket = socket
        socket.readyRead.connect(self._on_ready_read)
        socket.disconnected.connect(self._on_socket_disconnected)
        self._send(protocol.hello(version=_VERSION, pid=os.getpid()))
        if socket.bytesAvailable():      # the worker's hello may have arrived before readyRead was connected
            self._on_ready_read()

    @Slot()
    def _on_ready_read(self) -> None:
        try:
            messages = self.decoder.feed(bytes(self.socket.readAll().data()))
        except ProtocolError as exc:
            self._protocol_failure(f"the worker sent a bad frame: {exc}")
            return
        for message in messages:
            self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        if not self.is_ready:
            try:
                protocol.check_hello(message, peer="worker")
            except ProtocolError as exc:
                self._protocol_failure(str(exc))
                return
            self.is_ready = True
            self.worker_pid = message.get("pid")
            self.ready.emit()
            return
        try:
            protocol.check_event(message)
        except ProtocolError as exc:
            self._protocol_failure(f"the worker sent a bad message: {exc}")
            return
        job = self.jobs.get(message.get("id"))
        if job is not None:
            job._on_event(message)
        self.event.emit(message)

    def _protocol_failure(self, reason: str) -> None:
        log.error("worker protocol failure: %s", reason)
        self._report_crash(reason)
        if self.process is not None:
            self.process.kill()

    @Slot()
    def _on_stderr(self) -> None:
        data = bytes(self.process.readAllStandardError().data()).decode("utf-8", "replace")
        self.stderr_tail = (self.stderr_tail + data)[-4000:]

    @Slot()
    def _on_socket_disconnected(self) -> None:
        """Jobs fail now (nothing may hang); the crash itself is reported when the process ends, with its
        exit status, or — if it lingers without its connection — after a grace period, killing it."""
        self.is_ready = False
        for job in list(self.jobs.values()):
            job._on_event(protocol.error(job.request_id, "worker_crashed", "the worker closed the connection"))
        if not self._stopping and self.process is not None:
            process = self.process
            QTimer.singleShot(DISCONNECT_GRACE_MS, lambda: self._linger_check(process))

    def _linger_check(self, process: QProcess) -> None:
        if process is self.process and process.state() != QProcess.ProcessState.NotRunning:
            self._report_crash("the worker closed the connection but kept running; it was stopped")
            process.kill()

    @Slot(QProcess.ProcessError)
    def _on_process_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self._report_crash(f"the worker could not be started: {self.process.errorString()}")
            self._cleanup(-1)

    @Slot(int, QProcess.ExitStatus)
    def _on_process_finished(self, code: int, status) -> None:
        if not self._stopping or status != QProcess.ExitStatus.NormalExit:
            how = "crashed" if status != QProcess.ExitStatus.NormalExit else f"exited with code {code}"
            last = self.stderr_tail.strip().splitlines()[-1:] if self.stderr_tail.strip() else []
            self._report_crash(f"the worker {how}" + (f": {last[0]}" if last else ""))
        self._cleanup(code if status == QProcess.ExitStatus.NormalExit else -1)

    def _report_crash(self, reason: str) -> None:
        """Fail every running job once, then tell the UI (once per start)."""
        for job in list(self.jobs.values()):
            job._on_event(protocol.error(job.request_id, "worker_crashed", reason))
        if not self._crash_reported and not self._stopping:
            self._crash_reported = True
            self.crashed.emit(reason)

    def _cleanup(self, code: int) -> None:
        self.is_ready = False
        for job in list(self.jobs.values()):
            job._on_event(protocol.error(job.request_id, "worker_crashed", "the worker stopped"))
        if self.socket is not None:
            self.socket.abort()
            self.socket.deleteLater()
            self.socket = None
        if self.server is not None:
            self.server.close()
            self.server.deleteLater()
            self.server = None
        if self.process is not None:
            self.process.deleteLater()
            self.process = None
        self.stopped.emit(code)


def _read_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("freetoken")
    except PackageNotFoundError:
        return "0+unknown"


_VERSION = _read_version()   # read once at import: never an import or a disk read inside a Qt slot
