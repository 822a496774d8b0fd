"""Shared test setup: every test runs with its own FreeToken home; tiny checkpoints are built once per run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ["HF_HUB_OFFLINE"] = "1"             # nothing in the suite may reach a hub
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for engine tests: cpu (CI) or cuda (GPU machine)")


@pytest.fixture(autouse=True)
def freetoken_home(tmp_path, monkeypatch) -> Path:
    """Isolate every test from the real user folders."""
    home = tmp_path / "freetoken-home"
    monkeypatch.setenv("FREETOKEN_HOME", str(home))
    monkeypatch.delenv("FREETOKEN_MODELS_DIR", raising=False)
    return home


@pytest.fixture(scope="session")
def device(request) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> folder of a tiny HF checkpoint; built lazily, once per test run."""
    from tests.fixtures.checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("tiny-checkpoints")
    built: dict[str, Path] = {}

    def get(family: str, seed: int = 0) -> Path:
        key = f"{family}-{seed}"
        if key not in built:
            built[key] = build_checkpoint(family, root / key, seed=seed)
        return built[key]

    return get
