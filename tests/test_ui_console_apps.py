"""Console (telemetry charts, plan, engine figures) and Apps (endpoints, API key, agent setup) pages."""
from __future__ import annotations

import json

from PySide6.QtCore import Qt

from app.settings import Settings
from app.telemetry import GpuSensors, TelemetryMonitor, TelemetrySampler
from tests.test_telemetry import FakeNvml
from tests.ui_fixtures import make_services
from ui.views.apps import AppsView
from ui.views.console import NOT_AVAILABLE, ConsoleView, engine_figures, plan_lines


def loaded_event(plan: dict) -> dict:
    return {"type": "loaded", "id": "r1", "model_id": "freetoken-demo-random", "model_type": "qwen3_moe",
            "context_length": 4096, "plan": plan}


def test_console_on_this_machine_says_not_available(qtbot, tmp_path):
    services = make_services(tmp_path)
    monitor = TelemetryMonitor(interval_ms=30)
    view = ConsoleView(monitor, services.session)
    qtbot.addWidget(view)
    view.show()
    monitor.start()
    qtbot.waitUntil(lambda: len(monitor.buffer) >= 3, timeout=5000)
    monitor.stop()
    if not monitor.sampler.gpu.available:        # this machine: no NVIDIA driver
        assert view.metrics["vram"].value.text() == NOT_AVAILABLE
        assert view.metrics["gpu"].value.text() == NOT_AVAILABLE
        assert view.gpu_note.text().startswith("GPU sensors: not available")
        assert view.charts["temperature"].plotItem.titleLabel.text.endswith(NOT_AVAILABLE)
    assert view.metrics["ram"].value.text().endswith("GiB") and " / " in view.metrics["ram"].value.text()
    points = view.refresh_charts()
    assert points["memory"] >= 3 * 2 and points["load"] >= 3   # RAM used+total; CPU
    assert view.metrics["tokens_per_s"].value.text() == NOT_AVAILABLE
    assert "No model loaded" in view.plan_label.text()
    services.close()


def test_console_with_gpu_sensors_plan_and_stats(qtbot, tmp_path):
    services = make_services(tmp_path)
    monitor = TelemetryMonitor(TelemetrySampler(gpu=GpuSensors(FakeNvml())))
    view = ConsoleView(monitor, services.session)
    qtbot.addWidget(view)
    view.show()
    monitor.tick()
    assert view.metrics["vram"].value.text() == "3.0 GiB / 36.0 GiB"
    assert view.metrics["gpu"].value.text() == "70 °C · 250 W · 50%"
    assert view.refresh_charts()["temperature"] == 1
    session = services.session
    session._on_event(loaded_event({"backend": "hybrid", "dense_on": "gpu", "dense_bytes": 2 * 1024**3,
                                    "expert_slots": 916, "expert_total": 10240, "pool_bytes": 1.51 * 1024**3,
                                    "kv_tokens": 8192, "kv_bytes": 0.16 * 1024**3, "state_slots": 24,
                                    "state_bytes": 1.44 * 1024**3, "cpu_experts_per_layer": 3.5}))
    text = view.plan_label.text()
    assert "freetoken-demo-random — context 4,096 tokens" in text
    assert "expert slots 916 of 10,240 — 1.5 GiB" in text and "KV 8,192 tokens — 164 MiB" in text
    assert "24 state slots — 1.4 GiB" in text and "experts per layer on the CPU: 3.5" in text
    session._on_event({"type": "stats", "id": None,
                       "stats": {"queue": 0, "engine": {"decode_tokens_per_s": 23.41,
                                                        "prefix_cache": {"hits": 0, "misses": 4},
                                                        "experts": {"hit_rate": 0.75, "cpu_share": 0.25}}}})
    assert view.metrics["tokens_per_s"].value.text() == "23.4 tok/s"
    assert view.metrics["hit_rate"].value.text() == "75%"
    assert view.metrics["cpu_share"].value.text() == "25%"
    services.close()


def test_plan_and_figures_helpers():
    assert plan_lines({"summary_lines": ["backend: gpu", "KV 8K tokens — 0.16 GiB"]}) == [
        "backend: gpu", "KV 8K tokens — 0.16 GiB"]
    # an engine's plan: the planner's lines under experts.planner (what a Windows user reads about pinned layers)
    lines = ["backend: hybrid", "experts in host memory: 13.9 GiB (36 layers in pinned RAM, the rest mapped file)"]
    assert plan_lines({"backend": "hybrid", "kv_tokens": 8192, "experts": {"planner": {"summary_lines": lines}}}) == lines
    assert engine_figures({}) == {"tokens_per_s": NOT_AVAILABLE, "hit_rate": NOT_AVAILABLE,
                                  "cpu_share": NOT_AVAILABLE}
    assert engine_figures({"engine": {"experts": {"hit_rate": 0.5}}})["hit_rate"] == "50%"
    # the prefix cache's hits are not the expert cache's
    assert engine_figures({"engine": {"prefix_cache": {"hit_rate": 0.9}}})["hit_rate"] == NOT_AVAILABLE


def test_apps_endpoints_and_api_key(qtbot, tmp_path):
    services = make_services(tmp_path)
    view = AppsView(services.settings, services.session, services.agent_setup)
    qtbot.addWidget(view)
    assert view.openai_url.text() == "http://127.0.0.1:1919/v1"
    assert view.anthropic_url.text() == "http://127.0.0.1:1919"
    view.port.setValue(8088)
    view.port.editingFinished.emit()
    assert view.openai_url.text() == "http://127.0.0.1:8088/v1" and Settings().get("server_port") == 8088
    qtbot.mouseClick(view.regenerate_key, Qt.MouseButton.LeftButton)
    key = Settings().get("api_key")
    assert key.startswith("ft-") and len(key) > 30 and Settings().get("api_key") == key
    assert view.api_key.echoMode() == view.api_key.EchoMode.Password
    view.show_key.setChecked(True)
    assert view.api_key.echoMode() == view.api_key.EchoMode.Normal and view.api_key.text() == key
    assert view.new_api_key() != key                     # a new key each time
    view.clear_key.click()
    assert Settings().get("api_key") == ""
    view.enabled.setChecked(False)
    assert Settings().get("server_enabled") is False
    services.session._on_event({"type": "server_state", "id": None, "running": True,
                                "url": "http://127.0.0.1:8088", "message": None})
    assert view.server_badge.text() == "running" and "8088" in view.server_message.text()
    services.close()


def test_agent_setup_preview_apply_undo(qtbot, tmp_path):
    services = make_services(tmp_path)
    view = AppsView(services.settings, services.session, services.agent_setup)
    qtbot.addWidget(view)
    home = tmp_path / "user-home"
    claude = home / ".claude" / "settings.json"
    claude.parent.mkdir(parents=True)
    claude.write_text(json.dumps({"theme": "dark"}))
    assert view.agent_status["claude-code"].text() == "not set up"
    view.preview("claude-code")
    assert "ANTHROPIC_BASE_URL" in view.preview_text.toPlainText() and view.apply_button.isVisibleTo(view)
    assert json.loads(claude.read_text()) == {"theme": "dark"}   # nothing written before Apply
    qtbot.mouseClick(view.apply_button, Qt.MouseButton.LeftButton)
    written = json.loads(claude.read_text())
    assert written["theme"] == "dark" and written["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1919"
    assert "backup" in view.agent_message.text()
    assert view.agent_status["claude-code"].text().startswith("set up for ")
    view.undo("claude-code")
    assert json.loads(claude.read_text()) == {"theme": "dark"}
    assert view.agent_status["claude-code"].text() == "not set up"
    view.preview("aider")                                       # environment-only agents: instructions
    assert "OPENAI_BASE_URL=http://127.0.0.1:1919/v1" in view.preview_text.toPlainText()
    assert not view.apply_button.isVisibleTo(view)
    bad = home / ".codex" / "config.toml"
    bad.parent.mkdir(parents=True)
    bad.write_text("this is = = not toml")
    view.preview("codex")
    assert view.agent_message.text().startswith("Cannot set up Codex CLI")
    assert bad.read_text() == "this is = = not toml"
    services.close()
