"""Where FreeToken keeps its files.

Everything lives in the platform's user folders (platformdirs). One environment variable,
FREETOKEN_HOME, moves all of them under one folder (tests, portable installs); the models
folder alone can also be moved by FREETOKEN_MODELS_DIR or the `models_dir` setting.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "FreeToken"
HOME_ENV = "FREETOKEN_HOME"
MODELS_ENV = "FREETOKEN_MODELS_DIR"


@dataclass(frozen=True)
class Paths:
    config: Path   # settings.json
    data: Path     # chats database, routing statistics, agent-config backups
    models: Path   # downloaded checkpoints and converted FTW packages
    cache: Path    # on-the-fly conversions, hub cache
    logs: Path

    def ensure(self) -> "Paths":
        for p in (self.config, self.data, self.models, self.cache, self.logs):
            p.mkdir(parents=True, exist_ok=True)
        return self


def user_paths(models_dir: str | os.PathLike | None = None) -> Paths:
    """The folders for this user. `models_dir` is the setting; the environment wins over it."""
    home = os.environ.get(HOME_ENV)
    if home:
        root = Path(home).expanduser()
        paths = Paths(config=root / "config", data=root / "data", models=root / "models",
                      cache=root / "cache", logs=root / "logs")
    else:
        paths = Paths(
            config=Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
            data=Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)),
            models=Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "models",
            cache=Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)),
            logs=Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)),
        )
    override = os.environ.get(MODELS_ENV) or models_dir
    if override:
        paths = Paths(paths.config, paths.data, Path(override).expanduser(), paths.cache, paths.logs)
    return paths


def model_state_dir(paths: Paths, package: str | os.PathLike) -> Path:
    """The folder where a model's learned state lives (the expert tier's routing statistics and learned CPU
    share: the engine reads it at load so the VRAM cache starts warm). One per package folder, under the data
    folder: its name (characters outside [A-Za-z0-9._-] replaced, so nothing escapes the folder) plus a hash of
    the package's full path, so two packages of the same name never share statistics."""
    resolved = Path(package).expanduser().resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "_", resolved.name)[:60].strip(".") or "model"
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:12]
    return paths.data / "model-state" / f"{name}-{digest}"
