"""The download manager against a local hub-compatible server, through the real huggingface_hub client."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.downloads import (DONE, FAILED, PARTIAL_DIR, PAUSED, SOURCE_FILE, DiskSpaceError, DownloadError,
                           DownloadManager, RetryPolicy)
from tests.hub_server import HubServer

REPO = "tiny/qwen3-moe"
FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05, stall_timeout_s=1.0, connect_timeout_s=2.0)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def online(monkeypatch):
    """The suite runs offline (conftest); these tests may reach only the local server."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(tiny_checkpoints, online):
    with HubServer(stall_s=10.0) as server:
        server.add_folder(REPO, tiny_checkpoints("qwen3_moe"))
        yield server


@pytest.fixture
def models(tmp_path) -> Path:
    return tmp_path / "models"


def manager(hub, models, **kw) -> DownloadManager:
    kw.setdefault("retry", FAST_RETRY)
    return DownloadManager(models, models.parent / "data" / "downloads.json", endpoint=hub.url, **kw)


def shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def assert_identical(src: Path, dest: Path, names: list[str]) -> None:
    for name in names:
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def test_download_verifies_every_file_and_reports_progress(hub, models, tiny_checkpoints):
    src = tiny_checkpoints("qwen3_moe")
    events = []
    mgr = manager(hub, models, concurrency=2)
    mgr.add_listener(events.append)
    completed = []
    mgr.on_complete(completed.append)
    job = mgr.add(REPO)
    assert job.revision == hub.repos[REPO].sha          # pinned to the commit, not "main"
    mgr.start()
    done = mgr.wait(job.id, timeout=30)
    mgr.shutdown()
    assert done.state == DONE and done.done_bytes == done.total_bytes > 0
    names = sorted(p.name for p in src.iterdir())
    assert sorted(f.path for f in done.files) == names
    assert_identical(src, done.dest_path, names)
    source = json.loads((done.dest_path / SOURCE_FILE).read_text())
    assert source["repo_id"] == REPO and source["revision"] == hub.repos[REPO].sha
    shard = shards(src)[0]
    assert source["files"][shard]["sha256"] == hashlib.sha256((src / shard).read_bytes()).hexdigest()
    assert not (done.dest_path / PARTIAL_DIR).exists()
    progress = [e.job.done_bytes for e in events if e.kind == "progress"]
    assert progress == sorted(progress) and progress[-1] == done.total_bytes
    assert all(f.done <= f.size for e in events for f in e.job.files)
    assert [e.kind for e in events].count("file_done") == len(names)
    assert [j.repo for j in completed] == [REPO]
    assert "done 100.0%" in done.summary()
    # requests went to the commit, through the resolve endpoint
    assert all(f"/resolve/{hub.repos[REPO].sha}/" in p for m, p, _ in hub.requests if m == "GET" and "resolve" in p)


def test_allow_patterns_pick_the_files(hub, models):
    mgr = manager(hub, models)
    job = mgr.add(REPO, allow_patterns=["*.json"])
    assert job.files and all(f.path.endswith(".json") for f in job.files)
    mgr.start()
    done = mgr.wait(job.id, timeout=20)
    mgr.shutdown()
    assert done.state == DONE
    assert not list(done.dest_path.glob("*.safetensors"))
    with pytest.raises(DownloadError, match="no file matches"):
        manager(hub, models).add(REPO, allow_patterns=["*.gguf"])


def test_pause_then_resume_continues_from_the_partial_file(hub, models, tiny_checkpoints):
    hub.throttle_bps = 300_000
    mgr = manager(hub, models, concurrency=1)
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    mgr.start()
    first = shards(tiny_checkpoints("qwen3_moe"))[0]
    part = job.dest_path / PARTIAL_DIR / (first + ".part")
    wait_for(lambda: part.exists() and part.stat().st_size > 16 * 1024)
    mgr.pause(job.id)
    paused = mgr.wait(job.id, timeout=10, states=(PAUSED,))
    assert paused.state == PAUSED
    time.sleep(0.3)
    size = part.stat().st_size
    time.sleep(0.3)
    assert part.stat().st_size == size > 0               # nothing moves while paused
    hub.throttle_bps = 0
    mgr.resume(job.id)
    done = mgr.wait(job.id, timeout=30, states=(DONE, FAILED))
    mgr.shutdown()
    assert done.state == DONE, done.error
    assert f"bytes={size}-" in hub.file_requests(first)   # resumed with a Range request, not from zero
    assert_identical(tiny_checkpoints("qwen3_moe"), done.dest_path, shards(done.dest_path))


def test_killed_mid_file_resumes_after_restart_to_a_verified_file(hub, models, tiny_checkpoints, freetoken_home):
    state = models.parent / "data" / "downloads.json"
    hub.throttle_bps = 200_000
    script = textwrap.dedent(f"""
        import time
        from app.downloads import DownloadManager
        m = DownloadManager({str(models)!r}, {str(state)!r}, endpoint={hub.url!r}, concurrency=1)
        job = m.add({REPO!r}, allow_patterns=["*.safetensors"])
        m.start()
        time.sleep(60)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT)
    try:
        partial = models / REPO.replace("/", "--") / PARTIAL_DIR
        wait_for(lambda: partial.exists() and any(p.stat().st_size > 32 * 1024 for p in partial.glob("*.part")), 30)
    finally:
        proc.send_signal(signal.SIGKILL)                  # no cleanup, no final save
        proc.wait(10)
    parts = {p.name[:-len(".part")]: p.stat().st_size for p in partial.glob("*.part")}
    assert parts and state.exists()
    hub.throttle_bps = 0
    mgr = DownloadManager(models, state, endpoint=hub.url, retry=FAST_RETRY)
    [job] = mgr.jobs()
    assert job.state == "queued" and job.done_bytes >= sum(parts.values())   # the restart sees the partials
    mgr.start()
    done = mgr.wait(job.id, timeout=30, states=(DONE, FAILED))
    mgr.shutdown()
    assert done.state == DONE, done.error
    for name, size in parts.items():
        assert f"bytes={size}-" in hub.file_requests(name)
    assert_identical(tiny_checkpoints("qwen3_moe"), done.dest_path, shards(tiny_checkpoints("qwen3_moe")))


def test_server_errors_truncated_bodies_and_stalls_are_retried(hub, models, tiny_checkpoints):
    names = shards(tiny_checkpoints("qwen3_moe"))
    hub.inject(names[0], "500", times=2)
    hub.inject(names[1], "truncate", times=1)
    hub.inject(names[2], "stall", times=1)
    mgr = manager(hub, models)
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    mgr.start()
    done = mgr.wait(job.id, timeout=30)
    mgr.shutdown()
    assert done.state == DONE, done.error
    assert len(hub.file_requests(names[0])) == 3
    # the truncated and stalled bodies were resumed from where they broke off
    assert any(r and r.startswith("bytes=") for r in hub.file_requests(names[1]))
    assert any(r and r.startswith("bytes=") for r in hub.file_requests(names[2]))
    assert_identical(tiny_checkpoints("qwen3_moe"), done.dest_path, names)


@pytest.mark.parametrize("fault, said", [("500", "server error 500"), ("truncate", "network error"),
                                         ("stall", "stalled")])
def test_persistent_faults_are_retried_then_reported_by_file(hub, models, tiny_checkpoints, fault, said):
    bad = shards(tiny_checkpoints("qwen3_moe"))[1]
    hub.inject(bad, fault, times=-1)
    mgr = manager(hub, models, retry=RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05,
                                                 stall_timeout_s=0.5, connect_timeout_s=2.0))
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    mgr.start()
    failed = mgr.wait(job.id, timeout=30)
    assert failed.state == FAILED
    assert bad in failed.error and said in failed.error and "after 3 attempts" in failed.error
    if fault != "500":
        # a body cut short leaves a partial each time: later attempts resume it with Range, and only
        # attempts that add nothing count towards giving up
        assert any(r and r.startswith("bytes=") for r in hub.file_requests(bad))
    assert not (failed.dest_path / bad).exists() and not (failed.dest_path / SOURCE_FILE).exists()
    hub.clear_faults()                                     # the server recovers: retry the job
    mgr.resume(job.id)
    done = mgr.wait(job.id, timeout=30, states=(DONE, FAILED))
    mgr.shutdown()
    assert done.state == DONE, done.error


def test_checksum_mismatch_is_rejected(hub, models, tiny_checkpoints):
    names = shards(tiny_checkpoints("qwen3_moe"))
    hub.inject(names[0], "corrupt", times=1)               # one bad transfer: fetched afresh
    hub.inject(names[1], "corrupt", times=-1)              # always bad: rejected
    mgr = manager(hub, models, concurrency=1)              # in order: the first file is done before the job fails
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    mgr.start()
    failed = mgr.wait(job.id, timeout=30)
    mgr.shutdown()
    assert failed.state == FAILED
    assert names[1] in failed.error and "checksum mismatch" in failed.error and "sha256" in failed.error
    assert not (failed.dest_path / names[1]).exists()
    assert not (failed.dest_path / PARTIAL_DIR / (names[1] + ".part")).exists()
    assert (failed.dest_path / names[0]).read_bytes() == (tiny_checkpoints("qwen3_moe") / names[0]).read_bytes()
    assert not (failed.dest_path / SOURCE_FILE).exists()


def test_too_little_disk_is_refused_before_starting(hub, models):
    tiny_disk = lambda path: SimpleNamespace(free=100_000, total=10**9, used=0)   # noqa: E731
    mgr = manager(hub, models, disk_usage=tiny_disk)
    with pytest.raises(DiskSpaceError, match="not enough disk space.*needs"):
        mgr.add(REPO)
    assert mgr.jobs() == [] and not (models / REPO.replace("/", "--")).exists()


def test_disk_full_while_writing_leaves_nothing_corrupt(hub, models, tiny_checkpoints):
    victim = shards(tiny_checkpoints("qwen3_moe"))[0]

    class FullDisk:
        """The write path of a disk that fills up 40 KiB into the victim file."""

        def __init__(self, path, mode):
            self.fh = open(path, mode)
            self.victim = path.name.startswith(victim)

        def write(self, data):
            if self.victim and self.fh.tell() + len(data) > 40 * 1024:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    mgr = manager(hub, models, concurrency=1, open_part=FullDisk)
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    mgr.start()
    failed = mgr.wait(job.id, timeout=30)
    mgr.shutdown()
    assert failed.state == FAILED and "disk full" in failed.error and victim in failed.error
    assert not (failed.dest_path / victim).exists()
    assert not (failed.dest_path / PARTIAL_DIR / (victim + ".part")).exists()
    assert not (failed.dest_path / SOURCE_FILE).exists()


def test_gated_repo_needs_the_token_huggingface_hub_keeps(hub, models, tiny_checkpoints, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub.add_folder("org/gated-moe", tiny_checkpoints("qwen3_moe"), gated=True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(DownloadError, match="gated.*hf auth login"):
        manager(hub, models).add("org/gated-moe")
    (tmp_path / "token").write_text(hub.token)             # what `hf auth login` writes
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    mgr = manager(hub, models)
    job = mgr.add("org/gated-moe", allow_patterns=["config.json"])
    mgr.start()
    done = mgr.wait(job.id, timeout=20)
    mgr.shutdown()
    assert done.state == DONE
    with pytest.raises(DownloadError, match="repository not found"):
        mgr.add("org/does-not-exist")


def test_cancel_removes_partial_and_finished_files(hub, models):
    hub.throttle_bps = 200_000
    mgr = manager(hub, models, concurrency=1)
    job = mgr.add(REPO, allow_patterns=["*.json", "*.safetensors"])
    mgr.start()
    wait_for(lambda: mgr.job(job.id).done_bytes > 64 * 1024)
    mgr.cancel(job.id)
    mgr.shutdown()
    assert mgr.jobs() == []
    dest = job.dest_path
    assert not (dest / PARTIAL_DIR).exists()
    assert not [p for p in dest.rglob("*") if p.is_file()] if dest.exists() else True
    assert json.loads((models.parent / "data" / "downloads.json").read_text())["jobs"] == []


def test_bandwidth_cap_and_paused_state_survive(hub, models):
    mgr = manager(hub, models, concurrency=2, bandwidth_bytes_s=400_000)
    events = []
    mgr.add_listener(events.append)
    job = mgr.add(REPO, allow_patterns=["*.safetensors"])
    started = time.monotonic()
    mgr.start()
    done = mgr.wait(job.id, timeout=30)
    elapsed = time.monotonic() - started
    mgr.shutdown()
    assert done.state == DONE
    assert elapsed >= 0.8 * done.total_bytes / 400_000     # two workers share one cap
    assert max(e.job.rate for e in events if e.kind == "progress") > 0
    # per-file progress: bytes, rate and ETA of files part-way through
    assert any(0 < f.done < f.size and f.rate > 0 and f.eta_s is not None
               for e in events if e.kind == "progress" for f in e.job.files)
    # a paused job stays paused across a restart
    mgr2 = manager(hub, models)
    job2 = mgr2.add("tiny/qwen3-moe", allow_patterns=["*.json"], dest=models / "second")
    mgr2.pause(job2.id)
    reloaded = manager(hub, models)
    assert {j.id: j.state for j in reloaded.jobs()}[job2.id] == PAUSED


# ------------------------------------------------------------------------------------------ the library


def test_library_follows_a_model_from_catalog_to_ready_and_deletes_it(hub, models, tiny_checkpoints):
    from app.catalog import load_catalog
    from app.library import (CONVERTING, DOWNLOADING, NEEDS_CONVERSION, NOT_DOWNLOADED, READY, Library,
                             LibraryError, conversion_hook)
    from runtime.ftw.converter import convert, default_output_name, resolve_codec

    hub.throttle_bps = 300_000
    mgr = manager(hub, models, concurrency=1)
    offered, converted = [], []
    mgr.on_complete(conversion_hook(auto_convert=False, convert=converted.append, offer=offered.append))
    lib = Library(models, downloads=mgr)
    statuses = {m.key: m.status for m in lib.models()}
    assert statuses["Qwen/Qwen3-30B-A3B-Instruct-2507"] == NOT_DOWNLOADED
    assert len(statuses) == len(load_catalog())            # an empty folder shows just the catalog

    job = mgr.add(REPO)
    mgr.start()
    wait_for(lambda: mgr.job(job.id).done_bytes > 0)
    model = lib.get(REPO)
    assert model.status == DOWNLOADING and "%" in model.detail
    with pytest.raises(LibraryError, match="cancel the download first"):
        lib.delete(REPO)
    hub.throttle_bps = 0
    assert mgr.wait(job.id, timeout=30).state == DONE
    mgr.shutdown()
    model = lib.get(REPO)
    assert model.status == NEEDS_CONVERSION and model.source_dir == job.dest_path
    assert offered == [job.dest_path] and converted == []  # the hook offered conversion, did not start it

    name = default_output_name(job.dest_path, resolve_codec(job.dest_path, "auto"))
    (models / (name + ".partial")).mkdir()
    assert lib.get(REPO).status == CONVERTING
    (models / (name + ".partial")).rmdir()
    package = convert(job.dest_path, models / name)       # the FTW engineer's converter, for real
    model = lib.get(REPO)
    assert model.status == READY and model.package_dirs == (package,)
    assert model.bytes_on_disk > sum(f.size for f in job.files)

    freed = lib.delete(REPO)
    assert freed == model.bytes_on_disk
    assert not job.dest_path.exists() and not package.exists()
    assert REPO not in {m.key for m in lib.models()}       # not in the catalog: gone from the list
    assert mgr.jobs() == []


def test_download_command_fetches_converts_and_the_library_shows_it_ready(hub, freetoken_home, tiny_checkpoints, capsys):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT), "FREETOKEN_HOME": str(freetoken_home)}
    cmd = [sys.executable, "-m", "ui.entry", "download", REPO, "--endpoint", hub.url, "--progress-json", "--convert"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    progress = [e for e in events if e["event"] == "progress" and "total" in e]
    assert progress and progress[-1]["done"] == progress[-1]["total"]
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 2                                   # the download, then the conversion
    package = Path(done[-1]["path"])
    assert (package / "manifest.json").exists()
    assert json.loads((package / "manifest.json").read_text())["source"]["repo_id"] == REPO
    from app.cli import main

    capsys.readouterr()
    assert main(["models", "list", "--json", "--cpu-gbps", "10", "--context", "8192"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["context_length"] == 8192
    rows = {r["key"]: r for r in listed["models"]}
    assert rows[REPO]["status"] == "ready"
    # a model outside the catalog is fitted from its package: its codec and its real expert block size
    manifest = json.loads((package / "manifest.json").read_text())
    assert rows[REPO]["fit"]["codec"] == manifest["experts"]["codec"]
    assert rows[REPO]["fit"]["plan"]["expert_block_bytes"] == manifest["experts"]["block_nbytes"]
    assert rows["Qwen/Qwen3-30B-A3B-Instruct-2507"]["status"] == "not downloaded"
    assert rows["Qwen/Qwen3-30B-A3B-Instruct-2507"]["fit_badge"]
    # an architecture FreeToken cannot run is refused before any byte is fetched
    hub.add_config_only("meta/llama", {"model_type": "llama"})
    assert main(["download", "meta/llama", "--endpoint", hub.url]) == 1
    err = capsys.readouterr().err
    assert "llama" in err and "--force" in err
    assert not [p for _, p, _ in hub.requests if p.startswith("/meta/llama/resolve/")]


def test_file_names_that_escape_the_model_folder_are_refused(hub, models):
    from tests.hub_server import RepoFile

    hub.add_repo("org/evil", {"config.json": RepoFile("config.json", b"{}", lfs=False),
                              "../../outside.json": RepoFile("../../outside.json", b"{}", lfs=False)})
    with pytest.raises(DownloadError, match="outside the model folder"):
        manager(hub, models).add("org/evil")
    assert not (models.parent / "outside.json").exists()


def test_a_mirror_without_file_metadata_is_verified_from_the_file_headers(hub, models, tiny_checkpoints):
    hub.blobs_listing = False                               # sizes and checksums only in HEAD headers
    names = shards(tiny_checkpoints("qwen3_moe"))
    hub.inject(names[1], "corrupt", times=-1)
    mgr = manager(hub, models, concurrency=1)
    job = mgr.add(REPO, allow_patterns=["*.safetensors", "config.json"])
    heads = [p for m, p, _ in hub.requests if m == "HEAD"]
    assert len(heads) == len(job.files)                     # one HEAD per file for its metadata
    by_path = {f.path: f for f in job.files}
    assert by_path[names[0]].sha256 == hashlib.sha256((tiny_checkpoints("qwen3_moe") / names[0]).read_bytes()).hexdigest()
    assert by_path["config.json"].blob_id and by_path["config.json"].sha256 is None
    mgr.start()
    failed = mgr.wait(job.id, timeout=30)
    mgr.shutdown()
    assert failed.state == FAILED and names[1] in failed.error and "checksum mismatch" in failed.error
    assert (failed.dest_path / names[0]).read_bytes() == (tiny_checkpoints("qwen3_moe") / names[0]).read_bytes()
    assert (failed.dest_path / "config.json").read_bytes() == (tiny_checkpoints("qwen3_moe") / "config.json").read_bytes()


def test_an_unreadable_queue_file_is_set_aside_not_fatal(hub, models):
    state = models.parent / "data" / "downloads.json"
    state.parent.mkdir(parents=True)
    state.write_text("{ not json")
    mgr = manager(hub, models)
    assert mgr.jobs() == []
    assert state.with_suffix(".bad.json").read_text() == "{ not json"
    job = mgr.add(REPO, allow_patterns=["config.json"])     # and the queue works again
    assert json.loads(state.read_text())["jobs"][0]["id"] == job.id


def test_library_matches_conversions_by_exact_name(tmp_path):
    from app.library import CONVERTING, NEEDS_CONVERSION, Library

    models = tmp_path / "models"
    for repo in ("Org/Model", "Org/Model-Instruct"):
        src = models / repo.replace("/", "--")
        src.mkdir(parents=True)
        (src / "config.json").write_text("{}")
        (src / "source.json").write_text(json.dumps({"repo_id": repo, "revision": "abc"}))
    (models / "Model-Instruct-int4.partial").mkdir()
    lib = Library(models, catalog=[])
    assert {m.key: m.status for m in lib.models()} == {"Org/Model": NEEDS_CONVERSION,
                                                      "Org/Model-Instruct": CONVERTING}


def test_files_in_repo_subfolders_land_in_the_same_subfolders(hub, models):
    hub.add_config_only("org/nested", {"model_type": "qwen3_moe"},
                        extra_files={"original/params.json": b'{"dim": 8}', "metal/model.safetensors": b"x" * 1000})
    mgr = manager(hub, models)
    job = mgr.add("org/nested", allow_patterns=["*.json", "original/*"])
    assert sorted(f.path for f in job.files) == ["config.json", "original/params.json"]
    mgr.start()
    done = mgr.wait(job.id, timeout=20)
    mgr.shutdown()
    assert done.state == DONE, done.error
    assert (done.dest_path / "original" / "params.json").read_bytes() == b'{"dim": 8}'
    assert not (done.dest_path / "metal").exists()


def test_ctrl_c_pauses_the_download_command_and_the_same_command_resumes(hub, freetoken_home, tiny_checkpoints,
                                                                         capsys):
    from app.cli import main

    hub.throttle_bps = 150_000
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT), "FREETOKEN_HOME": str(freetoken_home)}
    argv = ["download", REPO, "--endpoint", hub.url, "--no-convert", "--include", "*.safetensors"]
    # Ctrl-C as a terminal delivers it: SIGINT at its default in the command. A test run started as a background
    # job of a non-interactive shell (`.ci/run &`) ignores SIGINT, every child inherits that, and Python keeps an
    # ignored SIGINT ignored - the command then finished its download and exited 0
    proc = subprocess.Popen([sys.executable, "-m", "ui.entry", *argv], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = freetoken_home / "models" / REPO.replace("/", "--") / PARTIAL_DIR
    try:
        wait_for(lambda: partial.exists() and any(p.stat().st_size > 0 for p in partial.glob("*.part")), 60)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "paused" in err and "same command" in err
    [saved] = json.loads((freetoken_home / "data" / "downloads.json").read_text())["jobs"]
    assert saved["state"] == PAUSED
    sizes = {p.name[:-len(".part")]: p.stat().st_size for p in partial.glob("*.part")}
    hub.throttle_bps = 0
    assert main(argv) == 0                                  # the same command, again: it resumes
    assert "resuming" in capsys.readouterr().err
    for name, size in sizes.items():
        if size:
            assert f"bytes={size}-" in hub.file_requests(name)
    assert_identical(tiny_checkpoints("qwen3_moe"), freetoken_home / "models" / REPO.replace("/", "--"),
                     shards(tiny_checkpoints("qwen3_moe")))


def test_an_unforeseen_file_system_error_fails_the_job_instead_of_hanging_it(hub, models):
    hub.add_config_only("org/nested", {"model_type": "qwen3_moe"}, extra_files={"original/params.json": b"{}"})
    mgr = manager(hub, models, concurrency=1)
    job = mgr.add("org/nested")
    job.dest_path.mkdir(parents=True)
    (job.dest_path / "original").write_text("a file where the subfolder should go")
    mgr.start()
    failed = mgr.wait(job.id, timeout=20)
    mgr.shutdown()
    assert failed.state == FAILED and "original/params.json" in failed.error
    assert not (job.dest_path / SOURCE_FILE).exists()
