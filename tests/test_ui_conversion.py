"""A conversion shown to completion: `freetoken convert --progress-json` in a child process, drawn live."""
from __future__ import annotations

import shutil

from PySide6.QtCore import Qt

from app.jobs import JobState, conversion_job
from ui.widgets.conversion_panel import ConversionPanel


def test_conversion_runs_to_completion_and_offers_load(qtbot, tiny_checkpoints, tmp_path):
    out = tmp_path / "models" / "tiny-ftw"
    job = conversion_job(tiny_checkpoints("qwen3_moe"), out=out, codec="bf16")
    panel = ConversionPanel(job, name="tiny-qwen3-moe")
    qtbot.addWidget(panel)
    seen = []
    job.progress.connect(seen.append)
    with qtbot.waitSignal(job.finished, timeout=120000):
        job.start()
    assert job.outcome.ok, job.output_text()
    # the converter throttles its lines: at least the planning and final stages, with byte counts
    stages = [e.get("stage") for e in seen if e.get("event") == "progress"]
    assert stages[0] == "planning" and stages[-1] == "done" and len(stages) >= 3
    assert seen[-2]["bytes_done"] == seen[-2]["bytes_total"] > 0
    assert panel.title.text().startswith("Conversion complete: ") and panel.title.text().endswith(" GiB ready")
    assert panel.package == str(out) and (out / "manifest.json").exists()
    assert panel.bar.value() == panel.bar.maximum()
    assert panel.load_button.isVisibleTo(panel) and not panel.cancel_button.isVisibleTo(panel)
    with qtbot.waitSignal(panel.load_requested) as load:
        qtbot.mouseClick(panel.load_button, Qt.MouseButton.LeftButton)
    assert load.args == [str(out)]


def test_conversion_failure_names_the_file(qtbot, tiny_checkpoints, tmp_path):
    source = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints("qwen3_moe"), source)
    shard = sorted(source.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:200])          # a truncated download
    job = conversion_job(source, out=tmp_path / "out", codec="bf16")
    panel = ConversionPanel(job, name="broken")
    qtbot.addWidget(panel)
    with qtbot.waitSignal(job.finished, timeout=120000):
        job.start()
    assert job.outcome.state is JobState.FAILED
    assert panel.title.text() == "Conversion of broken failed"
    assert shard.name in panel.detail.text(), panel.detail.text()
    assert not panel.load_button.isVisibleTo(panel)
    assert not (tmp_path / "out" / "manifest.json").exists()     # nothing half-written that looks good


def test_progress_line_in_words(qtbot, tmp_path):
    panel = ConversionPanel(conversion_job(tmp_path / "src"), name="m")
    qtbot.addWidget(panel)
    panel.on_progress({"event": "progress", "stage": "experts", "tensor": "model.layers.3.mlp.experts.7.up_proj",
                       "bytes_done": 2 * 1024**3, "bytes_total": 8 * 1024**3, "rate": 300 * 1024**2, "eta": 72.4})
    assert panel.bar.value() == panel.bar.maximum() // 4
    assert panel.detail.text() == ("Experts · 2.00 of 8.00 GiB · 300 MiB/s · 1 min 12 s left\n"
                                   "model.layers.3.mlp.experts.7.up_proj")
