"""Console: live machine charts (1 Hz, 5-minute window), the memory plan and the engine's figures.

Charts come from app.telemetry's ring buffer; the plan and the engine figures (cache hit rate,
share of experts run on the CPU, tokens/s) from the worker's `loaded` and `stats` events. A sensor
this machine does not have shows "not available" in place of its number, and its chart stays empty.
"""
from __future__ import annotations

from typing import Any, Iterable

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QScrollArea, QVBoxLayout, QWidget

from app.telemetry import WINDOW_S, Sample, TelemetryMonitor
from ui.session import EngineSession

GIB = 1024**3
NOT_AVAILABLE = "not available"
CHART_HEIGHT = 230
METRIC_COLUMNS = 4


def gib(value: float | None) -> str:
    """Bytes for people: GiB with one decimal, MiB below a GiB (a small model's plan is not "0.0 GiB")."""
    if value is None:
        return NOT_AVAILABLE
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 1024**2:.0f} MiB"


def find(stats: dict[str, Any], *names: str) -> Any:
    """The first of `names` found in `stats` or one of its nested dicts (service and engine figures nest)."""
    stack: list[dict] = [stats]
    while stack:
        current = stack.pop(0)
        for name in names:
            if current.get(name) is not None:
                return current[name]
        stack.extend(v for v in current.values() if isinstance(v, dict))
    return None


def engine_figures(stats: dict[str, Any]) -> dict[str, str]:
    """The three numbers the console shows big, as text ('not available' until the engine reports them)."""
    # the engine's stats(): decode_tokens_per_s at its top, the expert tier's hit_rate and cpu_share under
    # "experts" (the resident backend has neither: every expert is on the device)
    tps = find(stats, "decode_tokens_per_s", "decode_tps")
    experts = find(stats, "experts")
    experts = experts if isinstance(experts, dict) else {}
    hit = find(experts, "hit_rate")
    cpu = find(experts, "cpu_share")
    return {
        "tokens_per_s": NOT_AVAILABLE if tps is None else f"{float(tps):.1f} tok/s",
        "hit_rate": NOT_AVAILABLE if hit is None else f"{float(hit):.0%}",
        "cpu_share": NOT_AVAILABLE if cpu is None else f"{float(cpu):.0%}",
    }


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """The memory plan in the words the original console uses; the planner's own lines when it sends them (at the
    top, or - an engine's plan - under experts.planner: slots, host memory, pinned layers and the planner's notes)."""
    planner = (plan.get("experts") or {}).get("planner") if isinstance(plan.get("experts"), dict) else None
    for source in (plan, planner or {}):
        for key in ("summary_lines", "summary"):
            if isinstance(source.get(key), list):
                return [str(x) for x in source[key]]
    lines = []
    if plan.get("backend"):
        lines.append(f"backend: {plan['backend']}")
    if plan.get("dense_bytes") is not None:
        lines.append(f"dense weights on {plan.get('dense_on', 'gpu')}: {gib(plan['dense_bytes'])}")
    if plan.get("expert_total"):
        lines.append(f"expert slots {plan.get('expert_slots', 0):,} of {plan['expert_total']:,} — "
                     f"{gib(plan.get('pool_bytes', 0))}")
    if plan.get("kv_tokens") is not None:
        lines.append(f"KV {plan['kv_tokens']:,} tokens — {gib(plan.get('kv_bytes', 0))}")
    if plan.get("state_slots"):
        lines.append(f"{plan['state_slots']} state slots — {gib(plan.get('state_bytes', 0))}")
    if plan.get("experts_in_ram_bytes"):
        lines.append(f"experts in host memory: {gib(plan['experts_in_ram_bytes'])}")
    if plan.get("cpu_experts_per_layer") and plan.get("backend") == "hybrid":
        lines.append(f"experts per layer on the CPU: {float(plan['cpu_experts_per_layer']):.1f}")
    lines.extend(str(n) for n in plan.get("notes", []) or [])
    return lines


class Chart(pg.PlotWidget):
    """One live chart over the last WINDOW_S seconds; `series` are (sample field, label, scale)."""

    PENS = ("#5b93f5", "#4cc27a", "#e0a53a", "#ef6262")

    def __init__(self, title: str, unit: str, series: Iterable[tuple[str, str, float]], *,
                 y_max: float | None = None) -> None:
        super().__init__()
        self.setBackground(None)
        self.setTitle(title)
        self.setLabel("left", unit)
        self.setLabel("bottom", "seconds")
        self.setXRange(-WINDOW_S, 0, padding=0)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        if y_max is not None:
            self.setYRange(0, y_max, padding=0.02)
        self.addLegend(offset=(5, 5))
        self.series = list(series)
        self.curves = {name: self.plot([], [], name=label, pen=pg.mkPen(self.PENS[i % len(self.PENS)], width=2))
                       for i, (name, label, _scale) in enumerate(self.series)}
        self.title = title
        self.setAccessibleName(f"{title} chart")
        self.setFixedHeight(CHART_HEIGHT)

    def refresh(self, buffer) -> int:
        """Redraw from the ring buffer; returns how many points are shown (0: no sensor gave a reading)."""
        points = 0
        for name, _label, scale in self.series:
            xs, ys = buffer.series(name)
            self.curves[name].setData(xs, [y * scale for y in ys])
            points += len(xs)
        self.setTitle(self.title if points or not len(buffer) else f"{self.title} — {NOT_AVAILABLE}")
        return points


class Metric(QFrame):
    def __init__(self, title: str) -> None:
        super().__init__()
        self.setObjectName("Card")
        layout = QVBoxLayout(self)
        caption = QLabel(title)
        caption.setProperty("muted", True)
        self.value = QLabel(NOT_AVAILABLE)
        self.value.setObjectName("Metric")
        self.value.setAccessibleName(title)
        layout.addWidget(caption)
        layout.addWidget(self.value)

    def set(self, text: str) -> None:
        self.value.setText(text)
        self.value.setAccessibleDescription(text)


class ConsoleView(QWidget):
    def __init__(self, monitor: TelemetryMonitor, session: EngineSession, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.monitor = monitor
        self.session = session
        pg.setConfigOptions(antialias=True)
        title = QLabel("Console")
        title.setObjectName("PageTitle")
        self.gpu_note = QLabel()
        self.gpu_note.setProperty("muted", True)
        self.gpu_note.setWordWrap(True)
        metrics = QGridLayout()
        self.metrics = {key: Metric(caption) for key, caption in (
            ("tokens_per_s", "Decode speed"), ("hit_rate", "Expert cache hit rate"),
            ("cpu_share", "Experts run on the CPU"), ("vram", "VRAM used / total"), ("ram", "RAM used / total"),
            ("gpu", "GPU temperature · power · load"), ("cpu", "CPU load"))}
        for i, metric in enumerate(self.metrics.values()):
            metrics.addWidget(metric, i // METRIC_COLUMNS, i % METRIC_COLUMNS)
        self.charts = {
            "memory": Chart("Memory", "GiB", [("vram_used", "VRAM used", 1 / GIB), ("vram_total", "VRAM total", 1 / GIB),
                                               ("ram_used", "RAM used", 1 / GIB), ("ram_total", "RAM total", 1 / GIB)]),
            "load": Chart("Load", "%", [("cpu_percent", "CPU", 1.0), ("gpu_util_pct", "GPU", 1.0)], y_max=100),
            "temperature": Chart("GPU temperature", "°C", [("gpu_temp_c", "GPU", 1.0)]),
            "power": Chart("GPU power", "W", [("gpu_power_w", "GPU", 1.0)]),
        }
        grid = QGridLayout()
        for i, chart in enumerate(self.charts.values()):
            grid.addWidget(chart, i // 2, i % 2)
        plan_box = QFrame()
        plan_box.setObjectName("Card")
        plan_layout = QVBoxLayout(plan_box)
        plan_title = QLabel("Memory plan")
        plan_title.setObjectName("SectionTitle")
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        self.plan_label.setAccessibleName("Memory plan")
        plan_layout.addWidget(plan_title)
        plan_layout.addWidget(self.plan_label)
        body = QWidget()
        column = QVBoxLayout(body)
        column.addWidget(title)
        column.addWidget(self.gpu_note)
        column.addLayout(metrics)
        column.addLayout(grid)
        column.addWidget(plan_box)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll)

        reason = monitor.sampler.gpu_reason
        self.gpu_note.setText(f"GPU sensors: {NOT_AVAILABLE} — {reason}" if reason else
                              "GPU: " + ", ".join(monitor.sampler.gpu.names))
        monitor.sampled.connect(self.on_sample)
        session.stats.connect(self.on_stats)
        session.model_changed.connect(self.on_model_changed)
        self.on_model_changed()
        self.on_stats(session.last_stats)
        latest = monitor.buffer.latest()
        if latest is not None:
            self.on_sample(latest)

    def on_sample(self, sample: Sample) -> None:
        self.metrics["vram"].set(NOT_AVAILABLE if sample.vram_total is None else
                                 f"{gib(sample.vram_used)} / {gib(sample.vram_total)}")
        self.metrics["ram"].set(NOT_AVAILABLE if sample.ram_total is None else
                                f"{gib(sample.ram_used)} / {gib(sample.ram_total)}")
        gpu_parts = [NOT_AVAILABLE if sample.gpu_temp_c is None else f"{sample.gpu_temp_c:.0f} °C",
                     NOT_AVAILABLE if sample.gpu_power_w is None else f"{sample.gpu_power_w:.0f} W",
                     NOT_AVAILABLE if sample.gpu_util_pct is None else f"{sample.gpu_util_pct:.0f}%"]
        self.metrics["gpu"].set(NOT_AVAILABLE if all(p == NOT_AVAILABLE for p in gpu_parts) else " · ".join(gpu_parts))
        self.metrics["cpu"].set(NOT_AVAILABLE if sample.cpu_percent is None else f"{sample.cpu_percent:.0f}%")
        if self.isVisible():   # charts redraw only when someone looks; the buffer keeps filling
            self.refresh_charts()

    def refresh_charts(self) -> dict[str, int]:
        return {name: chart.refresh(self.monitor.buffer) for name, chart in self.charts.items()}

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.refresh_charts()

    def on_stats(self, stats: dict) -> None:
        for key, text in engine_figures(stats or {}).items():
            self.metrics[key].set(text)

    def on_model_changed(self) -> None:
        if self.session.model_id:
            lines = [f"{self.session.model_id} — context {self.session.context_length:,} tokens"]
            lines += plan_lines(self.session.plan)
            self.plan_label.setText("\n".join(lines))
        else:
            self.plan_label.setText("No model loaded. The plan appears here when a model loads.")
