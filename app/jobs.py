"""Long work in a child process, wrapped in a small job object.

A `ProcessJob` starts a command through QProcess, keeps everything it prints, turns each stdout
line that is a JSON object into a `progress` signal (the `--progress-json` convention of
`freetoken convert`), and emits `finished(outcome)` exactly once: also when the program never
started, and also when it is cancelled. The outcome is a value a view can show without
re-reading the process (`JobOutcome`).

QtCore only: the app layer may not touch widgets.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, Signal

# How long a cancelled child gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE_MS = 3000
# Output kept per job; a converter printing a line per tensor stays well under this.
MAX_KEPT_LINES = 20000


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class JobOutcome:
    state: JobState
    exit_code: int | None = None
    message: str = ""                      # one line a user can read
    last_progress: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state is JobState.SUCCEEDED


class ProcessJob(QObject):
    """One child process. Signals: started(), output(str line), progress(dict), finished(JobOutcome)."""

    started = Signal()
    output = Signal(str)
    progress = Signal(dict)
    finished = Signal(object)

    def __init__(self, program: str, arguments: list[str], *, title: str = "", parent: QObject | None = None,
                 working_dir: str | None = None, environment: dict[str, str] | None = None) -> None:
        super().__init__(parent)
        self.program = program
        self.arguments = list(arguments)
        self.title = title or " ".join([program, *arguments])
        self.lines: list[str] = []            # stdout and stderr, in arrival order
        self.stdout: list[str] = []           # stdout alone (not the JSON progress lines), for a result
        self.last_progress: dict[str, Any] = {}
        self.outcome: JobOutcome | None = None
        self.state = JobState.PENDING
        self._cancel_requested = False
        self._partial = {"out": "", "err": ""}
        self._proc = QProcess(self)
        if working_dir:
            self._proc.setWorkingDirectory(working_dir)
        if environment:
            from PySide6.QtCore import QProcessEnvironment

            env = QProcessEnvironment.systemEnvironment()
            for key, value in environment.items():
                env.insert(key, value)
            self._proc.setProcessEnvironment(env)
        self._proc.started.connect(self._on_started)
        self._proc.readyReadStandardOutput.connect(lambda: self._read("out"))
        self._proc.readyReadStandardError.connect(lambda: self._read("err"))
        self._proc.errorOccurred.connect(self._on_error)
        self._proc.finished.connect(self._on_finished)

    @classmethod
    def freetoken(cls, *args: str, title: str = "", parent: QObject | None = None) -> "ProcessJob":
        """A job running `freetoken ARGS` with this interpreter (works from a venv and a bundle alike)."""
        if getattr(sys, "frozen", False):        # the PyInstaller bundle: the executable itself is `freetoken`
            return cls(sys.executable, list(args), title=title, parent=parent)
        return cls(sys.executable, ["-m", "ui.entry", *args], title=title, parent=parent)

    # -- control -------------------------------------------------------------------------
    def start(self) -> None:
        if self.state is not JobState.PENDING:
            raise RuntimeError(f"job {self.title!r} was already started")
        self.state = JobState.RUNNING
        self._proc.start(self.program, self.arguments)

    def cancel(self) -> None:
        """Ask the child to stop (SIGTERM), then kill it if it lingers. Finishes as CANCELLED."""
        if self.outcome is not None:
            return
        self._cancel_requested = True
        if self._proc.state() == QProcess.ProcessState.NotRunning:
            self._finish(JobState.CANCELLED, None, "cancelled before it started")
            return
        self._proc.terminate()
        from PySide6.QtCore import QTimer

        QTimer.singleShot(TERMINATE_GRACE_MS, self, self._kill_if_running)   # cancelled if the job goes first

    def _kill_if_running(self) -> None:
        if self._proc.state() != QProcess.ProcessState.NotRunning:
            self._proc.kill()

    @property
    def running(self) -> bool:
        return self.state is JobState.RUNNING

    def output_text(self) -> str:
        return "\n".join(self.lines)

    # -- process events ------------------------------------------------------------------
    def _on_started(self) -> None:
        self.started.emit()

    def _read(self, stream: str) -> None:
        raw = (self._proc.readAllStandardOutput() if stream == "out" else self._proc.readAllStandardError())
        text = self._partial[stream] + bytes(raw.data()).decode("utf-8", errors="replace")
        *complete, self._partial[stream] = text.split("\n")
        for line in complete:
            self._line(line.rstrip("\r"), stream)

    def _line(self, line: str, stream: str) -> None:
        if stream == "out" and line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if isinstance(event, dict):
                self.last_progress = event
                self.progress.emit(event)
                return
        if stream == "out":
            self.stdout.append(line)
        if not line:
            return
        if len(self.lines) >= MAX_KEPT_LINES:
            del self.lines[: MAX_KEPT_LINES // 10]
        self.lines.append(line)
        self.output.emit(line)

    def _flush_partial(self) -> None:
        for stream in ("out", "err"):
            rest, self._partial[stream] = self._partial[stream], ""
            if rest.strip():
                self._line(rest.rstrip("\r"), stream)

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            # No `finished` follows a failed start: this is the one place the job ends.
            self._finish(JobState.FAILED, None,
                         f"could not start {self.program}: {self._proc.errorString()}")

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        self._read("out")
        self._read("err")
        self._flush_partial()
        if self._cancel_requested:
            self._finish(JobState.CANCELLED, exit_code, "cancelled")
        elif exit_status == QProcess.ExitStatus.CrashExit:
            self._finish(JobState.FAILED, None, self._failure_message("crashed"))
        elif exit_code != 0:
            self._finish(JobState.FAILED, exit_code, self._failure_message(f"exited with code {exit_code}"))
        else:
            self._finish(JobState.SUCCEEDED, 0, "done")

    def _failure_message(self, how: str) -> str:
        # The child's last words usually name the cause (the file or tensor at fault); a JSON-lines child
        # says it as {"event": "error", "message": ...} (freetoken convert --progress-json).
        lp = self.last_progress
        error = lp.get("error") or (lp.get("message") if lp.get("event") == "error" else None)
        last = error or (self.lines[-1] if self.lines else "")
        return f"{how}: {last}" if last else how

    def _finish(self, state: JobState, exit_code: int | None, message: str) -> None:
        if self.outcome is not None:
            return
        self.state = state
        self.outcome = JobOutcome(state, exit_code, message, dict(self.last_progress))
        self.finished.emit(self.outcome)


def conversion_job(source: str | Path, *, out: str | Path | None = None, codec: str = "auto",
                   parent: QObject | None = None) -> ProcessJob:
    """`freetoken convert SOURCE --progress-json` as a job: `progress` gets the converter's events
    ({"event": "progress", stage, tensor, bytes_done, bytes_total, rate, eta}), and a successful
    outcome's `last_progress` is {"event": "done", "path": <the FTW package>}."""
    args = ["convert", str(source), "--progress-json", "--codec", codec]
    if out is not None:
        args += ["--out", str(out)]
    return ProcessJob.freetoken(*args, title=f"Convert {Path(source).name}", parent=parent)
