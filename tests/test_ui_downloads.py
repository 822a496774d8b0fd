"""The Downloads page against the real download manager and the local hub server: add, pause, resume."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app.downloads import DONE, DOWNLOADING, PAUSED, PARTIAL_DIR, SOURCE_FILE
from app.settings import Settings
from tests.hub_server import HubServer
from tests.ui_fixtures import make_services
from ui.models.downloads import STATE_ROLE, duration_text, size_text
from ui.views.downloads import DownloadsView

REPO = "tiny/qwen3-moe"


@pytest.fixture
def hub(tiny_checkpoints, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)   # the local server is the only hub reachable
    with HubServer(stall_s=10.0) as server:
        server.add_folder(REPO, tiny_checkpoints("qwen3_moe"))
        yield server


@pytest.fixture
def services(hub, tmp_path):
    settings = Settings()
    settings.set("hf_endpoint", hub.url)
    settings.set("download_concurrency", 1)
    settings.save()
    services = make_services(tmp_path)
    yield services
    services.downloads.shutdown(wait=True, timeout=5)
    services.chats.close()


def state_of(view: DownloadsView, job_id: str) -> str:
    return view.model.index(view.model.row_of(job_id), 0).data(STATE_ROLE)


def test_download_paused_and_resumed_in_the_view(qtbot, qtmodeltester, hub, services):
    hub.throttle_bps = 250_000     # slow enough to pause mid-file
    view = DownloadsView(services)
    qtbot.addWidget(view)
    view.show()
    assert view.empty.isVisible() and not view.pause_button.isEnabled()
    view.repo.setText(REPO)
    with qtbot.waitSignal(view.queued, timeout=10000) as queued:
        qtbot.mouseClick(view.add_button, Qt.MouseButton.LeftButton)
    job_id = queued.args[0]
    assert view.model.rowCount() == 1 and not view.empty.isVisible()
    assert view.selected_job_id() == job_id
    qtbot.waitUntil(lambda: state_of(view, job_id) == DOWNLOADING and
                    services.downloads.job(job_id).done_bytes > 32 * 1024, timeout=10000)
    assert view.pause_button.isEnabled() and not view.resume_button.isEnabled()
    progress = view.model.index(0, 1).data()
    assert "% · " in progress and " of " in progress
    qtmodeltester.check(view.model)

    qtbot.mouseClick(view.pause_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: state_of(view, job_id) == PAUSED, timeout=10000)
    assert view.model.index(0, 4).data() == "Paused"
    assert view.resume_button.isEnabled() and view.resume_button.text() == "Resume"
    paused_at = services.downloads.job(job_id).done_bytes
    qtbot.wait(300)
    assert services.downloads.job(job_id).done_bytes == paused_at   # nothing moves while paused

    hub.throttle_bps = 0
    qtbot.mouseClick(view.resume_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: state_of(view, job_id) == DONE, timeout=20000)
    job = services.downloads.job(job_id)
    assert view.model.index(0, 4).data() == "Complete"
    assert view.model.index(0, 1).data().startswith("100% · ")
    assert (job.dest_path / SOURCE_FILE).exists() and not any((job.dest_path / PARTIAL_DIR).glob("*.part"))
    assert any(r and r.startswith("bytes=") and r != "bytes=0-" for _m, _p, r in hub.requests)  # a ranged resume
    assert not view.cancel_button.isEnabled()
    qtmodeltester.check(view.model)


def test_unknown_repo_is_explained(qtbot, hub, services):
    view = DownloadsView(services)
    qtbot.addWidget(view)
    view.add("nobody/does-not-exist")
    qtbot.waitUntil(lambda: view.add_button.isEnabled(), timeout=10000)
    assert "nobody/does-not-exist" in view.message.text()
    assert view.model.rowCount() == 0


def test_texts():
    assert size_text(3 * 1024**3) == "3.00 GiB" and size_text(5 * 1024**2) == "5.0 MiB"
    assert duration_text(None) == "—" and duration_text(75) == "1 min 15 s" and duration_text(7300) == "2 h 01 min"


def test_failure_is_explained_and_retry_completes(qtbot, hub, services, tiny_checkpoints):
    from app.downloads import FAILED, DownloadManager, RetryPolicy

    services.downloads.shutdown(wait=True, timeout=5)
    services.downloads = DownloadManager(services.paths.models, services.paths.data / "downloads.json",
                                         endpoint=hub.url, concurrency=1,
                                         retry=RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02,
                                                           stall_timeout_s=1.0, connect_timeout_s=2.0)).start()
    shard = sorted(p.name for p in tiny_checkpoints("qwen3_moe").glob("*.safetensors"))[0]
    hub.inject(shard, "500", times=-1)            # the hub keeps failing this file
    view = DownloadsView(services)
    qtbot.addWidget(view)
    with qtbot.waitSignal(view.queued, timeout=10000) as queued:
        view.add(REPO)
    job_id = queued.args[0]
    qtbot.waitUntil(lambda: state_of(view, job_id) == FAILED, timeout=20000)
    status = view.model.index(0, 4).data()
    assert status.startswith("Failed: ") and shard in status            # which file, in words
    assert view.resume_button.isEnabled() and view.resume_button.text() == "Retry"
    hub.clear_faults()
    qtbot.mouseClick(view.resume_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: state_of(view, job_id) == DONE, timeout=20000)
    assert view.model.index(0, 4).data() == "Complete"
