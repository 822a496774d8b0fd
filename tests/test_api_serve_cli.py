"""`freetoken serve` as a user runs it: a subprocess, the demo model, endpoints printed, SIGTERM ends it cleanly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.api_fixtures import free_port

CLI = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]


def cli_env(home) -> dict:
    return {**os.environ, "FREETOKEN_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_serve_without_a_model_serves_the_demo_and_stops_on_sigterm(freetoken_home):
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--device", "cpu", "--context", "1024"],
                            env=cli_env(freetoken_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Press Ctrl+C"):
                break
        out = "".join(lines)
        assert "Press Ctrl+C" in out, out + proc.stderr.read() if proc.poll() is not None else out
        assert f"OpenAI API:    http://127.0.0.1:{port}/v1" in out
        assert f"Anthropic API: http://127.0.0.1:{port}" in out
        assert "freetoken-demo-random" in out and "memory plan:" in out and "context length: 1024" in out
        r = httpx.post(f"http://127.0.0.1:{port}/v1/messages", timeout=30, json={
            "model": "claude-x", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "demo model" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (freetoken_home / "models" / "freetoken-demo-random" / "manifest.json").is_file()


def test_serve_refuses_a_public_bind_without_a_key(freetoken_home):
    run = subprocess.run([*CLI, "serve", "--host", "0.0.0.0", "--port", str(free_port())], env=cli_env(freetoken_home),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "API key" in run.stderr and "0.0.0.0" in run.stderr
    assert not (freetoken_home / "models").exists() or not any((freetoken_home / "models").iterdir())


def test_serve_names_a_missing_model(freetoken_home, tmp_path):
    run = subprocess.run([*CLI, "serve", str(tmp_path / "nowhere"), "--port", str(free_port())],
                         env=cli_env(freetoken_home), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "nowhere" in run.stderr and "no such folder" in run.stderr
