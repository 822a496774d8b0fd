"""Settings, declared once.

Each setting names its type, default, description, valid values and whether a change needs a
worker restart. Validation, the CLI and the settings page are all built from SCHEMA. Values
live in `settings.json` in the user's config folder, written atomically.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.paths import user_paths


@dataclass(frozen=True)
class Setting:
    key: str
    type: type
    default: Any
    description: str
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    restart: bool = False       # a change takes effect after the worker restarts
    group: str = "General"

    def validate(self, value: Any) -> Any:
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise SettingsError(f"{self.key}: expected {self.type.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise SettingsError(f"{self.key}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        if self.minimum is not None and value < self.minimum:
            raise SettingsError(f"{self.key}: {value!r} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise SettingsError(f"{self.key}: {value!r} is above the maximum {self.maximum}")
        return value


def dense_int8_option(dense_precision: str) -> bool | None:
    """The `dense_precision` setting (or `serve --dense`) as Engine.load's `dense_int8`: None lets it decide."""
    return None if dense_precision == "auto" else dense_precision == "int8"


class SettingsError(ValueError):
    """A setting value that is the wrong type or out of range."""


SCHEMA: tuple[Setting, ...] = (
    Setting("models_dir", str, "", "Folder for downloaded and converted models (empty: the default user folder).",
            restart=True, group="Models"),
    Setting("vram_budget_gib", float, 0.0, "Cap on the VRAM FreeToken uses, in GiB (0: free VRAM less a safety margin).",
            minimum=0.0, restart=True, group="Engine"),
    Setting("context_length", int, 32768, "Context length the KV cache is sized for, in tokens.",
            minimum=512, maximum=1048576, restart=True, group="Engine"),
    Setting("cpu_experts_per_layer", int, -1, "Experts per layer computed on the CPU (-1: let the planner decide).",
            minimum=-1, restart=True, group="Engine"),
    Setting("device", str, "auto", "Where the engine runs.", choices=("auto", "cpu", "cuda"), restart=True,
            group="Engine"),
    Setting("dense_precision", str, "auto", "Dense weights on a GPU: int8 (half the bytes a token reads, VRAM for "
            "experts), the model's own precision, or auto (int8 for quantized models and models that do not fit).",
            choices=("auto", "int8", "model"), restart=True, group="Engine"),
    Setting("server_enabled", bool, True, "Serve the OpenAI/Anthropic API while a model is loaded.", group="Server"),
    Setting("server_host", str, "127.0.0.1", "Address the API binds to (anything but loopback needs an API key).",
            restart=True, group="Server"),
    Setting("server_port", int, 1919, "Port of the local API.", minimum=1, maximum=65535, restart=True,
            group="Server"),
    Setting("api_key", str, "", "API key clients must send (empty: none, loopback only).", group="Server"),
    Setting("download_concurrency", int, 2, "Files downloaded at once.", minimum=1, maximum=16, group="Downloads"),
    Setting("download_bandwidth_mib_s", float, 0.0, "Download bandwidth cap in MiB/s (0: no cap).", minimum=0.0,
            group="Downloads"),
    Setting("hf_endpoint", str, "", "Hugging Face endpoint or mirror (empty: huggingface.co).", group="Downloads"),
    Setting("auto_convert", bool, True, "Convert a model to FTW as soon as its download completes.",
            group="Downloads"),
    Setting("theme", str, "system", "Colour theme.", choices=("system", "light", "dark"), group="Appearance"),
)
BY_KEY = {s.key: s for s in SCHEMA}


class Settings:
    """The user's settings: defaults from SCHEMA, overridden by settings.json."""

    def __init__(self, path: Path | None = None):
        self.path = path or (user_paths().config / "settings.json")
        self._values: dict[str, Any] = {}
        if self.path.exists():
            try:
                raw = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise SettingsError(f"{self.path} is not valid JSON ({exc}); fix or delete it") from exc
            for key, value in raw.items():
                if key in BY_KEY:   # unknown keys from newer versions are kept out, not fatal
                    self._values[key] = BY_KEY[key].validate(value)

    def get(self, key: str) -> Any:
        return self._values.get(key, BY_KEY[key].default)

    def set(self, key: str, value: Any) -> None:
        if key not in BY_KEY:
            raise SettingsError(f"unknown setting {key!r}")
        self._values[key] = BY_KEY[key].validate(value)

    def as_dict(self) -> dict[str, Any]:
        return {s.key: self.get(s.key) for s in SCHEMA}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".settings-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(self._values, fh, indent=2, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
