"""Data shipped with FreeToken (catalog, chat templates, icons, stylesheet). No code beyond this locator."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def resource_path(*parts: str) -> Path:
    """Absolute path of a shipped resource file."""
    return ROOT.joinpath(*parts)
