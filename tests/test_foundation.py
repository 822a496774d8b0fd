"""Paths, settings, logging and the CLI entry behave as the foundation promises."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from app.paths import user_paths
from app.settings import SCHEMA, Settings, SettingsError


def test_paths_follow_freetoken_home(freetoken_home, monkeypatch, tmp_path):
    paths = user_paths().ensure()
    assert paths.models == freetoken_home / "models" and paths.models.is_dir()
    assert all(str(p).startswith(str(freetoken_home)) for p in vars(paths).values())
    assert user_paths(models_dir=tmp_path / "m").models == tmp_path / "m"          # the setting
    monkeypatch.setenv("FREETOKEN_MODELS_DIR", str(tmp_path / "env"))
    assert user_paths(models_dir=tmp_path / "m").models == tmp_path / "env"        # env wins


def test_settings_round_trip_and_validation(freetoken_home):
    s = Settings()
    assert s.get("server_port") == 1919 and s.get("server_host") == "127.0.0.1"
    s.set("server_port", 8080)
    s.set("vram_budget_gib", 8)             # an int is accepted for a float setting
    s.save()
    again = Settings()
    assert again.get("server_port") == 8080 and again.get("vram_budget_gib") == 8.0
    with pytest.raises(SettingsError, match="maximum"):
        s.set("server_port", 70000)
    with pytest.raises(SettingsError, match="not one of"):
        s.set("device", "tpu")
    with pytest.raises(SettingsError, match="expected int"):
        s.set("server_port", "80")
    assert {x.key for x in SCHEMA} >= {"models_dir", "vram_budget_gib", "context_length", "cpu_experts_per_layer"}


def test_corrupt_settings_file_is_reported(freetoken_home):
    path = user_paths().ensure().config / "settings.json"
    path.write_text("{not json")
    with pytest.raises(SettingsError, match="not valid JSON"):
        Settings()


def test_logging_writes_to_user_log_folder(freetoken_home):
    from app.logs import setup_logging

    log_file = setup_logging(user_paths().logs, name="t", stderr=False)
    logging.getLogger("freetoken.test").warning("hello from the test")
    for h in logging.getLogger().handlers:
        h.flush()
    assert "hello from the test" in log_file.read_text()
    assert log_file.parent == freetoken_home / "logs"


def test_cli_version_and_info(freetoken_home):
    out = subprocess.run([sys.executable, "-m", "ui.entry", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("freetoken ")
    out = subprocess.run([sys.executable, "-m", "ui.entry", "info", "--json"], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout)["folders"]["models"] == str(freetoken_home / "models")
    # headless commands never load the GUI toolkit
    probe = "import sys, ui.entry; ui.entry.main(['info']); assert 'PySide6.QtWidgets' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
