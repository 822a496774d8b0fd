"""The Library page over the real library, catalog, download manager and converter."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app.catalog import load_catalog
from app.library import NEEDS_CONVERSION, NOT_DOWNLOADED, READY
from app.settings import Settings
from runtime.ftw.converter import convert
from tests.hub_server import HubServer
from tests.ui_fixtures import make_services
from ui.models.library import COLUMNS, KEY_ROLE, STATUS_ROLE
from ui.views.library import LibraryView

QWEN3 = "Qwen/Qwen3-30B-A3B-Instruct-2507"


def make_view(qtbot, services, *, estimate_fits: bool = False) -> LibraryView:
    view = LibraryView(services, estimate_fits=estimate_fits)   # fits cost a child process: only where tested
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: view.model.rowCount() > 0 and not view._refreshing, timeout=10000)
    return view


def row_text(view, key: str, column: str) -> str:
    return view.model.index(view.model.row_of(key), COLUMNS.index(column)).data()


def status(view, key: str) -> str:
    return view.model.index(view.model.row_of(key), 0).data(STATUS_ROLE)


def test_catalog_rows_and_detail_sheet(qtbot, qtmodeltester, tmp_path):
    services = make_services(tmp_path)
    view = make_view(qtbot, services)
    catalog = load_catalog()
    assert [view.model.index(r, 0).data(KEY_ROLE) for r in range(len(catalog))] == [e.repo for e in catalog]
    entry = next(e for e in catalog if e.repo == QWEN3)
    assert row_text(view, QWEN3, "Model") == entry.name
    assert row_text(view, QWEN3, "Parameters") == f"{entry.total_params / 1e9:.1f}B · {entry.active_params / 1e9:.1f}B active"
    assert row_text(view, QWEN3, "Download") == f"{entry.download_bytes / 1024**3:.1f} GiB"
    assert row_text(view, QWEN3, "Licence") == entry.licence and status(view, QWEN3) == NOT_DOWNLOADED
    # the fit badge comes from app.fit (the engine's planner) for this machine, labelled an estimate;
    # it is computed in a child process (`freetoken models --json`) so the window never imports torch
    view.request_fits()
    qtbot.waitUntil(lambda: QWEN3 in view.model.fits, timeout=60000)
    fit = view.model.fits[QWEN3]
    assert row_text(view, QWEN3, "Fit on this PC") == fit.text != "—"
    assert fit.tone in ("good", "info", "warn", "bad")
    assert "(estimate)" in fit.detail or fit.text.startswith("Does not fit")
    qtmodeltester.check(view.model)
    view.select(QWEN3)
    assert view.sheet_title.text() == entry.name and f"Repository: {QWEN3}" in view.sheet_facts.text()
    assert f"Fit on this PC (estimate): {fit.text}" in view.sheet_facts.text()
    assert view.buttons["download"].isEnabled() and not view.buttons["load"].isEnabled()
    assert not view.buttons["delete"].isEnabled()
    services.close()


def test_local_package_is_ready_loadable_and_deletable(qtbot, tiny_checkpoints, tmp_path):
    services = make_services(tmp_path)
    package = convert(tiny_checkpoints("qwen3_moe"), services.paths.models / "tiny-qwen3-f32", codec="f32")
    view = make_view(qtbot, services)
    key = next(view.model.model_at(r).key for r in range(view.model.rowCount())
               if view.model.model_at(r).package_dir == package)
    assert status(view, key) == READY
    view.select(key)
    assert view.buttons["load"].isEnabled() and view.buttons["delete"].isEnabled()
    assert f"Package: {package}" in view.sheet_facts.text()
    view.delete()                                    # the first click only arms the button
    assert view.buttons["delete"].text() == "Click again to delete" and package.exists()
    view.delete()
    qtbot.waitUntil(lambda: view.model.row_of(key) < 0, timeout=10000)
    assert not package.exists() and "freed" in view.message.text()
    services.close()


@pytest.fixture
def hub(tiny_checkpoints, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with HubServer(stall_s=10.0) as server:
        # the tiny checkpoint under a catalog repo's name, so the catalog row drives the whole flow
        server.add_folder(QWEN3, tiny_checkpoints("qwen3_moe"))
        yield server


def test_download_then_convert_from_the_library(qtbot, hub, tmp_path):
    settings = Settings()
    settings.set("hf_endpoint", hub.url)
    settings.set("auto_convert", False)
    settings.save()
    services = make_services(tmp_path)
    view = make_view(qtbot, services)
    view.select(QWEN3)
    with qtbot.waitSignal(view.downloads_requested, timeout=15000):
        qtbot.mouseClick(view.buttons["download"], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: status(view, QWEN3) == NEEDS_CONVERSION, timeout=30000)
    assert "Download complete" in view.message.text()
    view.select(QWEN3)
    assert view.buttons["convert"].isEnabled()
    job = view.convert()
    with qtbot.waitSignal(job.finished, timeout=120000):
        pass
    assert job.outcome.ok, job.output_text()
    panel = view.conversions[QWEN3]
    assert panel.title.text().startswith("Conversion complete")
    qtbot.waitUntil(lambda: status(view, QWEN3) == READY, timeout=10000)
    view.select(QWEN3)
    assert view.buttons["load"].isEnabled() and not view.buttons["convert"].isEnabled()
    services.close()


def test_hub_search_lists_moe_models_and_downloads_one(qtbot, hub, tmp_path):
    settings = Settings()
    settings.set("hf_endpoint", hub.url)
    settings.set("auto_convert", False)
    settings.save()
    services = make_services(tmp_path)
    view = make_view(qtbot, services)
    view.tabs.setCurrentIndex(1)
    view.search_field.setText("qwen3")
    qtbot.mouseClick(view.search_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: view.search_button.isEnabled() and view.results.rowCount() > 0, timeout=20000)
    repos = [view.results.item(r, 0).text() for r in range(view.results.rowCount())]
    assert QWEN3 in repos, view.search_message.text()
    row = repos.index(QWEN3)
    assert view.results.item(row, 1).text() == "qwen3_moe" and view.results.item(row, 4).text() == "yes"
    assert "Mixture-of-Experts models found" in view.search_message.text()
    view.results.selectRow(row)
    with qtbot.waitSignal(view.downloads_requested, timeout=15000):
        qtbot.mouseClick(view.hub_download, Qt.MouseButton.LeftButton)
    assert view.tabs.currentIndex() == 0
    assert [j.repo for j in services.downloads.jobs()] == [QWEN3]
    services.close()
