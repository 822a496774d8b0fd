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


def test_no_display_means_serve_instead_of_a_window():
    from ui.entry import has_display

    assert has_display("win32", {}) and has_display("darwin", {})
    assert not has_display("linux", {})
    assert has_display("linux", {"DISPLAY": ":0"}) and has_display("linux", {"WAYLAND_DISPLAY": "wayland-0"})
    assert has_display("linux", {"QT_QPA_PLATFORM": "offscreen"})


def test_bare_freetoken_without_display_serves_the_demo(freetoken_home, tmp_path):
    import os
    import signal
    import time
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["FREETOKEN_HOME"] = str(freetoken_home)
    settings = freetoken_home / "config"
    settings.mkdir(parents=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (settings / "settings.json").write_text(json.dumps({"server_port": port}))
    proc = subprocess.Popen([sys.executable, "-m", "ui.entry"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1))
                if health.get("model"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.5)
        assert health["model"] == "freetoken-demo-random"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "No display found: serving the API" in err
