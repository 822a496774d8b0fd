"""Draw the app icon (resources/icons/freetoken.png and .ico) with QPainter, offscreen.

    QT_QPA_PLATFORM=offscreen python installer/make_icon.py

The motif is the sidebar's logo (resources/icons/logo.svg: a chip with lines of text and a pin) in white
on a rounded square of the theme's accent blue, so the taskbar icon matches the window. The output is
committed; rerun this only to change the design. The .ico holds every size Windows asks for (16 to 256).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ICONS = ROOT / "resources" / "icons"
ACCENT_TOP, ACCENT_BOTTOM = "#4a86f0", "#2459c2"     # around the light theme's accent #2f6fde
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)


def draw(size: int):
    """The icon at size x size pixels, drawn on a 24-unit grid like the SVG icons."""
    from PySide6.QtCore import QPointF, QRectF, Qt
    from PySide6.QtGui import QBrush, QColor, QImage, QLinearGradient, QPainter, QPen

    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    p = QPainter(image)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.scale(size / 24, size / 24)
    gradient = QLinearGradient(QPointF(0, 0), QPointF(0, 24))
    gradient.setColorAt(0, QColor(ACCENT_TOP))
    gradient.setColorAt(1, QColor(ACCENT_BOTTOM))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(gradient))
    p.drawRoundedRect(QRectF(0.5, 0.5, 23, 23), 5, 5)
    # Small sizes get thicker strokes so the chip still reads at 16 px.
    pen = QPen(QColor("#ffffff"), 2.2 if size <= 32 else 1.8)
    pen.setCapStyle(Qt.PenCapStyle.RoundCap)
    pen.setJoinStyle(Qt.PenJoinStyle.RoundJoin)
    p.setPen(pen)
    p.setBrush(Qt.BrushStyle.NoBrush)
    p.drawRoundedRect(QRectF(6, 7, 12, 12), 2.2, 2.2)          # the chip
    p.drawLine(QPointF(12, 3.5), QPointF(12, 7))                # its pin
    for y, right in ((10.5, 15), (13, 15), (15.5, 12.5)):       # lines of text
        p.drawLine(QPointF(9, y), QPointF(right, y))
    p.end()
    return image


def png_bytes(image) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise RuntimeError("Qt could not encode the icon as PNG")
    buffer.close()
    return bytes(data)


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """A Windows .ico with PNG-compressed entries (valid since Vista; Qt has no ICO writer built in)."""
    header = (0).to_bytes(2, "little") + (1).to_bytes(2, "little") + len(pngs).to_bytes(2, "little")
    entries, blobs = b"", b""
    offset = 6 + 16 * len(pngs)
    for size, blob in sorted(pngs.items()):
        dim = 0 if size >= 256 else size      # 0 means 256 in the directory entry
        entries += bytes([dim, dim, 0, 0]) + (1).to_bytes(2, "little") + (32).to_bytes(2, "little")
        entries += len(blob).to_bytes(4, "little") + offset.to_bytes(4, "little")
        blobs += blob
        offset += len(blob)
    return header + entries + blobs


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])   # fonts and image plugins need it
    pngs = {size: png_bytes(draw(size)) for size in ICO_SIZES}
    ICONS.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: a failed run never leaves a truncated icon that looks good.
    for name, blob in (("freetoken.png", pngs[256]), ("freetoken.ico", ico_bytes(pngs))):
        tmp = ICONS / (name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(ICONS / name)
        print(f"{ICONS / name}: {len(blob):,} bytes")
    del app
    return 0


if __name__ == "__main__":
    sys.exit(main())
