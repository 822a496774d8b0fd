"""A running conversion: stage, tensor, bytes, rate and ETA from the converter's JSON lines, then
"Conversion complete: 19.5 GiB ready" with a Load button, or the failure with the file at fault."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from app.jobs import JobOutcome, JobState, ProcessJob

GIB = 1024**3
MIB = 1024**2
BAR_STEPS = 1000
STAGE_WORDS = {"planning": "Planning", "resuming": "Resuming", "dense": "Dense weights", "experts": "Experts",
               "finishing": "Finishing", "done": "Done"}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def eta_text(seconds) -> str:
    if seconds is None:
        return "estimating…"
    s = int(seconds)
    return f"{s // 60} min {s % 60:02d} s left" if s >= 60 else f"{s} s left"


class ConversionPanel(QFrame):
    load_requested = Signal(str)     # the FTW package folder
    dismissed = Signal()

    def __init__(self, job: ProcessJob, *, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        self.job = job
        self.name = name
        self.package: str | None = None
        layout = QVBoxLayout(self)
        self.title = QLabel(f"Converting {name} to FreeToken's format")
        self.title.setObjectName("SectionTitle")
        self.bar = QProgressBar()
        self.bar.setRange(0, BAR_STEPS)
        self.bar.setAccessibleName(f"Conversion progress of {name}")
        self.detail = QLabel("Starting the converter…")
        self.detail.setProperty("muted", True)
        self.detail.setWordWrap(True)
        buttons = QHBoxLayout()
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName(f"Cancel the conversion of {name}")
        self.cancel_button.clicked.connect(job.cancel)
        self.load_button = QPushButton("Load")
        self.load_button.setProperty("primary", True)
        self.load_button.setAccessibleName(f"Load {name}")
        self.load_button.clicked.connect(lambda: self.package and self.load_requested.emit(self.package))
        self.load_button.hide()
        self.close_button = QPushButton("Close")
        self.close_button.setAccessibleName("Close this conversion panel")
        self.close_button.clicked.connect(self.dismissed)
        self.close_button.hide()
        buttons.addStretch(1)
        for button in (self.cancel_button, self.load_button, self.close_button):
            buttons.addWidget(button)
        layout.addWidget(self.title)
        layout.addWidget(self.bar)
        layout.addWidget(self.detail)
        layout.addLayout(buttons)
        job.progress.connect(self.on_progress)
        job.finished.connect(self.on_finished)

    def on_progress(self, event: dict) -> None:
        if event.get("event") not in (None, "progress"):
            return
        done, total = event.get("bytes_done", 0), event.get("bytes_total", 0)
        self.bar.setValue(int(BAR_STEPS * done / total) if total else 0)
        stage = STAGE_WORDS.get(event.get("stage", ""), event.get("stage", ""))
        rate = event.get("rate") or 0.0
        parts = [stage, f"{done / GIB:.2f} of {total / GIB:.2f} GiB"]
        if rate:
            parts.append(f"{rate / MIB:.0f} MiB/s")
        parts.append(eta_text(event.get("eta")))
        tensor = event.get("tensor")
        self.detail.setText(" · ".join(parts) + (f"\n{tensor}" if tensor else ""))

    def on_finished(self, outcome: JobOutcome) -> None:
        self.cancel_button.hide()
        self.close_button.show()
        if outcome.ok and outcome.last_progress.get("path"):
            self.package = outcome.last_progress["path"]
            size = folder_bytes(Path(self.package))
            self.bar.setValue(BAR_STEPS)
            self.title.setText(f"Conversion complete: {size / GIB:.2f} GiB ready")
            self.detail.setText(self.package)
            self.load_button.show()
        elif outcome.state is JobState.CANCELLED:
            self.title.setText(f"Conversion of {self.name} cancelled")
            self.detail.setText("Converting again resumes where it stopped.")
        else:
            self.title.setText(f"Conversion of {self.name} failed")
            self.detail.setText(outcome.message)
        self.title.setAccessibleName(self.title.text())
