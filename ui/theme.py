"""Light and dark themes that follow the OS, the stylesheet, and icons drawn in the theme's colours.

The `theme` setting picks "system" (follow the OS colour scheme, and follow it when it changes),
"light" or "dark". Colours live in one table per theme; the stylesheet in resources/style/app.qss
refers to them as @name@.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources

from PySide6.QtCore import QByteArray, QSize, Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QApplication

ICON_SIZES = (16, 20, 24, 32, 48)
# Icons are drawn in one mid grey that reads on both themes, so a theme switch needs no redraw.
ICON_COLOR = "#7c8394"


@dataclass(frozen=True)
class Colors:
    window: str
    sidebar: str
    card: str
    input: str
    button: str
    hover: str
    border: str
    text: str
    muted: str
    accent: str
    accent_soft: str
    on_accent: str
    code_bg: str
    good: str
    good_soft: str
    warn: str
    warn_soft: str
    danger: str
    danger_soft: str


LIGHT = Colors(window="#fbfbfc", sidebar="#f1f2f4", card="#f6f7f9", input="#ffffff", button="#ffffff",
               hover="#e7e9ee", border="#d7dae0", text="#1d2027", muted="#6a7080", accent="#2f6fde",
               accent_soft="#dde8fb", on_accent="#ffffff", code_bg="#f4f5f7", good="#17803d", good_soft="#daf3e3",
               warn="#9a6200", warn_soft="#fbefd4", danger="#c62828", danger_soft="#fbe2e2")
DARK = Colors(window="#1b1d22", sidebar="#15171b", card="#23262d", input="#202329", button="#2a2d35",
              hover="#30343d", border="#3a3f4a", text="#e6e8ec", muted="#9aa1ae", accent="#5b93f5",
              accent_soft="#23385c", on_accent="#0d1117", code_bg="#16181c", good="#4cc27a", good_soft="#1d3a29",
              warn="#e0a53a", warn_soft="#3d3017", danger="#ef6262", danger_soft="#462126")


def os_prefers_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def resolve(choice: str) -> str:
    """'system' | 'light' | 'dark' -> 'light' | 'dark'."""
    if choice == "system":
        return "dark" if os_prefers_dark() else "light"
    return "dark" if choice == "dark" else "light"


def colors(mode: str) -> Colors:
    return DARK if mode == "dark" else LIGHT


class Theme:
    """The active theme; `apply` restyles the whole application."""

    def __init__(self) -> None:
        self.choice = "system"
        self.mode = "light"

    @property
    def colors(self) -> Colors:
        return colors(self.mode)

    def apply(self, app: QApplication, choice: str = "system") -> str:
        self.choice = choice
        self.mode = resolve(choice)
        c = self.colors
        app.setStyle("Fusion")   # the one style that honours a palette the same on every OS
        app.setPalette(palette(c))
        app.setStyleSheet(stylesheet(c))
        return self.mode

    def follow_os(self, app: QApplication, on_change=None) -> None:
        """Re-apply when the OS switches light/dark while the choice is 'system'."""
        hints = QGuiApplication.styleHints()

        def changed(_scheme) -> None:
            if self.choice == "system":
                self.apply(app, "system")
                if on_change:
                    on_change(self.mode)

        hints.colorSchemeChanged.connect(changed)


def palette(c: Colors) -> QPalette:
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: c.window, QPalette.ColorRole.WindowText: c.text,
        QPalette.ColorRole.Base: c.input, QPalette.ColorRole.AlternateBase: c.card,
        QPalette.ColorRole.Text: c.text, QPalette.ColorRole.Button: c.button,
        QPalette.ColorRole.ButtonText: c.text, QPalette.ColorRole.Highlight: c.accent,
        QPalette.ColorRole.HighlightedText: c.on_accent, QPalette.ColorRole.ToolTipBase: c.card,
        QPalette.ColorRole.ToolTipText: c.text, QPalette.ColorRole.PlaceholderText: c.muted,
        QPalette.ColorRole.Link: c.accent,
    }
    for role, value in roles.items():
        p.setColor(role, QColor(value))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c.muted))
    return p


@lru_cache(maxsize=1)
def _qss_template() -> str:
    return resources.files("resources").joinpath("style/app.qss").read_text(encoding="utf-8")


def stylesheet(c: Colors) -> str:
    qss = _qss_template()
    for name, value in asdict(c).items():
        qss = qss.replace(f"@{name}@", value)
    return qss


def _svg(name: str) -> str:
    return resources.files("resources").joinpath(f"icons/{name}.svg").read_text(encoding="utf-8")


@lru_cache(maxsize=128)
def icon(name: str, color: str | None = None) -> QIcon:
    """resources/icons/NAME.svg drawn in `color` (ICON_COLOR by default), sharp at every device pixel ratio."""
    app = QGuiApplication.instance()
    tint = color or ICON_COLOR
    renderer = QSvgRenderer(QByteArray(_svg(name).replace("currentColor", tint).encode()))
    result = QIcon()
    ratio = app.devicePixelRatio() if app else 1.0
    for size in ICON_SIZES:
        pixmap = QPixmap(QSize(size, size) * ratio)
        pixmap.setDevicePixelRatio(ratio)
        pixmap.fill(Qt.GlobalColor.transparent)
        painter = QPainter(pixmap)
        renderer.render(painter)
        painter.end()
        result.addPixmap(pixmap)
    return result
