"""The job object: finished exactly once, whatever happens to the child process."""
from __future__ import annotations

import sys

import pytest

from app.jobs import JobState, ProcessJob

PROGRESS_SCRIPT = r"""
import json, sys
print("warming up", flush=True)
for i in range(3):
    print(json.dumps({"stage": "experts", "tensor": f"layers.{i}", "bytes_done": i + 1, "bytes_total": 3}),
          flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.stdout.write("no newline at the end")
"""


def run_to_end(qtbot, job: ProcessJob, timeout=15000):
    finishes = []
    job.finished.connect(finishes.append)
    with qtbot.waitSignal(job.finished, timeout=timeout):
        job.start()
    qtbot.wait(50)   # a second `finished` would arrive here
    assert len(finishes) == 1
    return finishes[0]


def test_success_keeps_output_and_parses_progress(qtbot):
    job = ProcessJob(sys.executable, ["-c", PROGRESS_SCRIPT])
    events = []
    job.progress.connect(events.append)
    with qtbot.waitSignals([job.started, job.finished], order="strict", timeout=15000):
        job.start()
    outcome = job.outcome
    assert outcome.ok and outcome.state is JobState.SUCCEEDED and outcome.exit_code == 0
    assert [e["tensor"] for e in events] == ["layers.0", "layers.1", "layers.2"]
    assert outcome.last_progress["bytes_done"] == 3
    assert "warming up" in job.lines and "to stderr" in job.lines
    assert "no newline at the end" in job.lines          # the unterminated last line is kept
    assert not any(line.startswith("{") for line in job.lines)   # progress lines are not output


def test_failure_names_the_cause(qtbot):
    script = "import sys; print('reading shard-2.safetensors'); sys.exit('tensor model.layers.3.w1 is truncated')"
    outcome = run_to_end(qtbot, ProcessJob(sys.executable, ["-c", script]))
    assert outcome.state is JobState.FAILED and outcome.exit_code == 1
    assert "tensor model.layers.3.w1 is truncated" in outcome.message


def test_never_started_still_finishes_once(qtbot, tmp_path):
    job = ProcessJob(str(tmp_path / "no-such-program"), [])
    outcome = run_to_end(qtbot, job)
    assert outcome.state is JobState.FAILED and outcome.exit_code is None
    assert "could not start" in outcome.message and "no-such-program" in outcome.message


def test_cancel_stops_the_child_and_finishes_once(qtbot):
    job = ProcessJob(sys.executable, ["-c", "import time; print('busy', flush=True); time.sleep(60)"])
    finishes = []
    job.finished.connect(finishes.append)
    with qtbot.waitSignal(job.output, timeout=15000):
        job.start()
    with qtbot.waitSignal(job.finished, timeout=10000):
        job.cancel()
    job.cancel()   # a second cancel is harmless
    qtbot.wait(50)
    assert len(finishes) == 1 and finishes[0].state is JobState.CANCELLED


def test_cancel_before_start_and_restart_refused(qtbot):
    job = ProcessJob(sys.executable, ["-c", "pass"])
    with qtbot.waitSignal(job.finished, timeout=1000):
        job.cancel()
    assert job.outcome.state is JobState.CANCELLED
    done = ProcessJob(sys.executable, ["-c", "pass"])
    run_to_end(qtbot, done)
    with pytest.raises(RuntimeError, match="already started"):
        done.start()


def test_crash_is_a_failure(qtbot):
    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    outcome = run_to_end(qtbot, ProcessJob(sys.executable, ["-c", script]))
    assert outcome.state is JobState.FAILED and "crashed" in outcome.message
